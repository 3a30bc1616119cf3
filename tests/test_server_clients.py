"""`sluice serve` with real memcached binary-protocol clients: python-binary-memcached and
pylibmc (libmemcached, binary mode), every operation they offer, against a real process."""

from __future__ import annotations

import bmemcached
import pylibmc
import pytest


def test_python_binary_memcached_every_operation(clocked_server):
    server = clocked_server
    c = bmemcached.Client([server.address])
    try:
        assert c.set("k", "v1")
        assert c.get("k") == "v1"
        assert c.set("obj", {"a": [1, 2]})  # the client pickles: flags carry the format
        assert c.get("obj") == {"a": [1, 2]}
        assert not c.add("k", "other"), "ADD of an existing key fails"
        assert c.add("new", "n")
        assert not c.replace("missing", "x"), "REPLACE of a missing key fails"
        assert c.replace("k", "v2") and c.get("k") == "v2"
        value, cas = c.gets("k")
        assert value == "v2" and cas
        assert c.cas("k", "v3", cas)
        assert not c.cas("k", "v4", cas), "a stale CAS fails"
        assert c.get("k") == "v3"
        assert c.get_multi(["k", "new", "missing"]) == {"k": "v3", "new": "n"}
        assert c.set_multi({"m1": "a", "m2": "b"}) is not None
        assert c.get_multi(["m1", "m2"]) == {"m1": "a", "m2": "b"}
        # A missing counter is created with the client's default (0); then it counts.
        assert c.incr("counter", 5) == 0
        assert c.incr("counter", 5) == 5
        c.set("n", "10")
        assert c.incr("n", 5) == 15
        assert c.decr("n", 20) == 0, "DECR stops at 0"
        assert c.delete("k") and c.get("k") is None
        c.set("ttl", "x", time=1)
        assert c.get("ttl") == "x"
        server.inject("clock_offset_secs", 3)
        assert c.get("ttl") is None, "expired"
        stats = c.stats()
        (node_stats,) = stats.values()
        assert int(node_stats["curr_connections"]) >= 1 and "version" in node_stats
        assert c.flush_all()
        assert c.get("new") is None
    finally:
        c.disconnect_all()


def test_pylibmc_binary_every_operation(clocked_server):
    server = clocked_server
    c = pylibmc.Client([server.address], binary=True, behaviors={"cas": True})
    assert c.set("k", b"v1") and c.get("k") == b"v1"
    assert not c.add("k", b"x")
    assert c.add("a", b"1")
    with pytest.raises(pylibmc.NotFound):  # binary REPLACE of a missing key: KEY_ENOENT
        c.replace("missing", b"x")
    assert c.replace("a", b"2") and c.get("a") == b"2"
    value, cas = c.gets("a")
    assert value == b"2"
    assert c.cas("a", b"3", cas)
    assert not c.cas("a", b"4", cas)
    assert c.append("a", b"-end") and c.prepend("a", b"start-")
    assert c.get("a") == b"start-3-end"
    assert not c.append("missing", b"x"), "APPEND of a missing key: NOT_STORED, as memcached"
    c.set("n", b"41")
    assert c.incr("n") == 42 and c.decr("n", 2) == 40
    assert c.get_multi(["k", "a", "nope"]) == {"k": b"v1", "a": b"start-3-end"}
    assert c.set_multi({"x": b"1", "y": b"2"}) == []
    assert c.touch("x", 1)
    server.inject("clock_offset_secs", 3)
    assert c.get("x") is None and c.get("y") == b"2"
    assert c.delete("y") and c.get("y") is None
    big = bytes(range(256)) * 4096  # 1 MiB
    assert c.set("big", big) and c.get("big") == big
    assert c.flush_all() and c.get("k") is None
