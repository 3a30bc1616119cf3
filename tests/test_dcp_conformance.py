"""The DCP producer on the wire, checked against the byte layouts of the Couchbase documents
(shared/reference/couchbase-kv/dcp/commands/*.md) with a consumer written by hand in
dcp_wire.py: DCP_OPEN, CONTROL, STREAM_REQ answers, every message's extras, STREAM_END,
CLOSE_STREAM, NOOP and dead connections, name replacement, flow control."""

from __future__ import annotations

import socket
import struct
import time

import bmemcached
import pytest
import sluice
from dcp_wire import (
    CLOSE_STREAM,
    DELETION,
    END_CLOSED,
    END_OK,
    EXPIRATION,
    FLAG_FROM_LATEST,
    FLAG_TAKEOVER,
    FLAG_TO_LATEST,
    GET_FAILOVER_LOG,
    INCLUDE_DELETE_TIMES,
    MUTATION,
    NOOP,
    PRODUCER,
    SET_VBUCKET_STATE,
    SNAP_CHECKPOINT,
    SNAP_DISK,
    SNAP_MEMORY,
    SNAPSHOT_MARKER,
    STREAM_END,
    DcpConnection,
    buffer_ack,
    control,
    failover_log,
    frame,
    open_producer,
    read_frame,
    seqno_ack,
    stream_req,
)
from helpers import Node
from mcbp_wire import SET, durability_framing, flex_request, set_extras

EINVAL, KEY_EEXISTS, KEY_ENOENT, NOT_MY_VBUCKET, ERANGE, ROLLBACK, NOT_SUPPORTED = (
    0x04,
    0x02,
    0x01,
    0x07,
    0x22,
    0x23,
    0x83,
)


def keys_in(vbucket: int, n: int, prefix: str = "k", num_vbuckets: int = 64) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        k = f"{prefix}{i}"
        if sluice.vbucket_of(k.encode(), num_vbuckets) == vbucket:
            out.append(k)
        i += 1
    return out


@pytest.fixture
def mc(server):
    c = bmemcached.Client([server.address])
    yield c
    c.disconnect_all()


def test_open_and_its_errors(server):
    s = socket.create_connection((server.host, server.port), timeout=10)
    # open-connection.md: 8 bytes of extras, name in the key; the reply is a bare success header.
    s.sendall(open_producer(b"conformance:open", opaque=0xABCD))
    r = read_frame(s)
    assert r["raw"] == bytes.fromhex("8150000000000000000000000000abcd0000000000000000")
    # A second OPEN on the same connection is refused.
    s.sendall(open_producer(b"again"))
    assert read_frame(s)["word"] == EINVAL
    s.close()

    s = socket.create_connection((server.host, server.port), timeout=10)
    s.sendall(open_producer(b"x" * 201))
    assert read_frame(s)["word"] == EINVAL
    s.sendall(open_producer(b"c", flags=0))  # a consumer endpoint
    assert read_frame(s)["word"] == NOT_SUPPORTED
    s.sendall(open_producer(b"bad", flags=PRODUCER | 0x2))
    assert read_frame(s)["word"] == EINVAL
    # DCP commands before OPEN are refused, not crashed on.
    s.sendall(stream_req(0))
    assert read_frame(s)["word"] == EINVAL
    s.close()


def test_control_keys(server):
    c = DcpConnection(server.host, server.port, b"conformance:control")
    for key, value in [
        ("connection_buffer_size", "1048576"),
        ("enable_noop", "true"),
        ("set_noop_interval", "120"),
        ("enable_expiry_opcode", "true"),
        ("supports_cursor_dropping", "true"),
        ("send_stream_end_on_client_close_stream", "true"),
        ("set_priority", "high"),
        ("connection_buffer_size", "0"),
    ]:
        r = c.call(control(key, value, opaque=7))
        # control.md: the answer echoes the opcode and opaque with status 0 and no body.
        assert r["raw"] == bytes.fromhex(
            "815e0000 00000000 00000000 00000007 0000000000000000".replace(" ", "")
        )
    assert c.control("no_such_control", "true") == EINVAL
    assert c.control("enable_noop", "yes") == EINVAL
    assert c.control("set_noop_interval", "0") == EINVAL
    assert c.control("connection_buffer_size", "-5") == EINVAL
    c.close()


def test_stream_request_answers(server, mc):
    for k in keys_in(0, 5):
        mc.set(k, "v")
    c = DcpConnection(server.host, server.port, b"conformance:streamreq")
    # OK: no extras, no key, the failover log as 16-byte (uuid, seqno) entries.
    r = c.call(stream_req(0, end=0))
    assert r["word"] == 0 and r["extras"] == b"" and r["key"] == b""
    log = failover_log(r["value"])
    assert log[-1][1] == 0
    uuid = log[0][0]
    assert c.next_message() == {
        "op": STREAM_END,
        "vbucket": 0,
        "opaque": 0x1000,
        "size": 28,
        "reason": END_OK,
    }
    # GET_FAILOVER_LOG gives the same log.
    r = c.call(frame(GET_FAILOVER_LOG, vbucket=0, opaque=3))
    assert r["word"] == 0 and failover_log(r["value"]) == log
    assert c.call(frame(GET_FAILOVER_LOG, vbucket=999))["word"] == NOT_MY_VBUCKET

    # ERANGE for inconsistent seqnos (stream-request.md's error list).
    assert c.call(stream_req(1, start=5, end=3))["word"] == ERANGE
    assert c.call(stream_req(1, start=5, uuid=uuid, snap_start=6, snap_end=9))["word"] == ERANGE
    assert c.call(stream_req(1, start=5, uuid=uuid, snap_start=1, snap_end=4))["word"] == ERANGE
    # Malformed: extras of the wrong length.
    bad = frame(0x53, extras=b"\0" * 40, vbucket=1)
    assert c.call(bad)["word"] == EINVAL
    assert c.call(stream_req(999))["word"] == NOT_MY_VBUCKET

    # ROLLBACK (0x23): an unknown uuid rolls back to 0, the body an 8-byte seqno.
    r = c.call(stream_req(0, start=3, uuid=0xFEEDDECA, snap_start=3, snap_end=3))
    assert r["word"] == ROLLBACK and r["value"] == struct.pack(">Q", 0)
    # A known uuid but a start beyond what the producer has: back to its high seqno.
    r = c.call(stream_req(0, start=50, uuid=uuid, snap_start=50, snap_end=50))
    assert r["word"] == ROLLBACK and struct.unpack(">Q", r["value"])[0] == 5
    # Start 0 with a uuid: "rollback is requested" when the uuid is not ours.
    assert c.call(stream_req(0, start=0, uuid=12345))["word"] == ROLLBACK
    assert c.call(stream_req(0, start=0, uuid=uuid))["word"] == 0
    # A second stream for the same vbucket on the connection: KEY_EEXISTS.
    assert c.call(stream_req(0, start=0, uuid=uuid))["word"] == KEY_EEXISTS
    c.close()


def test_message_extras_and_snapshots(clocked_server):
    server = clocked_server
    mc = bmemcached.Client([server.address])
    ks = keys_in(2, 4)
    for k in ks:
        mc.set(k, "value-" + k)
    mc.delete(ks[1])
    c = DcpConnection(
        server.host, server.port, b"conformance:messages", flags=PRODUCER | INCLUDE_DELETE_TIMES
    )
    assert c.control("enable_expiry_opcode", "true") == 0
    r = c.call(stream_req(2))
    uuid = failover_log(r["value"])[0][0]
    # History older than the checkpoints: one disk snapshot of the latest version per key.
    msgs = c.collect(lambda m: len(m) == 5)
    marker = msgs[0]
    assert marker["op"] == SNAPSHOT_MARKER and marker["flags"] & SNAP_DISK
    assert (marker["start"], marker["end"]) == (1, 5)
    docs = msgs[1:]
    assert [m["seqno"] for m in docs] == [1, 3, 4, 5]
    assert [m["op"] for m in docs] == [MUTATION, MUTATION, MUTATION, DELETION]
    assert docs[0]["key"] == ks[0].encode() and docs[0]["value"] == b"value-" + ks[0].encode()
    assert docs[0]["rev"] == 1 and docs[0]["cas"] != 0
    # INCLUDE_DELETE_TIMES: deletion v2, 21 bytes of extras with the delete time.
    assert docs[3]["key"] == ks[1].encode() and docs[3]["delete_time"] > 1_600_000_000
    assert all(marker["start"] <= m["seqno"] <= marker["end"] for m in docs)

    # Live changes come as memory snapshots.
    mc.set(ks[0], "again")
    mc.set(ks[2], "x", time=1)
    msgs = c.collect(lambda m: sum(1 for x in m if x["op"] != SNAPSHOT_MARKER) == 2)
    markers = [m for m in msgs if m["op"] == SNAPSHOT_MARKER]
    assert markers and all(m["flags"] & SNAP_MEMORY for m in markers)
    seqnos = [m["seqno"] for m in msgs if m["op"] == MUTATION]
    assert seqnos == [6, 7]
    # The item expires; reading it makes the EXPIRATION (20 bytes of extras).
    server.inject("clock_offset_secs", 3)
    assert mc.get(ks[2]) is None
    m = [x for x in c.collect(lambda m: any(x["op"] == EXPIRATION for x in m)) if x["op"] == EXPIRATION]
    assert m[0]["seqno"] == 8 and m[0]["key"] == ks[2].encode() and m[0]["delete_time"] > 0

    # A v1 connection: deletions with 18 bytes of extras; expirations as deletions without the control.
    c2 = DcpConnection(server.host, server.port, b"conformance:v1")
    c2.call(stream_req(2, start=7, uuid=uuid, snap_start=7, snap_end=7))
    (marker, exp) = c2.collect(lambda m: len(m) == 2)
    assert exp["op"] == DELETION and "delete_time" not in exp and exp["seqno"] == 8
    c.close()
    c2.close()


def test_end_seqno_latest_flags_and_close_stream(server, mc):
    ks = keys_in(3, 6)
    for k in ks:
        mc.set(k, "v")
    c = DcpConnection(server.host, server.port, b"conformance:end")
    c.call(stream_req(3, end=0, flags=FLAG_TO_LATEST))
    msgs = c.collect(lambda m: m and m[-1]["op"] == STREAM_END)
    assert [m["seqno"] for m in msgs if m["op"] == MUTATION] == [1, 2, 3, 4, 5, 6]
    assert msgs[-1]["reason"] == END_OK
    # FROM_LATEST: only what comes after the request.
    assert c.call(stream_req(3, flags=FLAG_FROM_LATEST))["word"] == 0
    mc.set(ks[0], "later")
    msgs = c.collect(lambda m: any(x["op"] == MUTATION for x in m))
    assert [m["seqno"] for m in msgs if m["op"] == MUTATION] == [7]
    # CLOSE_STREAM: success, and STREAM_END "closed" once the client asked for it.
    assert c.control("send_stream_end_on_client_close_stream", "true") == 0
    r = c.call(frame(CLOSE_STREAM, vbucket=3, opaque=9))
    assert r["word"] == 0
    assert c.next_message()["reason"] == END_CLOSED
    assert c.call(frame(CLOSE_STREAM, vbucket=3))["word"] == KEY_ENOENT
    c.close()


def test_noop_and_dead_connection(server):
    c = DcpConnection(server.host, server.port, b"conformance:noop")
    assert c.control("enable_noop", "true") == 0
    assert c.control("set_noop_interval", "1") == 0
    c.call(stream_req(5))
    # An idle producer sends NOOP after one interval; answering keeps the connection.
    for _ in range(2):
        f = read_frame(c.sock)
        assert (f["magic"], f["opcode"], f["extras"], f["key"], f["value"]) == (0x80, NOOP, b"", b"", b"")
        c.send(frame(NOOP, magic=0x81, opaque=f["opaque"], status=0))
    # Not answering: the producer closes the connection after another interval.
    f = read_frame(c.sock)
    assert f["opcode"] == NOOP
    c.sock.settimeout(10)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        while True:
            read_frame(c.sock)
    assert time.monotonic() - t0 < 8
    c.close()


def test_reusing_a_name_replaces_the_connection(server):
    a = DcpConnection(server.host, server.port, b"conformance:same-name")
    b = DcpConnection(server.host, server.port, b"conformance:same-name")
    a.sock.settimeout(10)
    with pytest.raises(ConnectionError):
        read_frame(a.sock)
    assert b.call(stream_req(0, end=0))["word"] == 0
    b.close()


def test_flow_control_window(server, mc):
    """A consumer that never acknowledges gets the buffer size (plus at most one message)."""
    c = DcpConnection(server.host, server.port, b"conformance:flow")
    buffer = 4096
    assert c.control("connection_buffer_size", str(buffer)) == 0
    ks = keys_in(4, 200)
    for k in ks:
        mc.set(k, "x" * 100)
    c.call(stream_req(4))
    got = []
    c.sock.settimeout(1.5)
    with pytest.raises(socket.timeout):
        while True:
            got.append(read_frame(c.sock))
    sent = sum(f["size"] for f in got)
    largest = max(f["size"] for f in got)
    assert buffer <= sent <= buffer + largest, (sent, largest)
    # Acknowledging lets the rest through.
    c.send(buffer_ack(sent))
    c.sock.settimeout(10)
    seqnos = [f for f in got if f["opcode"] == MUTATION]
    while len(seqnos) < 200:
        f = read_frame(c.sock)
        if f["opcode"] == MUTATION:
            seqnos.append(f)
        c.send(buffer_ack(f["size"]))
    assert len(seqnos) == 200
    c.close()


def test_garbage_on_a_producer_connection_closes_it_only(server, mc):
    c = DcpConnection(server.host, server.port, b"conformance:garbage")
    c.send(b"\x13" * 24)
    c.sock.settimeout(10)
    with pytest.raises(ConnectionError):
        read_frame(c.sock)
    mc.set("still", "works")
    assert mc.get("still") == "works"


def test_snapshot_flags_checkpoint_bit(server, mc):
    c = DcpConnection(server.host, server.port, b"conformance:checkpoint")
    c.call(stream_req(6))
    mc.set(keys_in(6, 1)[0], "v")
    m = c.next_message()
    assert m["op"] == SNAPSHOT_MARKER and m["flags"] == SNAP_MEMORY | SNAP_CHECKPOINT
    c.close()


def test_requires_stream_permission(tmp_path):
    cfg = tmp_path / "sluice.toml"
    h = sluice.config.hash_password("pw")
    cfg.write_text(
        f'[users.reader]\npassword_hash = "{h}"\nbuckets = {{ default = ["read"] }}\n'
        f'[users.streamer]\npassword_hash = "{h}"\nbuckets = {{ default = ["read", "stream"] }}\n'
    )
    node = Node(tmp_path / "n", "--config", str(cfg))
    try:
        for user, status in [("reader", 0x24), ("streamer", 0)]:
            s = socket.create_connection((node.host, node.port), timeout=10)
            s.sendall(frame(0x21, key=b"PLAIN", value=b"\0" + user.encode() + b"\0pw"))
            assert read_frame(s)["word"] == 0
            s.sendall(open_producer(b"perm:" + user.encode()))
            assert read_frame(s)["word"] == status
            s.close()
        with pytest.raises(sluice.SluiceError, match="0x24"):
            stream = sluice.Client(node.address, username="reader", password="pw").stream(end="now")
            list(stream)
        stream = sluice.Client(node.address, username="streamer", password="pw").stream(end="now")
        assert list(stream) == []
    finally:
        assert node.stop() == 0


def durable_set(host: str, port: int, key: bytes, level: int = 1) -> socket.socket:
    """Sends a SET with the durability frame info (magic 0x08) and returns the socket to read
    its answer from."""
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(flex_request(SET, durability_framing(level), key, b"v", set_extras(), opaque=7))
    return s


def test_seqno_acknowledged_completes_a_majority_write(server):
    vb = 9
    key = keys_in(vb, 1)[0].encode()
    d = DcpConnection(server.host, server.port, name=b"conformance:replica")
    # Without sync replication enabled the producer refuses the acknowledgement.
    assert d.call(seqno_ack(vb, 1, opaque=0x1210))["word"] == EINVAL
    assert d.control("consumer_name", "replica-1") == 0
    assert d.control("enable_sync_writes", "true") == 0
    r = d.call(stream_req(vb, opaque=0x77))
    assert r["word"] == 0
    w = durable_set(server.host, server.port, key)
    msgs = d.collect(lambda m: any(x["op"] == MUTATION for x in m))
    seqno = next(x["seqno"] for x in msgs if x["op"] == MUTATION)
    # The write waits for this replica; nothing has answered it yet.
    w.settimeout(0.3)
    with pytest.raises(socket.timeout):
        w.recv(1)
    d.send(seqno_ack(vb, seqno, opaque=0x1210))
    w.settimeout(10)
    answer = read_frame(w)
    assert answer["magic"] == 0x81 and answer["word"] == 0 and answer["opaque"] == 7
    w.close()
    d.close()


def test_a_takeover_stream_hands_the_vbucket_over(server, mc):
    vb = 12
    keys = keys_in(vb, 50)
    mc.set_multi({k: "before" for k in keys})
    d = DcpConnection(server.host, server.port, name=b"conformance:takeover")
    assert d.call(stream_req(vb, flags=FLAG_TAKEOVER, opaque=0x99))["word"] == 0
    msgs = d.collect(lambda m: any(x["op"] == SET_VBUCKET_STATE for x in m))
    assert sum(x["op"] == MUTATION for x in msgs) == 50
    pending = msgs[-1]
    assert pending["state"] == 0x03 and pending["vbucket"] == vb and pending["opaque"] == 0x99
    # Pending: writes to the vbucket get a temporary failure, not a loss.
    s = socket.create_connection((server.host, server.port), timeout=10)
    s.sendall(frame(0x01, key=keys[0].encode(), value=b"x", extras=struct.pack(">II", 0, 0), opaque=5))
    assert read_frame(s)["word"] == 0x86
    active = d.next_message()
    assert active["op"] == SET_VBUCKET_STATE and active["state"] == 0x01
    # The consumer answers; then the source is dead and the stream ends.
    d.send(frame(SET_VBUCKET_STATE, magic=0x81, opaque=active["opaque"], status=0))
    end = d.next_message()
    assert end["op"] == STREAM_END and end["reason"] == END_OK
    s.sendall(frame(0x01, key=keys[0].encode(), value=b"x", extras=struct.pack(">II", 0, 0), opaque=6))
    assert read_frame(s)["word"] == NOT_MY_VBUCKET
    s.close()
    d.close()


def test_get_all_vb_seqnos_on_a_dcp_connection(server, mc):
    """Answered by the producer itself: a stream user (a replica measuring its lag) may ask."""
    get_all_vb_seqnos = 0x48
    mc.set("seqnos-key", "v")
    s = socket.create_connection((server.host, server.port), timeout=10)
    s.sendall(open_producer(b"conformance:seqnos"))
    assert read_frame(s)["word"] == 0
    s.sendall(frame(get_all_vb_seqnos, opaque=7))
    r = read_frame(s)
    assert (r["word"], r["opaque"]) == (0, 7)
    pairs = dict(struct.iter_unpack(">HQ", r["value"]))
    assert len(pairs) == 64 and pairs[sluice.vbucket_of(b"seqnos-key", 64)] == 1  # default num_vbuckets
    s.sendall(frame(get_all_vb_seqnos, extras=struct.pack(">I", 2)))  # replica: none here
    r = read_frame(s)
    assert (r["word"], r["value"]) == (0, b"")
    for bad in (struct.pack(">I", 99), b"\x00\x01"):
        s.sendall(frame(get_all_vb_seqnos, extras=bad))
        assert read_frame(s)["word"] == EINVAL
    s.close()
