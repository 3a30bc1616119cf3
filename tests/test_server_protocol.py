"""The memcached binary protocol on the wire, byte for byte (BinaryProtocol.md layouts),
against a real `sluice serve`: pipelining and quiet commands, errors and limits, vbucket
routing, HELLO features, and a peer that never reads."""

from __future__ import annotations

import socket
import struct
import time

import pytest
from helpers import NO_DEFAULT_PORTS, Node
from mcbp_wire import (
    DELETE,
    GET,
    GET_ALL_VB_SEQNOS,
    GETKQ,
    HEADER,
    HELLO,
    INCR,
    NOOP,
    SET,
    SETQ,
    STAT,
    VERSION,
    connect,
    flex_request,
    read_response,
    request,
    set_extras,
)


def test_the_documented_get_example_on_the_wire(server):
    with connect(server) as s:
        # BinaryProtocol.md "0x00 Get" request for "Hello", byte for byte.
        s.sendall(bytes.fromhex("800000050000000000000005000000000000000000000000") + b"Hello")
        r = read_response(s)
        assert (r["magic"], r["opcode"], r["status"]) == (0x81, GET, 0x0001), "missing: KEY_ENOENT"
        # The documented ADD of Hello/World with flags 0xdeadbeef, then the GET finds it.
        s.sendall(
            bytes.fromhex("800200050800000000000012000000000000000000000000deadbeef00000e10") + b"HelloWorld"
        )
        r = read_response(s)
        assert r["status"] == 0 and r["cas"] != 0
        s.sendall(request(GET, b"Hello", opaque=0xCAFE))
        r = read_response(s)
        assert (r["status"], r["opaque"], r["extras"], r["value"]) == (
            0,
            0xCAFE,
            bytes.fromhex("deadbeef"),
            b"World",
        )
        assert r["cas"] != 0


def test_pipelined_quiet_commands_answer_only_what_they_must_in_order(server):
    with connect(server) as s:
        batch = b"".join(request(SETQ, b"p%d" % i, b"v%d" % i, set_extras(), opaque=i) for i in range(200))
        batch += request(GETKQ, b"p7", opaque=1000) + request(GETKQ, b"nope", opaque=1001)
        batch += request(GETKQ, b"p199", opaque=1002) + request(NOOP, opaque=1003)
        s.sendall(batch)  # one write: all of it in flight at once
        replies = [read_response(s) for _ in range(3)]
        assert [(r["opaque"], r["key"], r["value"]) for r in replies] == [
            (1000, b"p7", b"v7"),
            (1002, b"p199", b"v199"),
            (1003, b"", b""),
        ], "quiet sets and the quiet miss are silent; replies keep request order"
        # A quiet command that fails does answer.
        s.sendall(request(0x12, b"p7", b"x", set_extras(), opaque=7) + request(NOOP, opaque=8))  # ADDQ
        assert [(r["opaque"], r["status"]) for r in (read_response(s), read_response(s))] == [
            (7, 0x0002),
            (8, 0),
        ]


def test_errors_get_the_documented_status(server):
    with connect(server) as s:
        s.sendall(request(0xEE, opaque=1))
        assert read_response(s)["status"] == 0x0081, "unknown command"
        s.sendall(request(SET, b"k", b"v", extras=b"\x00" * 3, opaque=2))
        assert read_response(s)["status"] == 0x0004, "SET with 3 bytes of extras: EINVAL"
        s.sendall(request(SET, b"", b"v", set_extras(), opaque=3))
        assert read_response(s)["status"] == 0x0004, "empty key: EINVAL"
        s.sendall(request(SET, b"k" * 251, b"v", set_extras(), opaque=4))
        assert read_response(s)["status"] == 0x0004, "key over 250 bytes: EINVAL"
        s.sendall(request(DELETE, b"never-set", opaque=5))
        assert read_response(s)["status"] == 0x0001
        s.sendall(
            request(SET, b"s", b"text", set_extras())
            + request(INCR, b"s", extras=struct.pack(">QQI", 1, 0, 0))
        )
        read_response(s)
        assert read_response(s)["status"] == 0x0006, "INCR of a non-number: DELTA_BADVAL"
        # Sections longer than the body: EINVAL, and the connection stays usable.
        bad = bytearray(request(GET, b"abc"))
        bad[3] = 9  # key length 9 in a 3-byte body
        s.sendall(bytes(bad) + request(NOOP, opaque=9))
        assert read_response(s)["status"] == 0x0004
        assert read_response(s)["opaque"] == 9
        # A durability level (flexible framing: ID 1, length 1, level 1 = majority) needs
        # replicas this node does not have.
        s.sendall(flex_request(SET, bytes([0x11, 0x01]), b"d", b"v", set_extras(), opaque=10))
        r = read_response(s)
        assert (r["status"], r["opaque"]) == (0x00A1, 10), "durability impossible"
        s.sendall(flex_request(SET, bytes([0x11, 0x07]), b"d", b"v", set_extras(), opaque=11))
        assert read_response(s)["status"] == 0x00A0, "an unknown level: invalid"


def test_a_body_over_the_limit_gets_e2big_and_the_connection_closes(server):
    with connect(server) as s:
        s.sendall(HEADER.pack(0x80, SET, 1, 8, 0, 0, 0x7FFFFFFF, 42, 0))
        r = read_response(s)
        assert (r["status"], r["opaque"]) == (0x0003, 42)
        assert s.recv(1) == b"", "closed, nothing of the body read"
    with connect(server) as s:
        s.sendall(b"\x85" * 24)  # below 0x80 would be the text protocol
        assert s.recv(1) == b"", "a bad magic closes the connection"
    server.wait_for("closing connection from")


def test_vbucket_routing_and_not_my_vbucket(server):
    import sluice

    key = b"route-me"
    vb = sluice.vbucket_of(key, 64)
    with connect(server) as s:
        s.sendall(request(SET, key, b"v", set_extras(), vbucket=0))
        assert read_response(s)["status"] == 0, "vbucket 0: routed by key hash"
        wrong = (vb + 1) % 64 or 1
        s.sendall(request(GET, key, vbucket=wrong))
        assert read_response(s)["status"] == 0x0007, "an aware client naming the wrong vbucket"
        s.sendall(request(GET, key, vbucket=vb))
        assert read_response(s)["value"] == b"v"


def test_hello_mutation_seqno_and_vbucket_seqnos(server):
    with connect(server) as s:
        s.sendall(request(HELLO, b"test-agent", struct.pack(">HHH", 0x04, 0x07, 0x9999)))
        r = read_response(s)
        assert r["status"] == 0 and r["value"] == struct.pack(">HH", 0x04, 0x07), "unknown features left out"
        s.sendall(request(SET, b"seq", b"v", set_extras()))
        r = read_response(s)
        uuid, seqno = struct.unpack(">QQ", r["extras"])
        assert uuid != 0 and seqno >= 1
        s.sendall(request(GET_ALL_VB_SEQNOS))
        r = read_response(s)
        pairs = [struct.unpack(">HQ", r["value"][i : i + 10]) for i in range(0, len(r["value"]), 10)]
        assert len(pairs) == 64 and dict(pairs)[__import__("sluice").vbucket_of(b"seq", 64)] == seqno
        s.sendall(request(VERSION) + request(STAT))
        assert read_response(s)["value"]
        stats = {}
        while True:
            r = read_response(s)
            if not r["key"]:
                break
            stats[r["key"].decode()] = r["value"].decode()
        assert int(stats["curr_items"]) >= 1 and int(stats["curr_connections"]) >= 1


def test_max_connections_refuses_the_one_over(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("max_connections = 2\n")
    node = Node(tmp_path / "d", "--config", str(cfg))
    try:
        a, b = connect(node), connect(node)
        for s in (a, b):
            s.sendall(request(NOOP))
            assert read_response(s)["status"] == 0
        c = connect(node)
        assert c.recv(1) == b"", "the third connection is closed at once"
        a.close()
        time.sleep(0.3)
        d = connect(node)
        d.sendall(request(NOOP))
        assert read_response(d)["status"] == 0, "a freed slot serves again"
        for s in (b, c, d):
            s.close()
    finally:
        assert node.stop() == 0


def test_a_peer_that_never_reads_cannot_grow_the_server(server):
    with connect(server) as s:
        s.sendall(request(SET, b"big", b"x" * 100_000, set_extras()))
        assert read_response(s)["status"] == 0
    before = server.rss_bytes()
    hog = connect(server)
    hog.settimeout(0.5)
    sent = 0
    get = request(GET, b"big")
    deadline = time.monotonic() + 10
    try:  # ~2 GB of replies asked for, none read: the socket fills and blocks
        while sent < 20_000 and time.monotonic() < deadline:
            hog.sendall(get * 100)
            sent += 100
    except (TimeoutError, BlockingIOError):
        pass
    time.sleep(0.5)
    grown = server.rss_bytes() - before
    assert grown < 64 << 20, f"server grew by {grown} bytes for a peer that does not read"
    with connect(server) as other:  # everyone else is served meanwhile
        other.sendall(request(NOOP))
        assert read_response(other)["status"] == 0
    hog.close()


def test_sigterm_answers_what_was_read_then_exits_0(tmp_path):
    node = Node(tmp_path / "d")
    s = connect(node)
    s.sendall(b"".join(request(SET, b"t%d" % i, b"v", set_extras(), opaque=i) for i in range(50)))
    for i in range(50):
        assert read_response(s)["opaque"] == i
    assert node.stop() == 0
    assert s.recv(1) == b""
    s.close()
    node = Node(tmp_path / "d")
    with connect(node) as c:
        c.sendall(request(GET, b"t49"))
        assert read_response(c)["value"] == b"v", "acknowledged before the stop: still there"
    assert node.stop() == 0


@pytest.mark.parametrize("listen", ["0.0.0.0:0"])
def test_non_loopback_needs_insecure(tmp_path, listen):
    import subprocess
    import sys

    r = subprocess.run(
        # The last --listen is the one that counts: the others stay off the default ports.
        [sys.executable, "-m", "sluice", "serve", "--data-dir", str(tmp_path / "d"), *NO_DEFAULT_PORTS]
        + ["--listen", listen],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--insecure" in r.stderr


def test_stat_vbucket_seqno_group(server):
    import sluice

    with connect(server) as s:
        s.sendall(request(SET, b"sq", b"v", set_extras()) + request(STAT, b"vbucket-seqno"))
        assert read_response(s)["status"] == 0
        stats = {}
        while True:
            r = read_response(s)
            if not r["key"]:
                break
            stats[r["key"].decode()] = r["value"].decode()
        vb = sluice.vbucket_of(b"sq", 64)
        assert stats[f"vb_{vb}:high_seqno"] == "1" and int(stats[f"vb_{vb}:uuid"]) != 0
        assert len([k for k in stats if k.endswith(":high_seqno")]) == 64
        s.sendall(request(STAT, b"nonsense"))
        assert read_response(s)["status"] == 0x0001


def test_an_idle_connection_is_closed_after_idle_timeout(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('idle_timeout = "1s"\n')
    node = Node(tmp_path / "d", "--config", str(cfg))
    try:
        with connect(node) as s:
            s.sendall(request(NOOP))
            assert read_response(s)["status"] == 0
            start = time.monotonic()
            assert s.recv(1) == b"", "closed by the server"
            assert 0.5 < time.monotonic() - start < 8
        node.wait_for("idle for")
    finally:
        assert node.stop() == 0


def test_select_bucket_isolates_buckets(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[buckets.other]\nnum_vbuckets = 16\n")
    node = Node(tmp_path / "d", "--config", str(cfg))
    try:
        with connect(node) as s:
            s.sendall(request(0x89, b"other") + request(SET, b"k", b"in-other", set_extras()))
            assert [read_response(s)["status"] for _ in range(2)] == [0, 0]
            s.sendall(request(0x89, b"default") + request(GET, b"k"))
            assert read_response(s)["status"] == 0
            assert read_response(s)["status"] == 0x0001, "not in default"
            s.sendall(request(0x89, b"nope"))
            assert read_response(s)["status"] == 0x0008, "NO_BUCKET"
    finally:
        assert node.stop() == 0


def test_random_garbage_never_takes_the_server_down(server):
    import random

    rng = random.Random(7)
    for i in range(300):
        with connect(server) as s:
            if i % 3 == 0:  # a valid header with random sections and lengths
                body = rng.randbytes(rng.randrange(0, 64))
                head = HEADER.pack(
                    0x80,
                    rng.randrange(256),
                    rng.randrange(70),
                    rng.randrange(40),
                    rng.randrange(256),
                    rng.randrange(65536),
                    len(body),
                    i,
                    rng.getrandbits(64),
                )
                s.sendall(head + body)
            else:
                s.sendall(rng.randbytes(rng.randrange(1, 200)))
            s.shutdown(socket.SHUT_WR)
            try:
                while s.recv(65536):
                    pass
            except OSError:
                pass
    with connect(server) as s:
        s.sendall(request(SET, b"alive", b"yes", set_extras()) + request(GET, b"alive"))
        read_response(s)
        assert read_response(s)["value"] == b"yes"
