"""The orchestrator: one node at a time (elected through etcd, see `member`) forms the vbucket map,
fails over nodes whose lease has been gone longer than the timeout, takes failed-over nodes back
as replicas when they return, and carries out rebalances one vbucket move at a time. Everything
it decides is written to etcd (the map, the rebalance's progress) before it is relied on, so a
new orchestrator takes over where the last one stopped."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Protocol

from sluice.cluster import topicmap, vbmap
from sluice.cluster.etcd import Etcd, EtcdError, KeyValue
from sluice.cluster.keys import Keys, dump
from sluice.cluster.settings import LEASE_TTL, ClusterSettings

log = logging.getLogger("sluice.cluster")

MOVE_TIMEOUT = 120.0
# Actives a node takes over at once in a rebalance (Couchbase's default moves per node).
MOVES_PER_NODE = 4
# How long a finished rebalance waits for its replicas' streams to register on their actives.
REGISTER_WAIT = 30.0
# How much older than a node's last status its previous one may be to count as "the time
# before" (nodes publish every half second).
STATUS_BEFORE_MAX_AGE = 2.0


def node_entry(registration: dict[str, Any]) -> dict[str, Any]:
    """What the map keeps of a node's registration: its KV, TANK and iproto addresses and group."""
    return {
        "kv": registration["kv"],
        "tank": registration.get("tank", ""),
        "iproto": registration.get("iproto", ""),
        "group": registration.get("group", ""),
    }


def handed_over(
    statuses: dict[str, dict[str, Any]], revision: int, old: str, new: str, topic: str, partition: int
) -> bool:
    """Whether a partition's leader may move from `old` to `new`: `old` runs the map of
    `revision` (no node leads the partition there: it takes no more messages) and `new` holds
    everything `old` holds, as both last published."""
    was, will = statuses.get(old), statuses.get(new)
    if was is None or will is None or was.get("map_revision", 0) < revision:
        return False
    marks = [s.get("topics", {}).get(topic, {}).get("hwm", []) for s in (was, will)]
    if any(partition >= len(m) for m in marks):
        return False
    return marks[1][partition] >= marks[0][partition]


class Host(Protocol):
    """What the orchestrator uses of the member that runs it (a `member.Member`), named here
    rather than imported: the member imports this module to start the orchestrator."""

    etcd: Etcd
    keys: Keys
    s: ClusterSettings
    stop_event: threading.Event


class Orchestrator:
    def __init__(self, member: Host) -> None:
        self.m = member
        self.etcd = member.etcd
        self.keys = member.keys
        self.s = member.s
        self.lease_ttl = LEASE_TTL
        self.absent_since: dict[str, float] = {}
        self._told_budget: set[str] = set()
        # Topics said to be unplaceable (no node with a TANK address), said once each.
        self.unplaceable: set[str] = set()
        # Per node: the etcd revision and content of its last status read, and the status it
        # published before that one (what a copy must hold to join those in sync).
        self._last_status: dict[str, tuple[int, dict[str, Any]]] = {}
        self._status_before: dict[str, dict[str, Any]] = {}

    # -- reading and writing the map

    def registered(self) -> dict[str, dict[str, Any]]:
        """The nodes registered now (each with its `incarnation`: a restarted node has a new one)."""
        kvs, _ = self.etcd.get_prefix(self.keys.node())
        return {kv.key.rsplit("/", 1)[1]: kv.json() for kv in kvs}

    def read_map(self) -> tuple[dict[str, Any], int] | None:
        kv = self.etcd.get(self.keys.map)
        return (kv.json(), kv.mod_revision) if kv else None

    def publish(self, doc: dict[str, Any], revision: int) -> bool:
        """Writes the map if nobody else changed it since `revision`."""
        return self.etcd.put_if(self.keys.map, dump(doc), mod_revision=revision) is not None

    def seqnos(self, alive: set[str] | None, *, fresh: bool = False) -> dict[str, dict[int, int]]:
        """Per node alive (None: every node), per vbucket: the sum over buckets of its high
        seqnos. `fresh`: only statuses published after this call began count (waiting up to
        2 s for them), so that a failover compares where the replicas stand now that their
        active is gone, not where they stood half a second before."""
        kvs, since = self.etcd.get_prefix(self.keys.status())
        if fresh and alive:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                stale = {kv.key.rsplit("/", 1)[1] for kv in kvs if kv.mod_revision <= since} & alive
                if not stale:
                    break
                time.sleep(0.05)
                kvs, _ = self.etcd.get_prefix(self.keys.status())
        out: dict[str, dict[int, int]] = {}
        for kv in kvs:
            name = kv.key.rsplit("/", 1)[1]
            if alive is not None and name not in alive:
                continue
            per_vb: dict[int, int] = {}
            for b in kv.json()["buckets"].values():
                for vb, h in enumerate(b["high"]):
                    per_vb[vb] = per_vb.get(vb, 0) + h
            out[name] = per_vb
        return out

    # -- one round

    def tick(self) -> bool:
        """One round; True when it changed something and another should follow at once."""
        nodes = self.registered()
        current = self.read_map()
        if current is None:
            self.form(nodes)
            return False
        doc, revision = current
        return (
            self.handle_requests(doc, revision, nodes)
            or self.fail_over_the_gone(doc, revision, nodes)
            or self.take_back_the_returned(doc, revision, nodes)
            or self.place_topics(doc, revision)
            or self.admit_caught_up_copies(doc, revision, nodes)
            or self.rebalance_step(doc, revision, nodes)
        )

    def form(self, nodes: dict[str, dict[str, Any]]) -> None:
        me = self.s.node
        info = nodes.get(me)
        if info is None:
            return
        doc = {
            "nodes": {me: node_entry(info)},
            "wanted": [me],
            "chains": vbmap.balance([me], self.s.num_vbuckets, self.s.replicas),
            "replicas": self.s.replicas,
            "num_vbuckets": self.s.num_vbuckets,
            "failed": {},
            "auto_failovers": 0,
        }
        if self.etcd.put_if(self.keys.map, dump(doc)) is not None:
            log.warning("cluster %s formed by %s: every vbucket active on it", self.s.cluster, me)

    # -- topics

    def topic_marks(
        self, field: str = "hwm", statuses: dict[str, dict[str, Any]] | None = None
    ) -> dict[str, dict[str, list[int]]]:
        """Per node, per topic: each partition's high-water mark (or, with `field` "branch",
        its branch of history; "led", the partitions it leads), as `statuses` (default: as last
        published) give them."""
        if statuses is None:
            statuses = self.statuses()
        return {
            node: {name: t.get(field, []) for name, t in st.get("topics", {}).items()}
            for node, st in statuses.items()
        }

    def statuses_before(self, statuses: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Per node of `statuses` (the last read), the status it published the time before.
        Only one at most STATUS_BEFORE_MAX_AGE older by the node's own clock: one this
        orchestrator kept through a long step (a task waits up to MOVE_TIMEOUT) would let a copy
        far behind count as in sync."""
        return {
            n: st
            for n, st in self._status_before.items()
            if n in statuses and 0 <= statuses[n].get("at", 0) - st.get("at", 0) <= STATUS_BEFORE_MAX_AGE
        }

    def place_topics(self, doc: dict[str, Any], revision: int) -> bool:
        """Places the topics a node declared (its status names them) that the map lacks: each
        partition led by one node and copied by as many as the map's `replicas`, leaders and
        copies spread over the map's nodes as vbuckets' are (server groups too). Every copy
        starts in sync (a new partition is empty, or its messages are where it is led)."""
        placed = doc.get("topics", {})
        declared: dict[str, dict[str, Any]] = {}
        # Per topic, per node: each partition's high-water mark there.
        held: dict[str, dict[str, list[int]]] = {}
        kvs, _ = self.etcd.get_prefix(self.keys.status())
        for kv in sorted(kvs, key=lambda kv: kv.key):
            node = kv.key.rsplit("/", 1)[1]
            for name, t in kv.json().get("topics", {}).items():
                declared.setdefault(name, t)
                held.setdefault(name, {})[node] = t.get("hwm", [])
        # A node's TANK and iproto addresses come with its registration (maps from before they
        # were kept lack them, and a node may come back listening elsewhere).
        nodes = dict(doc["nodes"])
        for n, info in self.registered().items():
            if n not in nodes:
                continue
            moved = {k: info[k] for k in ("tank", "iproto") if info.get(k) and info[k] != nodes[n].get(k)}
            if moved:
                nodes[n] = {**nodes[n], **moved}
        new = {n: t for n, t in declared.items() if n not in placed}
        if not new and nodes == doc["nodes"]:
            return False
        # Partitions are led by nodes TANK clients can be sent to.
        members = [n for n in nodes if n not in doc["failed"] and nodes[n].get("tank")]
        if new and not members:
            unplaced = sorted(set(new) - self.unplaceable)
            if unplaced:
                log.error(
                    "cluster: topic(s) %s not placed: no node of the map that is not failed over has "
                    "a TANK address clients can be sent to (an IPv4 tank_listen); none leads them "
                    "until one does",
                    ", ".join(unplaced),
                )
                self.unplaceable |= set(unplaced)
            return False
        topics = dict(placed)
        groups = {n: nodes[n].get("group", "") for n in members}
        for name, t in sorted(new.items()):
            chains = vbmap.balance(
                members,
                t["partitions"],
                topicmap.replicas_of(t.get("settings", ""), doc["replicas"]),
                groups=groups if any(groups.values()) else None,
            )
            in_sync = [[n for n in c if n is not None] for c in chains]
            # A partition that already holds messages somewhere (a topic a node held before it
            # joined the cluster; in a cluster, no node takes messages for a partition the map
            # does not place) is led where it holds the most: what was acknowledged stays
            # reachable.
            for p in range(t["partitions"]):
                hwms = {
                    n: h[p] for n, h in held.get(name, {}).items() if n in members and p < len(h) and h[p]
                }
                if hwms:
                    # Led where it holds the most, copied by the others placed; they join those
                    # in sync once they hold as much (`admit_caught_up_copies`).
                    best = max(sorted(hwms), key=lambda n: hwms[n])
                    rest = [n for n in chains[p] if n != best]
                    chains[p] = [best, *rest[: len(chains[p]) - 1]]
                    in_sync[p] = [best]
            settings = t.get("settings", "")
            topics[name] = {
                "partitions": t["partitions"],
                "settings": settings,
                "chains": chains,
                "isr": in_sync,
            }
        if not self.publish({**doc, "nodes": nodes, "topics": topics}, revision):
            return False
        for name in sorted(new):
            log.warning(
                "cluster: topic %s placed: %d partition(s) led by %s",
                name,
                new[name]["partitions"],
                ", ".join(sorted({c[0] for c in topics[name]["chains"] if c[0]})),
            )
        return True

    def admit_caught_up_copies(self, doc: dict[str, Any], revision: int, nodes: dict[str, Any]) -> bool:
        """Copies that caught up with their leader, on its branch of history, join those in
        sync."""
        if not doc.get("topics"):
            return False
        statuses = self.statuses()
        topics, joined = topicmap.admit_caught_up(
            doc["topics"],
            self.topic_marks(statuses=statuses),
            set(nodes),
            self.topic_marks("branch", statuses),
            self.topic_marks("led", statuses),
            self.topic_marks(statuses=self.statuses_before(statuses)),
        )
        if not joined or not self.publish({**doc, "topics": topics}, revision):
            return False
        for name, p, n in joined:
            log.warning("cluster: %s's copy of topic %s partition %d is in sync", n, name, p)
        return True

    def move_topics(self, doc: dict[str, Any], revision: int) -> bool | None:
        """One step of moving the topics' partitions to a balanced placement over the wanted
        nodes: True when it changed the map, False while copies catch up, None when every
        partition is where it should be. A partition's new copies are added first and copy it
        from its leader; once every node of its new chain is in sync, the chain becomes the new
        one. A leader changes in two steps, so that no message is taken by the old leader after
        the new one started: first no node leads the partition (TANK clients are told so and
        retry), and once the old leader applied that and the new one holds all it holds, the
        new one leads. A partition without a leader stays as it is, waiting for its copy in
        sync."""
        topics = doc.get("topics", {})
        wanted = [n for n in doc["wanted"] if n not in doc["failed"] and doc["nodes"].get(n, {}).get("tank")]
        if not topics or not wanted:
            return None
        groups = {n: doc["nodes"][n].get("group", "") for n in wanted}
        changed = waiting = False
        out = {}
        statuses = self.statuses()
        for name, t in topics.items():
            chains = [list(c) for c in t["chains"]]
            in_sync = topicmap.in_sync_copies(t)
            handover = dict(t.get("handover", {}))
            replicas = topicmap.replicas_of(t.get("settings", ""), doc["replicas"])
            current = [c[: 1 + replicas] if c[0] is not None else c for c in chains]
            target = vbmap.balance(
                wanted,
                len(chains),
                replicas,
                current=current,
                groups=groups if any(groups.values()) else None,
            )
            for p, (chain, goal) in enumerate(zip(chains, target, strict=True)):
                if chain[0] is None:
                    # No leader: its last copy in sync is away. One being removed holds the
                    # rebalance rather than leave the partition without it for good.
                    if not any(n in wanted for n in in_sync[p]):
                        waiting = True
                    continue
                if chain == goal:
                    continue
                arriving = [n for n in goal if n is not None and n not in chain]
                if str(p) in handover:
                    if handed_over(statuses, revision, chain[0], goal[0], name, p):
                        del handover[str(p)]
                        chains[p] = goal
                        in_sync[p] = [n for n in in_sync[p] if n in goal]
                        changed = True
                    else:
                        waiting = True
                elif arriving:
                    chains[p] = [*chain, *arriving]
                    changed = True
                elif any(n is not None and n not in in_sync[p] for n in goal):
                    waiting = True
                elif goal[0] != chain[0]:
                    handover[str(p)] = goal[0]
                    changed = True
                else:
                    chains[p] = goal
                    in_sync[p] = [n for n in in_sync[p] if n in goal]
                    changed = True
            out[name] = {**t, "chains": chains, "isr": in_sync, "handover": handover}
        if changed:
            if self.publish({**doc, "topics": out}, revision):
                log.warning("cluster: rebalance: topic partitions moving")
            return True
        return False if waiting else None

    # -- failover

    def fail_over_the_gone(self, doc: dict[str, Any], revision: int, nodes: dict[str, Any]) -> bool:
        now = time.monotonic()
        members = [n for n in doc["nodes"] if n not in doc["failed"]]
        for n in members:
            if n in nodes:
                self.absent_since.pop(n, None)
                self._told_budget.discard(n)
            else:
                self.absent_since.setdefault(n, now)
        # The lease expired `lease_ttl` after the node's last renewal: count from there.
        wait = max(0.0, self.s.auto_failover_timeout - self.lease_ttl)
        for n, since in sorted(self.absent_since.items(), key=lambda x: x[1]):
            if n not in members or now - since < wait:
                continue
            if doc.get("auto_failovers", 0) >= self.s.max_auto_failovers:
                if n not in self._told_budget:
                    log.warning(
                        "cluster: %s has been gone %.1f s, but %d automatic failover(s) were done "
                        "and not acknowledged (`sluice cluster reset-failovers`); not failing it over",
                        n,
                        now - since,
                        doc.get("auto_failovers", 0),
                    )
                    self._told_budget.add(n)
                continue
            return self.fail_over(doc, revision, n, set(nodes), automatic=True)
        return False

    def fail_over(
        self,
        doc: dict[str, Any],
        revision: int,
        node: str,
        alive: set[str],
        *,
        automatic: bool,
        registration: dict[str, Any] | None = None,
    ) -> bool:
        """Fails `node` over; `registration` is its registration if it is still up."""
        chains, lost = vbmap.fail_over(doc["chains"], node, self.seqnos(alive, fresh=True), alive)
        held = vbmap.held_by(doc["chains"], node)
        promoted = sum(1 for c in doc["chains"] if c and c[0] == node) - len(lost)
        # A node failed over while it runs (by hand) is taken back only once it registers anew.
        since = registration.get("incarnation", "") if registration else ""
        topics, had, orphaned = topicmap.fail_over(doc.get("topics", {}), node, self.topic_marks(), alive)
        failed = {**doc["failed"], node: {"held": held, "incarnation": since, "partitions": had}}
        doc = {**doc, "chains": chains, "failed": failed, "topics": topics}
        if automatic:
            doc["auto_failovers"] = doc.get("auto_failovers", 0) + 1
        if not self.publish(doc, revision):
            return False
        self.absent_since.pop(node, None)
        log.warning(
            "cluster: %s failed over%s: %d vbucket(s) promoted on their replicas%s",
            node,
            " automatically" if automatic else "",
            promoted,
            f", {len(lost)} without a replica to promote" if lost else "",
        )
        if orphaned:
            log.warning(
                "cluster: %d topic partition(s) have no copy in sync left and no leader until %s returns: %s",
                len(orphaned),
                node,
                ", ".join(f"{t}/{p}" for t, p in orphaned),
            )
        reb = self.etcd.get(self.keys.rebalance)
        if reb is not None and reb.json().get("state") == "running":
            # The rebalance goes on over the nodes left.
            target = self.target(doc, {})
            moves = sum(1 for a, b in zip(doc["chains"], target, strict=True) if a != b)
            self.set_rebalance(reb, target=target, total=reb.json()["done"] + moves, phase="moving")
            log.warning("cluster: the rebalance goes on without %s: %d move(s) left", node, moves)
        return True

    def take_back_the_returned(self, doc: dict[str, Any], revision: int, nodes: dict[str, Any]) -> bool:
        for n, record in doc["failed"].items():
            if n in nodes and nodes[n].get("incarnation") != record["incarnation"]:
                chains = vbmap.take_back(doc["chains"], n, record["held"])
                topics = topicmap.take_back(doc.get("topics", {}), n, record.get("partitions", {}))
                rest = {k: v for k, v in doc["failed"].items() if k != n}
                # It may listen elsewhere now: clients are sent where it is.
                info = {**doc["nodes"], n: node_entry(nodes[n])}
                back = {**doc, "nodes": info, "chains": chains, "failed": rest, "topics": topics}
                if self.publish(back, revision):
                    log.warning("cluster: %s is back; it is a replica again of what it held", n)
                return True
        return False

    # -- requests from `sluice cluster`

    def handle_requests(self, doc: dict[str, Any], revision: int, nodes: dict[str, Any]) -> bool:
        kvs, _ = self.etcd.get_prefix(self.keys.request())
        for kv in kvs:
            what = kv.key[len(self.keys.request()) :]
            self.etcd.delete(kv.key)
            if what.startswith("failover/"):
                node = what.split("/", 1)[1]
                if node in doc["nodes"] and node not in doc["failed"]:
                    alive = set(nodes) - {node}
                    self.fail_over(doc, revision, node, alive, automatic=False, registration=nodes.get(node))
                    return True
                log.warning(
                    "cluster: failover of %s asked for, but it is not in the map or failed over", node
                )
            elif what == "rebalance":
                self.start_rebalance(doc, revision, nodes)
                return True
            elif what == "stop-rebalance":
                reb = self.etcd.get(self.keys.rebalance)
                if reb is not None and reb.json().get("state") == "running":
                    self.set_rebalance(reb, state="stopped")
                    log.warning("cluster: rebalance stopped on request")
            elif what == "reset-failovers":
                self.publish({**doc, "auto_failovers": 0}, revision)
                return True
        return False

    # -- rebalance

    def set_rebalance(self, kv: KeyValue, **changes: Any) -> None:
        self.etcd.put(self.keys.rebalance, dump({**kv.json(), **changes, "updated": time.time()}))

    def start_rebalance(self, doc: dict[str, Any], revision: int, nodes: dict[str, Any]) -> None:
        wanted = [n for n in doc["wanted"] if n not in doc["failed"]]
        missing = [n for n in wanted if n not in nodes]
        if missing or not wanted:
            why = f"not registered: {', '.join(missing)}" if missing else "no node is wanted"
            self.etcd.put(
                self.keys.rebalance, dump({"state": "failed", "error": why, "updated": time.time()})
            )
            log.warning("cluster: rebalance refused: %s", why)
            return
        target = self.target(doc, nodes)
        infos = {n: node_entry(nodes[n]) for n in wanted}
        # Every node of the target is in the map (as a server) before anything moves to it.
        doc = {**doc, "nodes": {**doc["nodes"], **infos}}
        if not self.publish(doc, revision):
            return
        moves = sum(1 for a, b in zip(doc["chains"], target, strict=True) if a != b)
        self.etcd.put(
            self.keys.rebalance,
            dump(
                {
                    "state": "running",
                    "target": target,
                    "total": moves,
                    "done": 0,
                    "pauses_ms": [],
                    "items": 0,
                    "started": time.time(),
                    "updated": time.time(),
                }
            ),
        )
        log.warning(
            "cluster: rebalance started: %d vbucket chain(s) to change over %s", moves, ", ".join(wanted)
        )

    def target(self, doc: dict[str, Any], nodes: dict[str, Any]) -> list[vbmap.Chain]:
        """The balanced map over the wanted nodes not failed over, from the map in use."""
        wanted = [n for n in doc["wanted"] if n not in doc["failed"]]
        info = {**doc["nodes"], **nodes}
        groups = {n: info.get(n, {}).get("group", "") for n in wanted}
        return vbmap.balance(
            wanted,
            doc["num_vbuckets"],
            doc["replicas"],
            current=doc["chains"],
            groups=groups if any(groups.values()) else None,
        )

    def rebalance_step(self, doc: dict[str, Any], revision: int, nodes: dict[str, Any]) -> bool:
        """The next move of the rebalance under way, if any; True when one was made."""
        kv = self.etcd.get(self.keys.rebalance)
        if kv is None:
            return False
        reb = kv.json()
        if reb.get("state") != "running":
            return False
        target = reb["target"]
        chains = doc["chains"]
        todo = [vb for vb in range(len(target)) if chains[vb] != target[vb]]
        if not todo and not self.replicas_caught_up(chains, reb.get("caught_up_from")):
            if "caught_up_from" not in reb:
                self.set_rebalance(kv, phase="replicas catching up", caught_up_from=self.highs())
            return False
        if not todo and not self.replicas_streaming(doc):
            # Until then a majority write may find its replica missing (DURABILITY_IMPOSSIBLE);
            # bounded, as a replica that never comes is the failover's business.
            since = reb.get("registering_since")
            if since is None:
                self.set_rebalance(kv, phase="replicas registering", registering_since=time.time())
                return False
            if time.time() - since < REGISTER_WAIT:
                return False
            log.warning("cluster: rebalance ends with replicas not yet streaming from their actives")
        if not todo:
            # Then the topics' partitions, a step at a time.
            moved = self.move_topics(doc, revision)
            if moved is not None:
                if reb.get("phase") != "moving partitions":
                    self.set_rebalance(kv, phase="moving partitions")
                return moved
            wanted = set(doc["wanted"])
            gone = [n for n in doc["nodes"] if n not in wanted]
            done = {**doc, "nodes": {n: i for n, i in doc["nodes"].items() if n in wanted}}
            done["failed"] = {n: v for n, v in doc["failed"].items() if n in wanted}
            if self.publish(done, revision):
                self.set_rebalance(kv, state="done", finished=time.time())
                log.warning(
                    "cluster: rebalance done: %d move(s)%s",
                    reb["total"],
                    f"; removed {', '.join(gone)}" if gone else "",
                )
            return False
        absent = sorted({n for t in target for n in t if n is not None and n not in nodes})
        if absent:
            # It may come back; if it is failed over instead, the target is worked out anew.
            if reb.get("phase") != "waiting":
                self.set_rebalance(kv, phase="waiting", waiting_for=absent)
                log.warning("cluster: rebalance waits: %s gone", ", ".join(absent))
            return False
        if reb.get("phase") == "waiting":
            self.set_rebalance(kv, phase="moving", waiting_for=[])
            return True
        growing = {
            vb: chains[vb] + [n for n in target[vb] if n is not None and n not in chains[vb]]
            for vb in todo
            if any(n is not None and n not in chains[vb] for n in target[vb])
        }
        if growing:
            # Every copy the target adds becomes a replica, and catches up, before any copy is
            # dropped or any active moves: a failover meanwhile still finds a whole replica,
            # and a moving active's new home already holds its data.
            grown = [growing.get(vb, c) for vb, c in enumerate(chains)]
            if self.publish({**doc, "chains": grown}, revision):
                self.set_rebalance(kv, phase="building replicas", caught_up_from=self.highs())
                log.warning("cluster: rebalance: %d new replica(s) catching up", len(growing))
            return True
        if reb.get("phase") == "building replicas":
            if not self.replicas_caught_up(chains, reb.get("caught_up_from")):
                return False
            self.set_rebalance(kv, phase="moving")
            return True
        # Chains whose active stays need no handover: changed all at once. Actives move a few
        # at a time per receiving node, every node's in parallel.
        quiet = [vb for vb in todo if target[vb][0] == chains[vb][0] or chains[vb][0] is None]
        batch: dict[str, list[int]] = {}
        if not quiet:
            for vb in todo:
                moves = batch.setdefault(target[vb][0], [])
                if len(moves) < MOVES_PER_NODE:
                    moves.append(vb)
        results = self.run_tasks(
            {
                node: {
                    "kind": "takeover",
                    "moves": [{"vbucket": vb, "source": doc["nodes"][chains[vb][0]]["kv"]} for vb in vbs],
                }
                for node, vbs in batch.items()
            }
        )
        outcomes = []  # (vbucket, node, ok, per-bucket reports or why)
        for node, vbs in batch.items():
            ok, result = results[node]
            by_vb = {m["vbucket"]: m for m in result.get("moves", [])} if ok else {}
            for vb in vbs:
                m = by_vb.get(vb)
                if m is None:
                    outcomes.append((vb, node, False, result if not ok else "no outcome"))
                else:
                    outcomes.append((vb, node, m["ok"], m["reports"] if m["ok"] else m["error"]))
        moved = quiet + [vb for vb, _, ok, _ in outcomes if ok]
        while moved:
            changed = [list(c) for c in doc["chains"]]
            for vb in moved:
                changed[vb] = target[vb]
            if self.publish({**doc, "chains": changed}, revision):
                break
            current = self.read_map()
            if current is None:
                return False
            doc, revision = current
        # Per move, a report per bucket; its pause is the longest of them.
        reports = [r for _, _, ok, r in outcomes if ok]
        progress = {
            "done": reb["done"] + len(moved),
            "items": reb.get("items", 0) + sum(r["items"] for rs in reports for r in rs),
            "pauses_ms": reb.get("pauses_ms", [])
            + [round(max(r["writes_paused_ms"] for r in rs), 2) for rs in reports if rs],
        }
        failed = sorted((vb, node, why) for vb, node, ok, why in outcomes if not ok)
        if failed:
            error = "; ".join(f"moving vbucket {vb} to {node}: {why}" for vb, node, why in failed)
            self.set_rebalance(kv, **progress, state="failed", error=error)
            log.warning("cluster: rebalance failed %s", error)
            return False
        self.set_rebalance(kv, **progress)
        return True

    def highs(self) -> dict[str, list[int]]:
        """Per node, per vbucket: the sum over buckets of its high seqnos, as last published."""
        return {
            n: [v.get(vb, 0) for vb in range(max(v, default=-1) + 1)] for n, v in self.seqnos(None).items()
        }

    def statuses(self) -> dict[str, dict[str, Any]]:
        """What each node last published of its vbuckets and topics."""
        kvs, _ = self.etcd.get_prefix(self.keys.status())
        out = {}
        for kv in kvs:
            node, status = kv.key.rsplit("/", 1)[1], kv.json()
            seen = self._last_status.get(node)
            if seen is not None and seen[0] != kv.mod_revision:
                self._status_before[node] = seen[1]
            self._last_status[node] = (kv.mod_revision, status)
            out[node] = status
        return out

    def replicas_streaming(self, doc: dict[str, Any]) -> bool:
        """Whether every active has each replica of its chain streaming from it, as the nodes
        last published (by address: a stream from a copy on its way out does not count)."""
        status = self.statuses()
        for vb, chain in enumerate(doc["chains"]):
            if chain[0] is None:
                continue
            st = status.get(chain[0])
            if st is None:
                return False
            want = {doc["nodes"][r]["kv"] for r in chain[1:] if r is not None}
            if any(not want <= set(b["followers"][vb]) for b in st["buckets"].values()):
                return False
        return True

    def replicas_caught_up(self, chains: list[vbmap.Chain], since: dict[str, list[int]] | None) -> bool:
        """Whether every replica of the map holds its vbucket as a replica, and has reached
        where its active was when the wait began (`since`, or now)."""
        status = self.statuses()
        since = since or self.highs()
        for vb, chain in enumerate(chains):
            active = chain[0]
            for r in chain[1:]:
                if r is None:
                    continue
                st = status.get(r)
                if st is None:
                    return False
                for b in st["buckets"].values():
                    if b["state"][vb] != "r":
                        return False
                high = sum(b["high"][vb] for b in st["buckets"].values())
                wanted = since.get(active, []) if active else []
                if vb < len(wanted) and high < wanted[vb]:
                    return False
        return True

    def run_tasks(self, tasks: dict[str, dict[str, Any]]) -> dict[str, tuple[bool, Any]]:
        """Asks each node to carry out its task, all at once, and waits for their results:
        per node, (True, the result) or (False, why)."""
        ids = {}
        for node, task in tasks.items():
            task = {**task, "id": uuid.uuid4().hex, "timeout": MOVE_TIMEOUT}
            self.etcd.put(self.keys.task(node), dump(task))
            ids[node] = task["id"]
        results: dict[str, tuple[bool, Any]] = {}
        deadline = time.monotonic() + MOVE_TIMEOUT + 10
        try:
            while len(results) < len(ids) and time.monotonic() < deadline and not self.m.stop_event.is_set():
                for node, task_id in ids.items():
                    r = self.etcd.get(self.keys.result(node)) if node not in results else None
                    if r is not None and r.json().get("id") == task_id:
                        result = r.json()
                        ok = bool(result.get("ok"))
                        results[node] = (ok, result if ok else result.get("error"))
                time.sleep(0.02)
        finally:
            for node in ids:
                try:
                    self.etcd.delete(self.keys.task(node))
                except EtcdError:
                    pass
        return {node: results.get(node, (False, "no answer in time")) for node in ids}
