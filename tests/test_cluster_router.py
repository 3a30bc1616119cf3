"""The built-in router for clients that read no cluster map: three nodes on a real etcd, and
clients pointed at one of them reading and writing keys active on all three.

- net.box (tests/netbox_compare.lua, run by the `tarantool` binary) against one node of a
  cluster gives the answers a real Tarantool 2.6 gives, line for line, errors included: the
  requests whose keys live elsewhere are forwarded, run there as the client's user, and SELECTs
  over every vbucket are gathered from the three nodes and merged.
- tarantool-python writes tuples through one node and reads them through each; a range SELECT
  through the cluster equals the same SELECT on a node on its own holding the same data; a
  node killed with -9 makes a SELECT over every vbucket fail, never answer in part.
- pymemcache (memcached's text protocol) sets, gets, multi-gets and deletes keys of every
  vbucket through one node."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import time

import pytest
import sluice
import tarantool
from helpers import Node, metric_value, start_node
from pymemcache.client.base import Client as MemcacheClient
from tarantool.const import ITERATOR_ALL, ITERATOR_GE, ITERATOR_GT, ITERATOR_LE, ITERATOR_LT
from tarantool_peer import PASSWORD, TARANTOOL, USER, TarantoolPeer, sluice_config
from test_cluster import EtcdServer, cli, cluster_map, stop_all, wait_map, wait_registered, wait_replicated
from test_iproto_netbox import run_script

pytestmark = [
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server is not installed"),
    pytest.mark.skipif(TARANTOOL is None, reason="tarantool is not installed"),
]

REPL_PASSWORD = "repl-secret"


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd")
    yield server
    server.close()


def cluster_section(etcd: EtcdServer, name: str) -> str:
    return f'[cluster]\netcd = "{etcd.url}"\nnode_name = "{name}"\nauto_failover_timeout = 2\n'


def form_nodes(etcd: EtcdServer, start) -> dict[str, Node]:
    """Starts n1 (which forms the cluster), then n2 and n3, adds them and rebalances."""
    names = ["n1", "n2", "n3"]
    nodes = {}
    for n in names:
        nodes[n] = start(n)
        if n == "n1":
            wait_map(etcd, lambda m: True)
    wait_registered(etcd, names)
    cli(etcd, "add", "n2", "n3")
    out = cli(etcd, "rebalance")
    assert "done" in out, out
    return nodes


def iproto_cluster(tmp_path, etcd) -> dict[str, Node]:
    """Nodes declaring tests/tarantool_peer.py's spaces and user, and the nodes' replication
    login, which may replicate every space's bucket."""
    (tmp_path / "repl.pw").write_text(REPL_PASSWORD + "\n")
    creds = sluice.config.user_credentials(REPL_PASSWORD, iterations=1000)
    repl = (
        "[users.repl]\n"
        + "".join(f'{k} = "{v}"\n' for k, v in creds.items())
        + 'buckets = { default = ["replication"], users = ["replication"], events = ["replication"] }\n'
        + f'[replication]\nuser = "repl"\npassword_file = "{tmp_path / "repl.pw"}"\n'
    )

    def start(name: str) -> Node:
        config = sluice_config(tmp_path / f"{name}.toml")
        base = config.read_text()
        # The replication login's table goes before the others' sections end the top level.
        config.write_text(base.replace("[snapshot]", repl + cluster_section(etcd, name) + "[snapshot]", 1))
        return Node(tmp_path / name, "--config", str(config))

    return form_nodes(etcd, start)


def connect(address: str) -> contextlib.closing[tarantool.Connection]:
    host, port = address.rsplit(":", 1)
    return contextlib.closing(tarantool.Connection(host, int(port), user=USER, password=PASSWORD))


def owners(etcd: EtcdServer) -> set[str]:
    return {c[0] for c in cluster_map(etcd)["chains"]}


def test_iproto_clients_reach_every_vbucket_through_one_node(tmp_path, etcd):
    with TarantoolPeer(tmp_path / "tarantool") as peer:
        reference = run_script(peer.address, tmp_path / "client-tarantool")
    nodes = iproto_cluster(tmp_path, etcd)
    try:
        assert owners(etcd) == {"n1", "n2", "n3"}
        # net.box through n1: every answer as a Tarantool's.
        routed = run_script(nodes["n1"].iproto, tmp_path / "client-n1")
        differences = [
            f"{t['step']}:\n  tarantool: {json.dumps(t)}\n  sluice:    {json.dumps(s)}"
            for t, s in zip(reference, routed, strict=False)
            if t != s
        ]
        assert len(routed) == len(reference), routed[-1:]
        assert not differences, f"{len(differences)} answers differ:\n" + "\n".join(differences)

        # tarantool-python: written through n1, read through each node.
        rows = [[i, f"user {i}", 20 + i % 50] for i in range(1000, 1300)]
        with connect(nodes["n1"].iproto) as c:
            for row in rows:
                c.insert("users", row)
            with pytest.raises(tarantool.DatabaseError) as e:
                c.insert("users", rows[7])
            assert e.value.args[0] == 3, e.value.args  # ER_TUPLE_FOUND from the owner
            c.update("users", 1005, [("=", 2, 99)])
            c.delete("users", 1006)
        expected = {r[0]: r for r in rows}
        expected[1005] = [1005, "user 1005", 99]
        del expected[1006]
        for name, node in nodes.items():
            with connect(node.iproto) as c:
                for k in (1000, 1005, 1006, 1299):
                    assert c.select("users", k).data == ([expected[k]] if k in expected else []), (name, k)
        n1 = nodes["n1"].metrics()
        assert metric_value(n1, "sluice_routed_requests_total", front="iproto", how="forwarded") > 0
        assert metric_value(n1, "sluice_routed_requests_total", front="iproto", how="fanned_out") > 0

        # A range SELECT over every vbucket equals the same SELECT on one node holding it all.
        single = Node(tmp_path / "single", "--config", str(sluice_config(tmp_path / "single.toml")))
        try:
            with connect(single.iproto) as c:
                for row in expected.values():
                    c.replace("users", row)
                # What net.box left in the cluster, copied too.
                with connect(nodes["n1"].iproto) as routed_c:
                    for row in routed_c.select("users", [], iterator=ITERATOR_ALL).data:
                        if row[0] not in expected:
                            c.replace("users", row)
                    # tarantool-python sends an iterator given by name as a string, which
                    # Tarantool 2.6 refuses: the numbers are what it takes.
                    selects = [
                        ([], {"iterator": ITERATOR_ALL}),
                        ([1100], {"iterator": ITERATOR_GE, "limit": 25, "offset": 10}),
                        ([1200], {"iterator": ITERATOR_LT, "limit": 40}),
                        ([1150], {"iterator": ITERATOR_LE, "offset": 3, "limit": 7}),
                        ([1250], {"iterator": ITERATOR_GT}),
                    ]
                    for key, kw in selects:
                        want = c.select("users", key, **kw).data
                        got = routed_c.select("users", key, **kw).data
                        assert got == want, (key, kw, len(got), len(want))
                        assert want, (key, kw)
        finally:
            single.stop()

        # A node killed: a SELECT over every vbucket fails rather than answer in part.
        with connect(nodes["n1"].iproto) as c:
            before = c.select("users", [1000], iterator=ITERATOR_GE, limit=1000).data
        wait_replicated(etcd, nodes)
        assert [r[0] for r in before if r[0] < 2000] == sorted(expected)
        nodes["n3"].stop(sig=9)
        with connect(nodes["n1"].iproto) as c:
            with pytest.raises(tarantool.DatabaseError) as e:
                c.select("users", [], iterator=ITERATOR_ALL)
            assert "did not answer" in str(e.value), e.value
            # Once it is failed over, its replicas answer for it, and nothing is missing.
            wait_map(etcd, lambda m: "n3" in m["failed"], timeout=30)
            deadline = time.monotonic() + 30
            while True:
                try:
                    got = c.select("users", [1000], iterator=ITERATOR_GE, limit=1000).data
                    break
                except tarantool.DatabaseError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            assert got == before, len(got)
    finally:
        stop_all(nodes)


def test_memcached_text_clients_reach_every_vbucket_through_one_node(tmp_path, etcd):
    def start(name: str) -> Node:
        return start_node(tmp_path, name, extra=cluster_section(etcd, name))

    nodes = form_nodes(etcd, start)
    try:
        assert owners(etcd) == {"n1", "n2", "n3"}
        host, port = nodes["n1"].address.rsplit(":", 1)
        keys = [f"key-{i}" for i in range(300)]
        c = MemcacheClient((host, int(port)), timeout=10)
        for i, k in enumerate(keys):
            assert c.set(k, f"value {i}".encode(), noreply=False)
        assert c.add(keys[3], b"again", noreply=False) is False  # NOT_STORED from its owner
        assert c.incr("counter", 1) is None  # NOT_FOUND
        c.set("counter", b"10")
        assert c.incr("counter", 5) == 15
        for k in keys[:50]:
            assert c.delete(k, noreply=False)
        got = c.get_many(keys)
        assert got == {k: f"value {i}".encode() for i, k in enumerate(keys) if i >= 50}
        gets = c.gets_many(keys[50:60])
        assert all(cas for _, cas in gets.values())
        c.close()
        # Each key is where the map says, readable through every node.
        for node in nodes.values():
            h, p = node.address.rsplit(":", 1)
            other = MemcacheClient((h, int(p)), timeout=10)
            assert other.get(keys[120]) == b"value 120"
            assert other.get(keys[10]) is None
            other.close()
        # Pipelined: commands for keys of every node in one write, the answers in their order.
        with socket.create_connection((host, int(port)), timeout=10) as s:
            batch = b"".join(
                b"set pipe-%d 0 0 %d\r\n%s\r\nget pipe-%d\r\ndelete nope-%d\r\n"
                % (i, len(b"v%d" % i), b"v%d" % i, i, i)
                for i in range(60)
            )
            s.sendall(batch)
            want = b"".join(
                b"STORED\r\nVALUE pipe-%d 0 %d\r\nv%d\r\nEND\r\nNOT_FOUND\r\n" % (i, len(b"v%d" % i), i)
                for i in range(60)
            )
            got = b""
            while len(got) < len(want):
                chunk = s.recv(65536)
                assert chunk, got[-200:]
                got += chunk
            assert got == want
        n1 = nodes["n1"].metrics()
        assert metric_value(n1, "sluice_routed_requests_total", front="text", how="forwarded") > 0
    finally:
        stop_all(nodes)
