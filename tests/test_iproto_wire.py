"""iproto on the wire, with raw sockets: the greeting's bytes, pipelined packets answered with
SYNC echoed (reads before the writes ahead of them, as Tarantool 2.6 does), IPROTO_ID,
SCHEMA_VERSION checks, and malformed packets (an error reply or a closed connection, the server
serving others meanwhile)."""

from __future__ import annotations

import base64
import re
import socket
import time

import msgpack
import pytest
from iproto_helpers import USERS_SPACE, chap_scramble, host_port, packet, start_iproto_node
from tarantool_peer import TARANTOOL, TarantoolPeer


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = start_iproto_node(tmp_path_factory.mktemp("wire"))
    yield n
    assert n.stop() == 0, n.log()[-3000:]


def connect(node) -> tuple[socket.socket, bytes]:
    s = socket.create_connection(host_port(node.iproto), timeout=10)
    greeting = b""
    while len(greeting) < 128:
        chunk = s.recv(128 - len(greeting))
        assert chunk, "closed before the greeting"
        greeting += chunk
    return s, greeting


def read_reply(s: socket.socket) -> tuple[dict, dict, bytes]:
    """One reply: header, body and the raw bytes after the length prefix."""
    buf = b""
    while len(buf) < 5:
        chunk = s.recv(5 - len(buf))
        assert chunk, "closed"
        buf += chunk
    assert buf[0] == 0xCE, "the server writes every length as ce + u32"
    n = int.from_bytes(buf[1:5], "big")
    payload = b""
    while len(payload) < n:
        chunk = s.recv(n - len(payload))
        assert chunk, "closed mid-reply"
        payload += chunk
    u = msgpack.Unpacker(raw=False, strict_map_key=False)
    u.feed(payload)
    header = next(u)
    body = next(u, {})
    return header, body, payload


def test_the_greeting(node):
    s1, g1 = connect(node)
    s2, g2 = connect(node)
    s1.close()
    s2.close()
    line1, line2 = g1[:64], g1[64:]
    assert line1.endswith(b"\n") and line2.endswith(b"\n")
    m = re.fullmatch(rb"Tarantool 2\.6\.0 \(Binary\) ([0-9a-f-]{36}) *\n", line1)
    assert m, line1
    assert g2[:64] == line1, "the instance uuid is the same on every connection"
    salt = base64.b64decode(line2.strip())
    assert len(salt) == 32
    assert base64.b64decode(g2[64:].strip()) != salt, "a fresh salt per connection"


def test_pipelined_pings_are_answered_in_order_with_their_sync(node):
    s, _ = connect(node)
    syncs = [150, 151, 2**40]
    s.sendall(b"".join(packet({0: 64, 1: sync}) for sync in syncs))
    replies = [read_reply(s) for _ in syncs]
    assert [h[1] for h, _, _ in replies] == syncs
    assert all(h[0] == 0 for h, _, _ in replies)
    header, _, raw = replies[0]
    # Tarantool's fixed layout: 83 00 ce<code> 01 cf<sync> 05 ce<schema version>.
    assert (
        raw[:3] == bytes([0x83, 0x00, 0xCE])
        and raw[7:9] == bytes([0x01, 0xCF])
        and raw[17:19] == bytes([0x05, 0xCE])
    )
    s.close()


def mixed_pipeline(address: tuple[str, int]) -> list[tuple[int, int, object]]:
    """Logs in as app, sends writes, reads, a ping and failing writes in one packet, and returns
    the answers as they came: (sync, code, data or error text)."""
    s = socket.create_connection(address, timeout=10)
    greeting = b""
    while len(greeting) < 128:
        greeting += s.recv(128 - len(greeting))
    salt = base64.b64decode(greeting[64:].strip())
    s.sendall(packet({0: 7, 1: 1}, {0x23: "app", 0x21: ["chap-sha1", chap_scramble("secret", salt)]}))
    assert read_reply(s)[0][0] == 0

    def select(sync: int, key: int) -> bytes:
        body = {0x10: USERS_SPACE, 0x11: 0, 0x12: 10, 0x13: 0, 0x14: 0, 0x20: [key]}
        return packet({0: 1, 1: sync}, body)

    s.sendall(
        packet({0: 3, 1: 11}, {0x10: USERS_SPACE, 0x21: [9001, "a", 1]})  # REPLACE
        + select(12, 9001)  # sees the REPLACE before it is in the WAL
        + packet({0: 64, 1: 13})  # PING
        + packet({0: 2, 1: 14}, {0x10: USERS_SPACE, 0x21: [9001, "b", 2]})  # INSERT: a duplicate
        + packet({0: 3, 1: 15}, {0x10: USERS_SPACE, 0x21: [9002, "c", 3]})  # REPLACE
        + select(16, 9002)
        + packet({0: 5, 1: 17}, {0x10: USERS_SPACE, 0x11: 0, 0x20: [9099]})  # DELETE: no such key
    )
    out = []
    for _ in range(7):
        header, body, _ = read_reply(s)
        out.append((header[1], header[0], body.get(0x30, body.get(0x31))))
    s.close()
    return out


def test_pipelined_reads_are_not_held_up_by_the_writes_before_them(node, tmp_path):
    """As Tarantool 2.6 answers (the order below is what it sent): reads, pings and errors at
    once, the replies of writes once the WAL holds them, in their order, a write that changed
    nothing among them."""
    expected = [
        (12, 0, [[9001, "a", 1]]),
        (13, 0, None),
        (14, 0x8000 | 3, "Duplicate key exists in unique index 'primary' in space 'users'"),
        (16, 0, [[9002, "c", 3]]),
        (11, 0, [[9001, "a", 1]]),
        (15, 0, [[9002, "c", 3]]),
        (17, 0, []),
    ]
    assert mixed_pipeline(host_port(node.iproto)) == expected
    if TARANTOOL is not None:
        with TarantoolPeer(tmp_path / "tarantool") as peer:
            assert mixed_pipeline((peer.host, peer.port)) == expected


def test_id_and_schema_version(node):
    s, _ = connect(node)
    s.sendall(packet({0: 73, 1: 1}, {0x54: 3, 0x55: [0, 1, 2]}))
    header, body, _ = read_reply(s)
    assert header[0] == 0 and body[0x54] == 3 and body[0x55] == []
    version = header[5]
    assert version > 0
    s.sendall(packet({0: 64, 1: 2, 5: version}))
    assert read_reply(s)[0][0] == 0, "the current version passes"
    s.sendall(packet({0: 64, 1: 3, 5: version + 1}))
    header, body, _ = read_reply(s)
    assert header[0] == 0x8000 | 109 and header[5] == version
    assert body[0x31] == f"Wrong schema version, current: {version + 1}, in request: {version}"
    s.close()


def test_auth_by_hand_and_bad_scramble(node):
    s, greeting = connect(node)
    salt = base64.b64decode(greeting[64:].strip())
    s.sendall(packet({0: 7, 1: 1}, {0x23: "app", 0x21: ["chap-sha1", chap_scramble("secret", salt)]}))
    assert read_reply(s)[0][0] == 0
    s.sendall(packet({0: 7, 1: 2}, {0x23: "app", 0x21: ["chap-sha1", b"short"]}))
    header, body, _ = read_reply(s)
    assert header[0] == 0x8000 | 20 and body[0x31] == "Invalid MsgPack - invalid scramble size"
    s.sendall(packet({0: 1, 1: 3}, {0x10: USERS_SPACE, 0x20: [], 0x12: 10}))
    assert read_reply(s)[0][0] == 0, "still logged in as app"
    s.close()


def test_malformed_packets(node):
    s, _ = connect(node)
    # A header that is not a map: an error (sync 0), the connection stays.
    s.sendall(b"\x01\x05")
    header, body, _ = read_reply(s)
    assert header[0] == 0x8000 | 20 and header[1] == 0
    s.sendall(packet({0: 64, 1: 9}))
    assert read_reply(s)[0][1] == 9
    # A body that is not a map.
    s.sendall(
        msgpack.packb(len(msgpack.packb({0: 1, 1: 10}) + b"\x05")) + msgpack.packb({0: 1, 1: 10}) + b"\x05"
    )
    assert read_reply(s)[0][0] == 0x8000 | 20
    # A SELECT without LIMIT.
    s.sendall(packet({0: 1, 1: 11}, {0x10: USERS_SPACE, 0x20: []}))
    header, body, _ = read_reply(s)
    assert header[0] == 0x8000 | 69 and header[1] == 11, body
    other, _ = connect(node)
    # A length prefix that is no unsigned integer: an error, then the connection closes.
    s.sendall(b"\xc1")
    header, body, _ = read_reply(s)
    assert body[0x31] == "Invalid MsgPack - packet length"
    s.settimeout(10)
    assert s.recv(1) == b"", "closed"
    s.close()
    other.sendall(packet({0: 64, 1: 1}))
    assert read_reply(other)[0][0] == 0, "the server serves other connections meanwhile"
    other.close()
    assert node.metric_sum("sluice_iproto_errors_total") >= 4


def test_only_the_nodes_replication_login_may_name_the_user_a_request_runs_as(node):
    """sluice's forwarded-for header key (0x70) is how a cluster node hands on a request it
    routes: from a client's own login, even one that may write, it is refused, never obeyed."""
    s, greeting = connect(node)
    salt = base64.b64decode(greeting[64:].strip())
    s.sendall(packet({0: 7, 1: 1}, {0x23: "app", 0x21: ["chap-sha1", chap_scramble("secret", salt)]}))
    assert read_reply(s)[0][0] == 0
    s.sendall(packet({0: 1, 1: 2, 0x70: "guest"}, {0x10: USERS_SPACE, 0x20: [1], 0x12: 1}))
    header, body, _ = read_reply(s)
    assert header[0] == 0x8000 | 42, (header, body)  # ER_ACCESS_DENIED
    s.close()


def test_a_read_over_a_cluster_reads_the_vbuckets_it_names_and_fails_on_one_not_active(tmp_path):
    """sluice's part header key (0x71) carries, with a read one node fans out over a cluster,
    the vbuckets the node that answers is to read (one bit each): exactly those, and an error
    when one of them is not active there (a node that has not applied the asking node's map
    yet), never an answer that leaves its tuples out."""
    from iproto_helpers import NUM_VBUCKETS

    active = start_iproto_node(tmp_path, "active", users=False)
    replica = None
    every, none = bytes([0xFF]) * (NUM_VBUCKETS // 8), bytes(NUM_VBUCKETS // 8)
    select_all = {0x10: USERS_SPACE, 0x20: [], 0x12: 100, 0x14: 2}
    try:
        s, _ = connect(active)
        for i in range(1, 21):
            s.sendall(packet({0: 2, 1: i}, {0x10: USERS_SPACE, 0x21: [i, f"user {i}", 20 + i]}))
            assert read_reply(s)[0][0] == 0
        s.sendall(packet({0: 1, 1: 100, 0x71: every}, select_all))
        header, body, _ = read_reply(s)
        assert header[0] == 0 and [t[0] for t in body[0x30]] == list(range(1, 21)), (header, body)
        s.sendall(packet({0: 1, 1: 101, 0x71: none}, select_all))
        header, body, _ = read_reply(s)
        assert header[0] == 0 and body[0x30] == [], (header, body)
        s.sendall(packet({0: 1, 1: 102, 0x71: bytes(129)}, select_all))
        header, body, _ = read_reply(s)
        assert header[0] == 0x8000 | 20, (header, body)  # ER_INVALID_MSGPACK
        s.close()

        # Every vbucket of a replica is a replica: it serves a plain SELECT, and refuses a part.
        replica = start_iproto_node(tmp_path, "replica", "--replica-of", active.address, users=False)
        r, _ = connect(replica)
        deadline = time.monotonic() + 30
        while True:
            r.sendall(packet({0: 1, 1: 1}, select_all))
            header, body, _ = read_reply(r)
            if header[0] == 0 and len(body[0x30]) == 20:
                break
            assert time.monotonic() < deadline, (header, body)
            time.sleep(0.1)
        r.sendall(packet({0: 1, 1: 2, 0x71: every}, select_all))
        header, body, _ = read_reply(r)
        assert header[0] == 0x8000 | 115, (header, body)  # ER_SYSTEM
        assert re.search(
            r"vbucket \d+ is not active on the node the cluster map says \(the map is", body[0x31]
        ), body
        r.close()
    finally:
        if replica is not None:
            assert replica.stop() == 0
        assert active.stop() == 0
