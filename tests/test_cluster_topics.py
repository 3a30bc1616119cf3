"""Topics across a cluster on etcd: the orchestrator places each partition on a node, as it places
vbuckets' actives, and every node sends a TANK client to the leader of a partition it does not
lead (error 0xfc with the leader's endpoint, as TANK's clustered broker answers); while a
partition's leader is failed over, no node serves it (0xfd) rather than one without its
messages.

TANK's own tank-cli follows those redirects: with TANK_DIR naming a build of TANK's source
(shared/reference/tank-captures), it is pointed at each node in turn."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import run_cli
from sluice.cluster import topicmap
from sluice.tank import NotLeader, TankConnection, TankError
from test_cluster import EtcdServer, cli, cluster_map, cluster_node, form, stop_all, wait_map

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server is not installed")

PARTITIONS = 6
# TANK clients have the guest's grants (TANK has no login).
GUEST = '[users.guest]\ntopics = { "*" = ["read", "write", "admin"] }\n'


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd")
    yield server
    server.close()


def leaders_known(nodes: dict, topic: str, chains: list) -> None:
    """Waits until every node sends a produce to each partition it does not lead to its leader."""
    deadline = time.monotonic() + 30
    for name, node in nodes.items():
        with TankConnection(node.tank) as t:
            for p, chain in enumerate(chains):
                if chain[0] == name:
                    continue
                while True:
                    try:
                        t.produce(topic, [b"probe"], partition=p)
                    except NotLeader as e:
                        # No leader yet: this node has not put the map that places the topic
                        # in force.
                        if e.leader is not None:
                            assert e.leader == nodes[chain[0]].tank, (name, p, e.leader)
                            break
                    except Exception as e:  # noqa: BLE001 - the topic may not be known here yet
                        if "unknown" not in str(e):
                            raise
                    else:
                        raise AssertionError(f"{name} took a produce to partition {p}, led by {chain[0]}")
                    assert time.monotonic() < deadline, f"{name} does not know {topic}'s leaders"
                    time.sleep(0.1)


def test_every_partition_is_reached_through_any_node_and_a_failed_leader_is_not_replaced_silently(
    tmp_path, etcd
):
    nodes = form(tmp_path, etcd, ["n1", "n2", "n3"], config=GUEST)
    try:
        with TankConnection(nodes["n1"].tank) as t:
            t.create_topic("events", PARTITIONS)
        doc = wait_map(etcd, lambda m: "events" in m.get("topics", {}))
        chains = doc["topics"]["events"]["chains"]
        leaders = [c[0] for c in chains]
        # Leaders spread as vbuckets' actives are: two partitions each.
        assert sorted(leaders.count(n) for n in nodes) == [2, 2, 2], leaders
        leaders_known(nodes, "events", chains)
        # `sluice cluster status` lists each partition's leader.
        status = cli(etcd, "status")
        for p, leader in enumerate(leaders):
            assert re.search(rf"events\s+{p}\s+{leader}\b", status), status

        # Produced through its leader, read back there; a consume elsewhere names the leader.
        for p, leader in enumerate(leaders):
            with TankConnection(nodes[leader].tank) as t:
                t.produce("events", [b"message %d" % p], partition=p)
                got = [m.content for m in t.consume("events", p, 1).messages]
                assert got == [b"message %d" % p]
            other = next(n for n in nodes if n != leader)
            with TankConnection(nodes[other].tank) as t, pytest.raises(NotLeader) as e:
                t.consume("events", p, 1)
            assert e.value.leader == nodes[leader].tank

        # Status and DiscoverTopics answer as a cluster-aware broker's.
        with TankConnection(nodes["n1"].tank) as t:
            assert ("events", PARTITIONS) in t.topics()
        # sluice's own tools follow the leaders through any one node: the partitions' ranges,
        # and `sluice tail --topic` reading every partition.
        with TankConnection(nodes["n2"].tank) as t:
            assert t.leaders("events") == [nodes[n].tank for n in leaders]
            assert [hwm for _, hwm in t.partitions("events")] == [1] * PARTITIONS
        args = ("tail", "--topic", "events", "--address", nodes["n2"].tank, "--from", "beginning")
        r = run_cli(*args, "--until-now", "--format", "json", timeout=60)
        assert r.returncode == 0, r.stderr
        rows = sorted((row["partition"], row["content"]) for row in map(json.loads, r.stdout.splitlines()))
        assert rows == [(p, f"message {p}") for p in range(PARTITIONS)], r.stdout

        # Produced to right after it was created: no node takes a message before the map
        # places the partition (0xfd, which TANK's client tries again 2 s later), so none is
        # taken by a node the placement then makes a copy, and cut back there.
        with TankConnection(nodes["n3"].tank) as t:
            t.create_topic("early", 3)
            with pytest.raises(NotLeader) as e:
                t.produce("early", [b"early 0"], partition=0)
            assert e.value.leader is None
            for p in range(3):
                produce_following_leaders(nodes["n3"].tank, "early", [b"early %d" % p], p)
        wait_map(etcd, lambda m: "early" in m.get("topics", {}))
        r = run_cli("tail", "--topic", "early", "--address", nodes["n1"].tank, "--from", "beginning",
                    "--until-now", "--format", "json", timeout=60)  # fmt: skip
        assert sorted(json.loads(line)["content"] for line in r.stdout.splitlines()) == [
            f"early {p}" for p in range(3)
        ], r.stdout + r.stderr

        tank_dir = os.environ.get("TANK_DIR")
        if tank_dir and (Path(tank_dir) / "tank-cli").exists():
            # TANK's own client, pointed at each node, reaches every partition.
            for name, node in nodes.items():
                for p in range(PARTITIONS):
                    tank_cli(tank_dir, node.tank, "-t", "events", "-p", str(p), "produce", f"via {name}")
            status = tank_cli(tank_dir, nodes["n1"].tank, "status")
            assert "c1" in status, status
            topics = tank_cli(tank_dir, nodes["n1"].tank, "discover_topics")
            assert "events" in topics, topics
            for node in nodes.values():
                for p in range(PARTITIONS):
                    out = tank_cli(tank_dir, node.tank, "-t", "events", "-p", str(p), "get", "-d", "0")
                    assert [f"message {p}"] + [f"via {n}" for n in nodes] == re.findall(
                        r"(message \d|via n\d)", out
                    ), out

        # A topic may ask for its own number of copies (Kafka's replication.factor).
        with TankConnection(nodes["n1"].tank) as t:
            t.create_topic("solo", 3, "replication.factor=1")
            t.create_topic("triple", 3, "replication.factor=3")
        placed = wait_map(etcd, lambda m: {"solo", "triple"} <= set(m.get("topics", {})))["topics"]
        assert all(sum(1 for n in c if n) == 1 for c in placed["solo"]["chains"]), placed["solo"]
        assert all(sorted(c) == ["n1", "n2", "n3"] for c in placed["triple"]["chains"]), placed["triple"]

        # Every partition has a copy on another node (the cluster's one replica), in sync.
        doc = cluster_map(etcd)
        for chain, in_sync in zip(chains, doc["topics"]["events"]["isr"], strict=True):
            assert chain[1] not in (None, chain[0]), chains
            assert sorted(in_sync) == sorted(chain), doc["topics"]["events"]
        assert re.search(rf"events\s+0\s+{leaders[0]}\s+{chains[0][1]}\s", cli(etcd, "status"))
        # /status shows them too: each partition's copies, and those in sync.
        expected = [{"copies": [n for n in c[1:] if n], "in_sync": c} for c in chains]
        deadline = time.monotonic() + 10
        while nodes["n2"].status()["cluster"]["topic_copies"].get("events") != expected:
            assert time.monotonic() < deadline, nodes["n2"].status()["cluster"]["topic_copies"]
            time.sleep(0.1)

        # A steady producer asking for acks from every copy in sync; the leader of two
        # partitions is killed mid-produce. Once it is failed over, its copies lead, and every
        # message acknowledged is read back from the new leaders.
        gone = leaders[0]
        survivors = [n for n in nodes if n != gone]
        producer = SteadyProducer({n: nodes[n].tank for n in survivors}, "events", PARTITIONS)
        producer.start()
        try:
            producer.wait_acked(60)
            nodes[gone].stop(sig=9)
            killed_at = len(producer.acked)
            wait_map(etcd, lambda m: gone in m["failed"], timeout=30)
            producer.wait_acked(120)
        finally:
            producer.finish()
        assert producer.errors == [], producer.errors[:5]
        # Its partitions took messages again once their copies led them.
        taken = {p for p, _ in producer.acked[killed_at:]}
        assert {p for p, c in enumerate(chains) if c[0] == gone} <= taken, taken
        after = cluster_map(etcd)["topics"]["events"]
        for p, chain in enumerate(chains):
            if chain[0] == gone:
                assert after["chains"][p][0] == chain[1], after
        r = run_cli("tail", "--topic", "events", "--address", nodes[survivors[0]].tank, "--from", "beginning",
                    "--until-now", "--format", "json", timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        read = {(row["partition"], row["content"]) for row in map(json.loads, r.stdout.splitlines())}
        lost = sorted(set(producer.acked) - read)
        assert lost == [], f"{len(lost)} of {len(producer.acked)} acknowledged messages lost: {lost[:5]}"

        # A partition whose only copy in sync leaves: no leader (0xfd) rather than a copy that
        # lacks acknowledged messages, until it comes back. `second` leads partitions whose copy
        # was on `gone`: failed over by hand, they have none.
        second = after["chains"][next(p for p, c in enumerate(chains) if c[1] == gone)][0]
        third = next(n for n in survivors if n != second)
        orphans = [p for p, c in enumerate(after["chains"]) if after["isr"][p] == [second]]
        assert orphans, after
        cli(etcd, "failover", second)
        wait_map(etcd, lambda m: second in m["failed"], timeout=30)
        with TankConnection(nodes[third].tank) as t:
            for p in orphans:
                deadline = time.monotonic() + 20
                while True:
                    with pytest.raises(NotLeader) as e:
                        t.produce("events", [b"lost?"], partition=p)
                    if e.value.leader is None:
                        break
                    assert time.monotonic() < deadline, e.value
                    time.sleep(0.1)
        assert re.search(rf"events\s+{orphans[0]}\s+none \(waits for {second}\)", cli(etcd, "status"))
        # sluice's tools say which partitions no node leads rather than fail.
        with TankConnection(nodes[third].tank) as t:
            assert [p for p, r in enumerate(t.ranges("events")) if r is None] == sorted(orphans)
        listed = run_cli("topic", "list", "--address", nodes[third].tank, timeout=60)
        assert listed.returncode == 0, listed.stderr
        for p in orphans:
            assert re.search(rf"events\s+{p}\s+-\s+no leader now", listed.stdout), listed.stdout
        # It returns (a new run): it leads them again, with what it held.
        nodes[second].stop()
        nodes[second] = cluster_node(tmp_path, etcd, second, config=GUEST)
        back = wait_map(etcd, lambda m: second not in m["failed"], timeout=60)
        assert all(back["topics"]["events"]["chains"][p][0] == second for p in orphans), back["topics"]
        r = run_cli("tail", "--topic", "events", "--address", nodes[third].tank, "--from", "beginning",
                    "--until-now", "--format", "json", timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        again = {(row["partition"], row["content"]) for row in map(json.loads, r.stdout.splitlines())}
        assert set(producer.acked) <= again
    finally:
        stop_all(nodes)


def test_partitions_move_on_rebalance_under_a_steady_producer(tmp_path, etcd):
    """Removing a node moves its partitions (leaders and copies) to the others before it leaves
    the map; adding it back gives it its share again. Every message acknowledged meanwhile is
    read back."""
    nodes = form(tmp_path, etcd, ["n1", "n2", "n3"], config=GUEST)
    try:
        with TankConnection(nodes["n1"].tank) as t:
            t.create_topic("moving", PARTITIONS)
        doc = wait_map(etcd, lambda m: "moving" in m.get("topics", {}))
        leaders_known(nodes, "moving", doc["topics"]["moving"]["chains"])
        producer = SteadyProducer({n: node.tank for n, node in nodes.items()}, "moving", PARTITIONS)
        producer.start()
        try:
            producer.wait_acked(30)
            cli(etcd, "remove", "n3")
            out = cli(etcd, "rebalance")
            assert "done" in out, out
            placed = cluster_map(etcd)["topics"]["moving"]
            assert all("n3" not in c for c in placed["chains"]), placed
            assert sorted(c[0] for c in placed["chains"]) == ["n1"] * 3 + ["n2"] * 3, placed
            producer.wait_acked(30)
            cli(etcd, "add", "n3")
            out = cli(etcd, "rebalance")
            assert "done" in out, out
            placed = cluster_map(etcd)["topics"]["moving"]
            assert sorted(c[0] for c in placed["chains"]) == ["n1", "n1", "n2", "n2", "n3", "n3"], placed
            assert all(sorted(s) == sorted(c) for c, s in zip(placed["chains"], placed["isr"], strict=True))
            producer.wait_acked(30)
        finally:
            producer.finish()
        assert producer.errors == [], producer.errors[:5]
        r = run_cli("tail", "--topic", "moving", "--address", nodes["n1"].tank, "--from", "beginning",
                    "--until-now", "--format", "json", timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        read = {(row["partition"], row["content"]) for row in map(json.loads, r.stdout.splitlines())}
        lost = sorted(set(producer.acked) - read)
        assert lost == [], f"{len(lost)} of {len(producer.acked)} acknowledged messages lost: {lost[:5]}"
    finally:
        stop_all(nodes)


def test_an_old_leader_back_after_a_failover_drops_what_no_copy_got(tmp_path, etcd, monkeypatch):
    """A leader stores messages its copy never got (its streams held, as by a stalled network;
    the producer was told they were not acknowledged), then dies; its copy leads and takes
    other messages at those sequence numbers. Back, the old leader is cut back to where the
    two histories part and copies the new leader's, and is admitted in sync only then: when it
    leads again, readers see what the new leader had, never the messages nobody
    acknowledged."""
    monkeypatch.setenv("SLUICE_ERRINJ", "")
    nodes = form(tmp_path, etcd, ["n1", "n2"], config=GUEST)
    try:
        with TankConnection(nodes["n1"].tank) as t:
            t.create_topic("branch", 1)
        doc = wait_map(etcd, lambda m: len(m.get("topics", {}).get("branch", {}).get("isr", [[]])[0]) == 2)
        old, copy = doc["topics"]["branch"]["chains"][0][:2]
        leaders_known(nodes, "branch", doc["topics"]["branch"]["chains"])
        with TankConnection(nodes[old].tank) as t:
            once_led(lambda: t.produce("branch", [b"acked 1", b"acked 2"]))
            nodes[old].inject("topic_streams_held", 1)
            for i in range(3):
                with pytest.raises(TankError, match="not as many copies"):
                    t.produce("branch", [b"unacked %d" % i], ack_timeout=0.2)
            assert t.consume("branch", 0, 0).high_water_mark == 5
        nodes[old].stop(sig=9)
        wait_map(etcd, lambda m: old in m["failed"] and m["topics"]["branch"]["chains"][0][0] == copy)
        with TankConnection(nodes[copy].tank) as t:
            once_led(lambda: t.produce("branch", [b"new 1", b"new 2", b"new 3", b"new 4"]))
            led = [(m.seq, m.content) for m in t.consume("branch", 0, 0).messages]
        assert [c for _, c in led] == [b"acked 1", b"acked 2", b"new 1", b"new 2", b"new 3", b"new 4"]

        # Back: it holds 5 messages against the leader's 6, 3 of them on a branch the leader
        # never had; it joins those in sync only once cut back and caught up.
        nodes[old] = cluster_node(tmp_path, etcd, old, config=GUEST)
        wait_map(etcd, lambda m: sorted(m["topics"]["branch"]["isr"][0]) == sorted([old, copy]), timeout=60)
        assert "cut back from 5 to 2" in nodes[old].log()
        cli(etcd, "failover", copy)
        wait_map(etcd, lambda m: m["topics"]["branch"]["chains"][0][0] == old, timeout=30)
        with TankConnection(nodes[old].tank) as t:
            got = [(m.seq, m.content) for m in once_led(lambda: t.consume("branch", 0, 0)).messages]
        assert got == led
    finally:
        stop_all(nodes)


def produce_following_leaders(address: str, topic: str, messages: list[bytes], partition: int) -> None:
    """Produces through `address` as TANK's client does: sent on to the leader a refusal names,
    and tried again a little later while none leads the partition (for up to 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with TankConnection(address) as t:
                t.produce(topic, messages, partition=partition)
            return
        except NotLeader as e:
            assert time.monotonic() < deadline, e
            address = e.leader or address
            time.sleep(0.05 if e.leader else 0.2)


def once_led(call):
    """`call`'s answer once the node it asks has put the map that makes it lead in force."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return call()
        except NotLeader:
            assert time.monotonic() < deadline, "the node never came to lead the partition"
            time.sleep(0.1)


class SteadyProducer(threading.Thread):
    """Produces to every partition in turn, one message at a time, with acks from every copy in
    sync (required_acks 0), through whichever node answers: it follows the leaders' redirects
    and, while a partition has none or its leader is unreachable, tries it again later. Keeps
    what was acknowledged, as (partition, content)."""

    def __init__(self, tanks: dict[str, str], topic: str, partitions: int) -> None:
        super().__init__(daemon=True)
        self.tanks = tanks
        self.topic = topic
        self.partitions = partitions
        self.acked: list[tuple[int, str]] = []
        self.errors: list[str] = []
        self.stop_event = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        leaders: dict[int, str] = {}
        conns: dict[str, TankConnection] = {}
        i = 0
        deadline = time.monotonic() + 120
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            p = i % self.partitions
            i += 1
            address = leaders.get(p) or list(self.tanks.values())[i % len(self.tanks)]
            content = f"steady {i}"
            try:
                conn = conns.get(address) or conns.setdefault(address, TankConnection(address))
                conn.produce(self.topic, [content.encode()], partition=p, ack_timeout=2.0)
            except NotLeader as e:
                leaders.pop(p, None)
                if e.leader is not None:
                    leaders[p] = e.leader
                continue
            except (OSError, TankError) as e:
                # The leader died, or a copy did not acknowledge in time (it died): tried again
                # once the failover made the map whole. A request refused is a failure.
                leaders.pop(p, None)
                stale = conns.pop(address, None)
                if stale is not None:
                    stale.close()
                if "not valid" in str(e) or "unknown" in str(e):
                    self.errors.append(f"{p}: {e}")
                time.sleep(0.05)
                continue
            with self.lock:
                self.acked.append((p, content))
        for c in conns.values():
            c.close()

    def wait_acked(self, count: int, timeout: float = 60) -> None:
        """Waits until `count` more messages are acknowledged."""
        with self.lock:
            target = len(self.acked) + count
        deadline = time.monotonic() + timeout
        while len(self.acked) < target:
            assert self.is_alive() and time.monotonic() < deadline, (len(self.acked), self.errors[:3])
            time.sleep(0.05)

    def finish(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)


def tank_cli(tank_dir: str, address: str, *args: str) -> str:
    r = subprocess.run(
        [str(Path(tank_dir) / "tank-cli"), "-b", address, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_a_failover_promotes_the_most_advanced_copy_in_sync_and_never_one_out_of_sync():
    topics = {
        "t": {
            "partitions": 3,
            "chains": [["a", "b", "c"], ["a", "c", None], ["b", "a", None]],
            "isr": [["a", "b", "c"], ["a"], ["b", "a"]],
        }
    }
    held = {"b": {"t": [5, 0, 9]}, "c": {"t": [7, 9, 0]}}
    out, had, orphaned = topicmap.fail_over(topics, "a", held, {"b", "c"})
    t = out["t"]
    # Partition 0: c holds more than b. Partition 1: c is out of sync, so nobody leads it and
    # a stays its only copy in sync. Partition 2: a was a copy; it is dropped from the chain.
    assert t["chains"] == [["c", "b", None], [None, "c", None], ["b", None, None]]
    assert t["isr"] == [["b", "c"], ["a"], ["b"]]
    assert had == {"t": [0, 1, 2]} and orphaned == [("t", 1)]
    # a returns: it leads partition 1 again, and copies 0 and 2 out of sync until caught up.
    back = topicmap.take_back(out, "a", had)["t"]
    assert back["chains"] == [["c", "b", "a"], ["a", "c", None], ["b", "a", None]]
    assert back["isr"] == [["b", "c"], ["a"], ["b"]]
    marks = {"a": {"t": [7, 9, 8]}, "b": {"t": [7, 0, 9]}, "c": {"t": [7, 9, 0]}}
    admitted, joined = topicmap.admit_caught_up({"t": back}, marks, {"a", "b", "c"})
    # c caught up with a on 1; a with c on 0; a is behind b on 2.
    assert sorted(joined) == [("t", 0, "a"), ("t", 1, "c")]
    assert admitted["t"]["isr"] == [["b", "c", "a"], ["a", "c"], ["b"]]


def test_a_copy_that_keeps_up_with_a_steady_producer_joins_those_in_sync():
    """Under a steady producer a copy's status seldom shows all its leader's last one shows
    (each is published on its own clock): it joins once it holds what its leader held the time
    before, never while it is further behind."""
    topic = {"t": {"partitions": 1, "chains": [["a", "b"]], "isr": [["a"]]}}
    last = {"a": {"t": [120]}, "b": {"t": [110]}}
    assert topicmap.admit_caught_up(topic, last, {"a", "b"})[1] == []
    before = {"a": {"t": [100]}, "b": {"t": [90]}}
    _, joined = topicmap.admit_caught_up(topic, last, {"a", "b"}, held_before=before)
    assert joined == [("t", 0, "b")]
    before = {"a": {"t": [111]}, "b": {"t": [105]}}
    assert topicmap.admit_caught_up(topic, last, {"a", "b"}, held_before=before)[1] == []
    # A leader whose earlier status shows more than its last (cut back to a new leader's
    # history) is held to its last.
    before = {"a": {"t": [130]}}
    assert topicmap.admit_caught_up(topic, last, {"a", "b"}, held_before=before)[1] == []
