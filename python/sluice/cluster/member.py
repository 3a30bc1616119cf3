"""A node's place in a cluster: it registers in etcd under a lease it keeps alive, publishes where
its vbuckets stand, converges on the vbucket map whenever it changes, carries out the vbucket
moves the orchestrator asks of it, and stands for orchestrator (the holder of the
`orchestrator` key, under its lease, runs `Orchestrator`).

Losing etcd stops none of what the node serves: the map last seen stays in force, and the
threads keep trying until etcd answers again."""

from __future__ import annotations

import concurrent.futures
import ipaddress
import logging
import os
import threading
import time
import uuid
from typing import Any

from sluice.cluster.etcd import Etcd, EtcdError, KeyValue
from sluice.cluster.keys import Keys, dump
from sluice.cluster.orchestrator import Orchestrator
from sluice.cluster.settings import LEASE_TTL, ClusterSettings
from sluice.cluster.topicmap import in_sync_copies

log = logging.getLogger("sluice.cluster")

STATUS_INTERVAL = 0.5


def map_servers(doc: dict[str, Any]) -> list[str]:
    """The map's node names in server-list order: those failed over are left out, so that
    clients drop their connections to them (and what waited there goes to the new actives)."""
    return sorted(n for n in doc["nodes"] if n not in doc.get("failed", {}))


class Member:
    def __init__(self, server: Any, engine: Any, settings: ClusterSettings) -> None:
        self.server = server
        self.engine = engine
        self.s = settings
        self.etcd = settings.etcd
        self.keys = Keys(settings.cluster)
        self.stop_event = threading.Event()
        self.lease = 0
        self.map_revision = 0
        # Per topic, the partitions this node leads under the map it applied (each with a
        # branch of history started here before it was put in force).
        self.led: dict[str, list[int]] = {}
        # This process's run: a node failed over while it runs is taken back once it restarts.
        self.incarnation = uuid.uuid4().hex
        self._threads: list[threading.Thread] = []
        self._task_lock = threading.Lock()
        self._etcd_down_since: float | None = None
        # What the watch has seen of the cluster, reported to the server when it changes.
        self._view: dict[str, Any] = {"up": set(), "orchestrator": "", "rebalance": None, "map": None}
        self._reported: dict[str, Any] | None = None

    def start(self) -> None:
        for target, name in (
            (self._lease_loop, "lease"),
            (self._watch_loop, "watch"),
            (self._orchestrator_loop, "orchestrator"),
        ):
            t = threading.Thread(target=target, name=f"sluice-cluster-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Leaves the loops; the lease is left to expire (a stopped node is gone like a dead one,
        and the other nodes fail it over after the timeout)."""
        self.stop_event.set()
        for t in self._threads:
            t.join(timeout=5)

    # -- etcd going away and coming back

    def _etcd_failed(self, e: EtcdError) -> None:
        if self._etcd_down_since is None:
            self._etcd_down_since = time.monotonic()
            log.warning("cluster: etcd unreachable (%s); serving on with the map last seen", e)

    def _etcd_ok(self) -> None:
        if self._etcd_down_since is not None:
            log.warning("cluster: etcd answers again after %.1f s", time.monotonic() - self._etcd_down_since)
            self._etcd_down_since = None

    # -- registration and status

    def _register(self) -> None:
        self.lease, ttl = self.etcd.grant(LEASE_TTL)
        info = {
            "kv": self.s.kv,
            "tank": self.s.tank,
            "iproto": self.s.iproto,
            "group": self.s.group,
            "admin": self.s.admin,
            "pid": os.getpid(),
            "incarnation": self.incarnation,
        }
        self.etcd.put(self.keys.node(self.s.node), dump(info), lease=self.lease)
        log.info("cluster %s: registered as %s (lease TTL %d s)", self.s.cluster, self.s.node, ttl)

    def status(self) -> dict[str, Any]:
        out = {}
        for b in self.s.buckets:
            high = self.engine.high_seqnos(bucket=b)
            out[b] = {
                "high": high,
                "persisted": self.engine.persisted_seqnos(bucket=b),
                "state": "".join(self.engine.vbucket_state(v, bucket=b)[0] for v in range(len(high))),
                # The KV addresses of the replicas streaming each vbucket from here (what
                # majority writes count).
                "followers": self.server.followers(b),
            }
        # The topics it holds, which the orchestrator places over the cluster.
        topics = {
            name: {
                "partitions": n,
                "settings": settings,
                "hwm": self.engine.topic_high_water_marks(name),
                # A copy on its leader's branch holds nothing its leader lacks; a leader's branch
                # counts once its status says it leads (it started that branch first).
                "branch": self.engine.topic_branches(name),
                "led": self.led.get(name, []),
            }
            for name, n, settings in self.engine.topics()
        }
        return {"buckets": out, "topics": topics, "map_revision": self.map_revision, "at": time.time()}

    def _lease_loop(self) -> None:
        next_keepalive = 0.0
        while not self.stop_event.is_set():
            try:
                if not self.lease:
                    self._register()
                now = time.monotonic()
                if now >= next_keepalive:
                    if self.etcd.keepalive(self.lease) == 0:
                        log.warning("cluster: the lease of %s expired; registering again", self.s.node)
                        self.lease = 0
                        continue
                    next_keepalive = now + LEASE_TTL / 4
                self.etcd.put(self.keys.status(self.s.node), dump(self.status()), lease=self.lease)
                # What the admin endpoint asked of the cluster, as `sluice cluster` asks it.
                for what in self.server.take_cluster_requests():
                    self.etcd.put(self.keys.request(what), dump({"at": time.time(), "by": self.s.node}))
                    log.warning("cluster: %s requested through %s's admin endpoint", what, self.s.node)
                self._etcd_ok()
            except EtcdError as e:
                self._etcd_failed(e)
            self.stop_event.wait(STATUS_INTERVAL)

    # -- the map and the tasks

    def _watch_loop(self) -> None:
        """Reads the cluster's keys whole, then follows their changes; starts over when the
        watch cannot go on (etcd compacted the revisions it needed)."""
        while not self.stop_event.is_set():
            try:
                kvs, revision = self.etcd.get_prefix(self.keys.root)
            except EtcdError as e:
                self._etcd_failed(e)
                self.stop_event.wait(0.5)
                continue
            self._view["up"] = set()
            self._apply([(kv, False) for kv in kvs])
            try:
                for events, _rev in self.etcd.watch(self.keys.root, revision + 1, self.stop_event):
                    self._apply([(e.kv, e.kind == "delete") for e in events])
            except EtcdError as e:
                log.warning("cluster: watching etcd: %s; reading the cluster's keys again", e)

    def _apply(self, changes: list[tuple[KeyValue, bool]]) -> None:
        for kv, deleted in changes:
            try:
                self._seen(kv, deleted=deleted)
            except Exception:  # noqa: BLE001 - one bad key or a failed convergence must not stop the watch
                log.exception("cluster: acting on %s", kv.key)
        try:
            self._report()
        except Exception:  # noqa: BLE001 - the server may be stopping
            log.exception("cluster: reporting to the server")

    def _seen(self, kv: KeyValue, *, deleted: bool) -> None:
        if kv.key.startswith(self.keys.node()):
            name = kv.key[len(self.keys.node()) :]
            if deleted:
                self._view["up"].discard(name)
            else:
                self._view["up"].add(name)
        elif kv.key == self.keys.orchestrator:
            self._view["orchestrator"] = "" if deleted else kv.value.decode()
        elif deleted:
            return
        elif kv.key == self.keys.rebalance:
            reb = kv.json()
            self._view["rebalance"] = {k: reb.get(k) for k in ("state", "done", "total", "phase", "error")}
        elif kv.key == self.keys.map:
            self._view["map"] = kv.json()
            self.converge(kv)
        elif kv.key == self.keys.task(self.s.node):
            task = kv.json()
            threading.Thread(target=self._run_task, args=(task,), daemon=True).start()

    def _report(self) -> None:
        """Tells the server what this node sees of the cluster (for /status and /metrics)."""
        v = self._view
        doc = v["map"] or {"nodes": {}, "failed": {}, "chains": [], "topics": {}}
        failed = doc.get("failed", {})
        report = {
            "cluster": self.s.cluster,
            "node": self.s.node,
            "nodes_up": len(v["up"]),
            "failed_over": len(failed),
            "orchestrator": v["orchestrator"],
            "orchestrator_here": int(v["orchestrator"] == self.s.node),
            "rebalance": v["rebalance"],
            # The map's nodes and those registered, with their health; where every vbucket's
            # copies and every topic partition's leader are (the web console draws them).
            "nodes": [
                {
                    "name": n,
                    "kv_address": doc["nodes"].get(n, {}).get("kv", ""),
                    "tank_address": doc["nodes"].get(n, {}).get("tank", ""),
                    "up": n in v["up"],
                    "failed_over": n in failed,
                }
                for n in sorted(set(doc["nodes"]) | v["up"])
            ],
            "vbuckets": doc.get("chains", []),
            "topics": {
                name: [c[0] if c and c[0] not in failed else None for c in t["chains"]]
                for name, t in doc.get("topics", {}).items()
            },
            # Per partition, the nodes that copy it and those of them in sync (the leader too).
            "topic_copies": {
                name: [
                    {"copies": [n for n in c[1:] if n is not None], "in_sync": s}
                    for c, s in zip(t["chains"], in_sync_copies(t), strict=True)
                ]
                for name, t in doc.get("topics", {}).items()
            },
        }
        if report != self._reported:
            self.server.report_cluster(dump(report))
            self._reported = report

    def converge(self, kv: KeyValue) -> None:
        if kv.mod_revision <= self.map_revision:
            return
        doc = kv.json()
        names = map_servers(doc)
        index = {n: i for i, n in enumerate(names)}
        chains = [[index.get(x, -1) if x is not None else -1 for x in c] for c in doc["chains"]]
        this = index.get(self.s.node)
        servers = [doc["nodes"][n]["kv"] for n in names]
        done = self.server.converge(kv.mod_revision, servers, this, chains)
        # Where iproto and memcached text requests for keys active elsewhere go.
        self.server.route(
            this,
            [(doc["nodes"][n]["kv"], doc["nodes"][n].get("iproto", "")) for n in names],
            [c[0] if c else -1 for c in chains],
        )
        self.place_topics(doc)
        self.map_revision = kv.mod_revision
        changed = {k: len(v) for k, v in done.items() if k != "streams" and v}
        log.info(
            "cluster map rev %d: %s; replicating %d vbucket(s) from %d node(s)",
            kv.mod_revision,
            ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in changed.items()) or "nothing to change",
            sum(len(s[2]) for s in done["streams"]),
            len({s[1] for s in done["streams"]}),
        )

    def place_topics(self, doc: dict[str, Any]) -> None:
        """Declares here the topics the map places that this node lacks (so that its TANK
        listener knows them and sends clients to their leaders), then tells the server who
        leads each partition: this node, another node's TANK listener, or none while its
        leader is failed over."""
        placed = doc.get("topics", {})
        have = {name for name, _, _ in self.engine.topics()}
        for name, t in placed.items():
            if name not in have:
                self.engine.create_topic(name, t["partitions"], t.get("settings", ""))
        failed = doc.get("failed", {})

        def tank_of(node: str) -> str:
            # An address a TANK redirect can carry (IPv4:PORT), or none.
            address = doc["nodes"].get(node, {}).get("tank", "")
            host, _, port = address.rpartition(":")
            try:
                ipaddress.IPv4Address(host)
                return address if port.isdigit() else ""
            except ValueError:
                return ""

        def partition(
            chain: list[str | None], in_sync: list[str], handing_over: bool
        ) -> tuple[str, int, int, str, bool]:
            leader = chain[0] if chain else None
            copies = sum(1 for n in chain if n is not None)
            # A copy's acknowledgements count toward produces only once it is in sync: the
            # copies a failover may promote are those that hold what was acknowledged.
            counted = self.s.node in in_sync
            if leader is None or leader in failed:
                return ("", copies, len(in_sync), "", counted)
            # A copy here streams from its leader (while a new one takes over too).
            copy_from = doc["nodes"][leader]["kv"] if self.s.node in chain[1:] else ""
            if handing_over:
                # No node takes messages while its leader changes (see Orchestrator.move_topics);
                # the old leader still serves its copies, the new leader among them, which may
                # be a message behind or connect anew (a copy just counted in sync does).
                held = "handing over" if leader == self.s.node else ""
                return (held, copies, len(in_sync), copy_from, counted)
            if leader == self.s.node:
                return ("here", copies, len(in_sync), "", counted)
            return (tank_of(leader), copies, len(in_sync), copy_from, counted)

        parts = {
            name: [
                partition(c, s, str(p) in t.get("handover", {}))
                for p, (c, s) in enumerate(zip(t["chains"], in_sync_copies(t), strict=True))
            ]
            for name, t in placed.items()
        }
        # Every node of the map, in its order (TANK's node ids), failed-over ones unavailable.
        every = sorted(doc["nodes"])
        held = {n: sum(1 for t in placed.values() for c in t["chains"] if n in c) for n in every}
        nodes = [(tank_of(n), n not in failed, held[n]) for n in every]
        self.server.place_topics(self.s.cluster, self.s.buckets[0], parts, nodes)
        self.led = {name: [p for p, part in enumerate(ps) if part[0] == "here"] for name, ps in parts.items()}

    def _take_over(self, move: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One vbucket taken over in every bucket: its outcome for the orchestrator."""
        vb, source = move["vbucket"], move["source"]
        try:
            reports = [self.server.take_over(b, vb, source, timeout) for b in self.s.buckets]
            return {"vbucket": vb, "ok": True, "reports": reports}
        except Exception as e:  # noqa: BLE001 - told to the orchestrator, which decides
            log.warning("cluster: taking over vbucket %d from %s failed: %s", vb, source, e)
            return {"vbucket": vb, "ok": False, "error": str(e)}

    def _run_task(self, task: dict[str, Any]) -> None:
        with self._task_lock:
            result: dict[str, Any] = {"id": task["id"]}
            if task.get("kind") == "takeover" and task.get("moves"):
                # The moves run side by side, each on a connection of its own to its source.
                timeout = task.get("timeout", 60.0)
                with concurrent.futures.ThreadPoolExecutor(len(task["moves"])) as pool:
                    moves = list(pool.map(lambda m: self._take_over(m, timeout), task["moves"]))
                result.update(ok=True, moves=moves)
            else:
                log.warning("cluster: unknown task %s", task)
                result.update(ok=False, error=f"unknown task {task.get('kind')!r}")
            for _ in range(20):
                try:
                    self.etcd.put(self.keys.result(self.s.node), dump(result))
                    return
                except EtcdError as e:
                    self._etcd_failed(e)
                    self.stop_event.wait(0.5)

    # -- the orchestrator's election

    def _orchestrator_loop(self) -> None:
        orchestrator: Orchestrator | None = None
        while not self.stop_event.is_set():
            try:
                if self.lease:
                    current = self.etcd.get(self.keys.orchestrator)
                    if current is None:
                        self.etcd.put_if(self.keys.orchestrator, self.s.node, lease=self.lease)
                        current = self.etcd.get(self.keys.orchestrator)
                    mine = (
                        current is not None
                        and current.value.decode() == self.s.node
                        and current.lease == self.lease
                    )
                    if mine and orchestrator is None:
                        log.warning("cluster %s: %s is the orchestrator", self.s.cluster, self.s.node)
                        orchestrator = Orchestrator(self)
                    elif not mine and orchestrator is not None:
                        log.warning(
                            "cluster %s: %s is no longer the orchestrator", self.s.cluster, self.s.node
                        )
                        orchestrator = None
                    if orchestrator is not None and orchestrator.tick():
                        continue
            except EtcdError as e:
                self._etcd_failed(e)
            self.stop_event.wait(0.25)

    def still_orchestrator(self) -> bool:
        """Whether this node still holds the orchestrator key (asked between a rebalance's moves)."""
        current = self.etcd.get(self.keys.orchestrator)
        return current is not None and current.value.decode() == self.s.node and current.lease == self.lease


def tank_address(bound: str, kv: str) -> str:
    """Where other nodes send TANK clients to this one: its TANK listener, on the host the KV
    address names when it listens on every address. TANK's redirect carries an IPv4 address:
    a host name is resolved; "" (no TANK clients are sent here, with a warning) when there is
    no TANK listener, when it is not IPv4, or when it listens on loopback only while the node
    is reached beyond it."""
    import ipaddress
    import socket

    if not bound:
        return ""
    host, _, port = bound.rpartition(":")
    kv_host = kv.rpartition(":")[0].strip("[]")
    if host in ("0.0.0.0", "[::]", "::"):
        host = kv_host
    try:
        ip = ipaddress.IPv4Address(socket.gethostbyname(host.strip("[]")))
        kv_ip = ipaddress.ip_address(socket.gethostbyname(kv_host)) if kv_host else ip
    except (OSError, ValueError) as e:
        log.warning("cluster: TANK clients are not sent to this node: %s is not IPv4 (%s)", host, e)
        return ""
    if ip.is_loopback and not kv_ip.is_loopback:
        log.warning(
            "cluster: TANK clients are not sent to this node: tank_listen %s is loopback only, and "
            "the others reach this node at %s",
            bound,
            kv,
        )
        return ""
    return f"{ip}:{port}"


def reachable_address(bound: str, kv: str) -> str:
    """Where other nodes reach one of this node's listeners: as bound, on the host the KV
    address names when it listens on every address; "" when there is none, or when it listens
    on loopback only while the node is reached beyond it."""
    if not bound:
        return ""
    host, _, port = bound.rpartition(":")
    kv_host = kv.rpartition(":")[0]
    if host in ("0.0.0.0", "[::]", "::"):
        return f"{kv_host}:{port}"
    loopback = ("127.", "[::1]", "::1", "localhost")
    if host.startswith(loopback) and not kv_host.startswith(loopback):
        return ""
    return bound


def join(
    values: dict[str, Any],
    etcd_password: str | None,
    server: Any,
    engine: Any,
    buckets: list[str],
    num_vbuckets: int,
) -> Member:
    """Joins the cluster `values["cluster.etcd"]` names (a config's values; the password from
    its `etcd_password_file`): converges on its map at once if etcd answers (before clients are
    told the node is ready), then keeps its place."""
    from sluice.cluster.etcd import parse_cluster_url

    endpoints, name = parse_cluster_url(values["cluster.etcd"])
    etcd = Etcd(
        endpoints,
        username=values["cluster.etcd_user"] or None,
        password=etcd_password,
        ca_file=str(values["cluster.etcd_ca"]) if values["cluster.etcd_ca"] else None,
    )
    kv = values["cluster.advertise"] or server.address
    member = Member(
        server,
        engine,
        ClusterSettings(
            etcd=etcd,
            cluster=name,
            node=values["cluster.node_name"] or kv,
            kv=kv,
            tank=tank_address(server.fronts.get("tank", ""), kv),
            iproto=reachable_address(server.fronts.get("iproto", ""), kv),
            group=values["cluster.group"],
            replicas=values["cluster.replicas"],
            auto_failover_timeout=values["cluster.auto_failover_timeout"],
            max_auto_failovers=values["cluster.max_auto_failovers"],
            admin=server.admin_address,
            num_vbuckets=num_vbuckets,
            buckets=buckets,
        ),
    )
    # In a cluster a node leads only the topic partitions the map places on it: until a map
    # is in force (none yet, or etcd unreachable), it leads none, and no message is taken by
    # a node the placement then makes a copy. DiscoverTopology names this node alone.
    server.place_topics(name, buckets[0], {}, [(member.s.tank, True, 0)])
    try:
        current = etcd.get(member.keys.map)
        if current is not None:
            member.converge(current)
    except EtcdError as e:
        log.warning("cluster: etcd unreachable at start (%s); serving what this node holds", e)
    member.start()
    return member
