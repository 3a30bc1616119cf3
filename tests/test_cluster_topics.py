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
import time
from pathlib import Path

import pytest
from helpers import run_cli
from sluice.tank import NotLeader, TankConnection
from test_cluster import EtcdServer, cli, cluster_map, form, stop_all, wait_map

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

        # Produced to before the map placed it: each partition that holds messages is led where
        # it holds them, so nothing acknowledged is lost to the placement.
        # (A produce the placement overtook is sent on to the leader, as a client would.)
        with TankConnection(nodes["n3"].tank) as t:
            t.create_topic("early", 3)
            for p in range(3):
                try:
                    t.produce("early", [b"early %d" % p], partition=p)
                except NotLeader as e:
                    with TankConnection(e.leader) as there:
                        there.produce("early", [b"early %d" % p], partition=p)
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

        # The leader of two partitions dies: once it is failed over, no node serves them (it
        # held their only copy); the others' partitions go on.
        gone = leaders[0]
        nodes[gone].stop(sig=9)
        wait_map(etcd, lambda m: gone in m["failed"], timeout=30)
        survivor = next(n for n in nodes if n != gone)
        deadline = time.monotonic() + 20
        with TankConnection(nodes[survivor].tank) as t:
            for p, leader in enumerate(leaders):
                if leader == gone:
                    while True:
                        with pytest.raises(NotLeader) as e:
                            t.produce("events", [b"lost?"], partition=p)
                        if e.value.leader is None:
                            break
                        assert time.monotonic() < deadline, e.value
                        time.sleep(0.1)
                elif leader == survivor:
                    t.produce("events", [b"still here"], partition=p)
        assert cluster_map(etcd)["topics"]["events"]["chains"] == chains
        assert re.search(r"events\s+0\s+none \(failed over\)", cli(etcd, "status"))
    finally:
        stop_all(nodes)


def tank_cli(tank_dir: str, address: str, *args: str) -> str:
    r = subprocess.run(
        [str(Path(tank_dir) / "tank-cli"), "-b", address, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr
