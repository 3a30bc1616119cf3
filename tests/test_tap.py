"""TAP streams from real `sluice serve` processes over 127.0.0.1: seed 000's examples byte for
byte, ACKs, temporary failures, named sessions reconnecting within and after their grace,
keys-only, takeover, and the hop count (TTL) stopping a loop between two nodes that tap each
other. Writes go through python-binary-memcached."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from pathlib import Path

import bmemcached
import pytest
import sluice
from helpers import Node
from mcbp_wire import read_response, request, set_extras
from tap_wire import (
    BACKFILL,
    CLOSE_BACKFILL,
    CLOSE_TAP_STREAM,
    DELETE,
    DUMP,
    ETMPFAIL,
    FLAG_NO_VALUE,
    INITIAL_VBUCKET_STREAM,
    KEYS_ONLY,
    LIST_VBUCKETS,
    MUTATION,
    OPAQUE,
    SUPPORT_ACK,
    TAKEOVER_VBUCKETS,
    VBUCKET_SET,
    TapClient,
    ack,
    as_command,
    vbucket_list,
)

NUM_VBUCKETS = 8


def start(
    tmp_path: Path, name: str, tap: dict | None = None, extra: str = "", env: dict | None = None
) -> Node:
    lines = ["[snapshot]", "interval = 0", "[buckets.default]", f"num_vbuckets = {NUM_VBUCKETS}", "[tap]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in (tap or {}).items()]
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text("\n".join(lines) + "\n" + extra)
    return Node(tmp_path / name, "--config", str(cfg), env=env)


def client(node: Node) -> bmemcached.Client:
    return bmemcached.Client([node.address])


def docs(messages: list) -> list:
    return [m for m in messages if m.opcode in (MUTATION, DELETE)]


SEED_PLAIN = bytes(
    [0x80, 0x40, 0x00, 0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x05] + [0x00] * 12 + list(b"node1")
)
# The BACKFILL example as its field table gives it (extras length 8, body 0x15): the dump's
# header bytes say extras 0 and body 0x0c, which do not add up with the 21 bytes that follow.
SEED_BACKFILL_FUTURE = (
    bytes([0x80, 0x40, 0x00, 0x05, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x15] + [0x00] * 12)
    + bytes([0, 0, 0, 0, 0, 0, 0, 1])
    + b"node1"
    + bytes([0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF])
)
SEED_DUMP = (
    bytes([0x80, 0x40, 0x00, 0x05, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x0D] + [0x00] * 12)
    + bytes([0, 0, 0, 0, 0, 0, 0, 2])
    + b"node1"
)
SEED_LIST_1_2_5 = (
    bytes([0x80, 0x40, 0x00, 0x05, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x15] + [0x00] * 12)
    + bytes([0, 0, 0, 0, 0, 0, 0, 4])
    + b"node1"
    + bytes([0x00, 0x03, 0x00, 0x01, 0x00, 0x02, 0x00, 0x05])
)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    n = start(tmp_path_factory.mktemp("tap"), "a")
    yield n
    n.stop()


def test_seed_examples_byte_for_byte(node: Node) -> None:
    mc = client(node)
    existing = {f"old-{i}".encode(): f"v{i}".encode() for i in range(40)}
    for k, v in existing.items():
        mc.set(k.decode(), v)
    addr = (node.host, node.port)

    # Each example names itself "node1": a connection under a name in use replaces the older
    # one, so they run one after another.
    # Plain "node1" and BACKFILL of -1 (a time in the future): new changes only.
    for raw in (SEED_PLAIN, SEED_BACKFILL_FUTURE):
        c = TapClient(addr, b"", raw=raw)
        time.sleep(0.3)
        new = {f"new-{i}-{len(raw)}".encode(): f"n{i}".encode() for i in range(60)}
        for k, v in new.items():
            mc.set(k.decode(), v)
        got = {m.key: m.value for m in docs(c.mutations_until(len(new)))}
        assert got == new, "only the changes made after connecting, every one of them"
        assert c.silent_for(0.3)
        c.close()
        existing.update(new)

    listed = TapClient(addr, b"", raw=SEED_LIST_1_2_5)
    time.sleep(0.3)
    new = {f"listed-{i}".encode(): f"n{i}".encode() for i in range(60)}
    for k, v in new.items():
        mc.set(k.decode(), v)
    in_listed = {k: v for k, v in new.items() if sluice._native.vbucket_of(k, NUM_VBUCKETS) in (1, 2, 5)}
    assert 0 < len(in_listed) < len(new)
    got = docs(listed.mutations_until(len(in_listed)))
    assert {m.key: m.value for m in got} == in_listed
    assert {m.vbucket for m in got} <= {1, 2, 5}
    assert listed.silent_for(0.3), "nothing from vbuckets outside the list"
    listed.close()
    existing.update(new)

    # DUMP: the existing items, then the stream says so and the connection closes.
    dump = TapClient(addr, b"", raw=SEED_DUMP)
    seen, closing = {}, None
    while True:
        try:
            m = dump.next(timeout=10)
        except ConnectionError:
            break
        if m.opcode == MUTATION:
            seen[m.key] = m.value
        elif m.opcode == OPAQUE and m.code == CLOSE_TAP_STREAM:
            closing = m
    assert seen == existing
    assert closing is not None
    dump.close()


def test_backfill_since_a_time_and_checkpoints_of_a_whole_stream(node: Node) -> None:
    mc = client(node)
    mc.set("before-cutoff", b"x")
    time.sleep(1.2)
    cutoff = int(time.time())
    time.sleep(1.1)
    after = {f"since-{i}".encode(): b"y" for i in range(20)}
    for k, v in after.items():
        mc.set(k.decode(), v)
    c = TapClient((node.host, node.port), b"", BACKFILL | DUMP, struct.pack(">Q", cutoff))
    msgs = []
    try:
        while True:
            msgs.append(c.next())
    except ConnectionError:
        pass
    got = {m.key for m in docs(msgs)}
    assert after.keys() <= got
    assert b"before-cutoff" not in got, "changed before the BACKFILL time"
    opaque_codes = [(m.vbucket, m.code) for m in msgs if m.opcode == OPAQUE]
    starts = {vb for vb, code in opaque_codes if code == INITIAL_VBUCKET_STREAM}
    ends = {vb for vb, code in opaque_codes if code == CLOSE_BACKFILL}
    assert starts and starts == ends, "every backfill is opened and closed with TAP_OPAQUE"


def test_bad_connects_get_einval_and_the_connection_serves_on(node: Node) -> None:
    s = socket.create_connection((node.host, node.port), timeout=10)
    # LIST_VBUCKETS naming 1000 vbuckets in 4 bytes: refused before anything is allocated.
    from tap_wire import connect_frame

    for bad in (
        connect_frame(b"x", LIST_VBUCKETS, struct.pack(">HH", 1000, 1)),
        connect_frame(b"x", 0x100),
        connect_frame(b"x", BACKFILL, b"\x00"),
        connect_frame(b"x", TAKEOVER_VBUCKETS),
    ):
        s.sendall(bad)
        r = read_response(s)
        assert r["status"] == 0x04, r
    s.sendall(request(0x0B))  # VERSION: still a working connection
    assert read_response(s)["status"] == 0


def test_keys_only_carries_no_values(node: Node) -> None:
    c = TapClient((node.host, node.port), b"", KEYS_ONLY)
    time.sleep(0.2)
    mc = client(node)
    for i in range(30):
        mc.set(f"ko-{i}", b"secret-value" * 10)
    got = docs(c.mutations_until(30))
    assert {m.key for m in got} == {f"ko-{i}".encode() for i in range(30)}
    assert all(m.value == b"" and m.tap_flags & FLAG_NO_VALUE for m in got)
    c.close()


def _write_keys(node: Node, prefix: str, n: int) -> dict[bytes, bytes]:
    mc = client(node)
    out = {}
    for i in range(n):
        k, v = f"{prefix}-{i:05d}", f"value-{i}".encode()
        mc.set(k, v)
        out[k.encode()] = v
    return out


def test_a_reconnect_within_the_grace_gets_every_unacked_message_again(tmp_path: Path) -> None:
    n = start(tmp_path, "grace", {"ack_interval": 10, "ack_window": 50, "grace_period": "1s"})
    try:
        written = _write_keys(n, "g", 300)
        flags = BACKFILL | SUPPORT_ACK
        body = struct.pack(">Q", 0)
        addr = (n.host, n.port)
        c = TapClient(addr, b"resumer", flags, body)
        acked: dict[bytes, bytes] = {}
        unacked_seen: dict[bytes, bytes] = {}
        # Read until the window stops the stream; acknowledge only the first ACK request.
        first_ack_done = False
        while True:
            try:
                m = c.next(timeout=1.0)
            except TimeoutError:
                break
            if m.opcode == MUTATION:
                unacked_seen[m.key] = m.value
            if m.wants_ack and not first_ack_done:
                ack(c.sock, m)
                first_ack_done = True
                acked.update(unacked_seen)
                unacked_seen.clear()
        assert first_ack_done and unacked_seen, "the window paused the stream with messages unacked"
        assert len(acked) + len(unacked_seen) < len(written), "the stream paused at the window"
        # The consumer dies with those messages unacked and comes back under its name.
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()
        c = TapClient(addr, b"resumer", flags, body)
        got: dict[bytes, bytes] = {}
        msgs = c.mutations_until(len(written) - len(acked))
        got = {m.key: m.value for m in docs(msgs)}
        assert unacked_seen.items() <= got.items(), "every unacked message came again"
        assert {**acked, **got} == written, "nothing lost"
        assert not (acked.keys() & got.keys()), "acknowledged messages were not sent again"
        assert not any(m.opcode == OPAQUE and m.code == INITIAL_VBUCKET_STREAM for m in msgs[:5]), (
            "the session resumed, it did not start over"
        )
        assert n.metric("sluice_tap_sessions_resumed_total") == 1
        assert n.metric("sluice_tap_resent_total") >= len(unacked_seen)

        # Past the grace period the session is gone: the same client starts over (a full
        # BACKFILL from 0 again, every item).
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()
        time.sleep(2.0)
        assert n.metric("sluice_tap_sessions_expired_total") == 1
        c = TapClient(addr, b"resumer", flags, body)
        again = {m.key: m.value for m in docs(c.mutations_until(len(written)))}
        assert again == written
        c.close()
    finally:
        n.stop()


def test_a_temporary_failure_sends_the_message_again_after_the_back_off(tmp_path: Path) -> None:
    n = start(tmp_path, "tmpfail", {"ack_interval": 5, "backoff": "300ms"})
    try:
        c = TapClient((n.host, n.port), b"", SUPPORT_ACK)
        time.sleep(0.2)
        _write_keys(n, "t", 5)
        msgs = c.take(5, auto_ack=False)
        last = msgs[-1]
        assert last.wants_ack
        ack(c.sock, last, ETMPFAIL)
        started = time.monotonic()
        again = c.next(timeout=5)
        assert time.monotonic() - started >= 0.25, "sent again only after the back-off"
        assert (again.key, again.value) == (last.key, last.value)
        assert again.opaque != last.opaque and again.wants_ack
        ack(c.sock, again)
        assert n.metric("sluice_tap_temp_failures_total") == 1
        c.close()
    finally:
        n.stop()


def test_takeover_hands_the_vbucket_to_the_tap_client(node: Node) -> None:
    vb = 3
    keys = [
        k
        for k in (f"to-{i}".encode() for i in range(400))
        if sluice._native.vbucket_of(k, NUM_VBUCKETS) == vb
    ][:20]
    mc = client(node)
    for k in keys:
        mc.set(k.decode(), b"v")
    c = TapClient(
        (node.host, node.port),
        b"taker",
        BACKFILL | LIST_VBUCKETS | TAKEOVER_VBUCKETS | SUPPORT_ACK,
        struct.pack(">Q", 0) + vbucket_list(vb),
    )
    states, got = [], set()
    while True:
        try:
            m = c.next(timeout=10)
        except ConnectionError:
            break
        if m.wants_ack:
            ack(c.sock, m)
        if m.opcode == MUTATION:
            got.add(m.key)
        if m.opcode == VBUCKET_SET:
            states.append(m.code)
    assert set(keys) <= got
    assert states == [3, 1], "pending, then active"
    s = socket.create_connection((node.host, node.port), timeout=10)
    s.sendall(request(0x01, key=keys[0], value=b"late", extras=set_extras(), vbucket=vb))
    assert read_response(s)["status"] == 0x07, "the vbucket is not this node's any more"


def test_hops_stop_a_loop_between_two_nodes_that_tap_each_other(tmp_path: Path) -> None:
    ttl = 3
    a = start(tmp_path, "loop-a", {"ttl": ttl})
    b = start(tmp_path, "loop-b", {"ttl": ttl})
    forwarded: list[tuple[str, bytes, int]] = []
    stop = threading.Event()

    def relay(src: Node, dst: Node, label: str) -> None:
        tap = TapClient((src.host, src.port), b"")
        out = socket.create_connection((dst.host, dst.port), timeout=10)
        tap.sock.settimeout(0.2)
        while not stop.is_set():
            try:
                m = tap.next(timeout=0.2)
            except TimeoutError:
                continue
            if m.opcode == MUTATION:
                forwarded.append((label, m.key, m.ttl))
                out.sendall(as_command(m))
        tap.close()
        out.close()

    threads = [
        threading.Thread(target=relay, args=(a, b, "a->b")),
        threading.Thread(target=relay, args=(b, a, "b->a")),
    ]
    try:
        for t in threads:
            t.start()
        time.sleep(0.3)
        client(a).set("ping", b"pong")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(forwarded) < ttl:
            time.sleep(0.05)
        time.sleep(1.0)  # any further bounce would show by now
        hops = [(label, t) for label, k, t in forwarded if k == b"ping"]
        assert hops == [("a->b", 3), ("b->a", 2), ("a->b", 1)], hops
        assert client(a).get("ping") == b"pong" and client(b).get("ping") == b"pong"
        assert b.metric("sluice_tap_out_of_hops_total") == 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        a.stop()
        b.stop()
