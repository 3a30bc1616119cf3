"""TANK's protocol on sluice (`tank_listen`): the requests recorded from TANK's own tank-cli
and a hand-built client (rust/sluice-proto/tests/data/tank_frames.txt) are replayed against
`sluice serve`, and the answers are the broker's bytes wherever sluice holds what the broker
held; a consume at the tail waits for a produce or its max wait; every acknowledged message is
read back after kill -9."""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path

import pytest
from helpers import NO_DEFAULT_PORTS, Node, run_cli

FRAMES = Path(__file__).resolve().parent.parent / "rust/sluice-proto/tests/data/tank_frames.txt"


def recorded() -> dict[str, list[tuple[bool, bytes]]]:
    """Per connection, its frames in order: (sent by the client, bytes)."""
    conns: dict[str, list[tuple[bool, bytes]]] = {}
    for line in FRAMES.read_text().splitlines():
        if line.startswith("#") or not line:
            continue
        conn, direction, hexed = line.split(" ")
        conns.setdefault(conn, []).append((direction == "C>S", bytes.fromhex(hexed)))
    return conns


class Tank:
    """A raw TANK connection: frames out, frames in."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.buf = b""

    def send(self, frame: bytes) -> None:
        self.sock.sendall(frame)

    def frame(self, timeout: float = 10) -> bytes:
        self.sock.settimeout(timeout)
        while True:
            if len(self.buf) >= 5:
                n = 5 + struct.unpack_from("<I", self.buf, 1)[0]
                if len(self.buf) >= n:
                    f, self.buf = self.buf[:n], self.buf[n:]
                    return f
            chunk = self.sock.recv(1 << 16)
            assert chunk, "the broker closed the connection"
            self.buf += chunk

    def close(self) -> None:
        self.sock.close()


def replay(node: Node, frames: list[tuple[bool, bytes]]) -> list[bytes]:
    """Sends a recorded connection's client frames; returns as many answers as it recorded."""
    t = Tank(node.tank)
    try:
        for from_client, f in frames:
            if from_client:
                t.send(f)
        return [t.frame() for from_client, _ in frames if not from_client]
    finally:
        t.close()


def produce_frame(req_id: int, topic: bytes, contents: list[bytes], ts: int = 1_700_000_000_000) -> bytes:
    """A version-2 Produce of one plain bundle to partition 0."""
    bundle = bytes([len(contents) << 2]) if len(contents) <= 15 else b"\x00" + bytes([len(contents)])
    for i, c in enumerate(contents):
        bundle += (b"\x00" + struct.pack("<Q", ts)) if i == 0 else b"\x02"
        bundle += bytes([len(c)]) + c
    body = struct.pack("<HI", 2, req_id) + b"\x00" + b"\x00" + struct.pack("<I", 0) + b"\x01"
    body += bytes([len(topic)]) + topic + b"\x01" + struct.pack("<H", 0) + bytes([len(bundle)]) + bundle
    return b"\x01" + struct.pack("<I", len(body)) + body


def consume_frame(req_id: int, topic: bytes, seq: int, max_wait_ms: int = 0, fetch: int = 1 << 20) -> bytes:
    body = struct.pack("<HI", 2, req_id) + b"\x00" + struct.pack("<QI", max_wait_ms, 0) + b"\x01"
    body += bytes([len(topic)]) + topic + b"\x01" + struct.pack("<HQI", 0, seq, fetch)
    return b"\x02" + struct.pack("<I", len(body)) + body


def messages_of(answer: bytes) -> tuple[int, int, list[bytes]]:
    """A one-partition consume answer of plain bundles: (base seq, high-water mark, contents)."""
    header_len = struct.unpack_from("<I", answer, 5)[0]
    h = answer[9 : 9 + header_len]
    at = 4 + 1
    at += 1 + h[at]  # topic name
    at += 1 + 2  # partition count, partition id
    flags = h[at]
    assert flags == 0, f"errorOrFlags {flags:#x}"
    base, hwm, chunk_len = struct.unpack_from("<QQI", h, at + 1)
    chunk = answer[9 + header_len :]
    assert len(chunk) == chunk_len
    out, i = [], 0
    while i < len(chunk):
        n = chunk[i]  # bundles here are under 128 bytes: a one-byte varint
        b, i = chunk[i + 1 : i + 1 + n], i + 1 + n
        count, j = b[0] >> 2, 1
        for _ in range(count):
            mflags = b[j]
            j += 1 if mflags & 2 else 9
            if mflags & 1:
                j += 1 + b[j]
            size = b[j]
            out.append(b[j + 1 : j + 1 + size])
            j += 1 + size
    return base, hwm, out


def test_recorded_sessions_get_the_brokers_answers(tmp_path):
    conns = recorded()
    node = Node(tmp_path / "data")
    try:
        # Create the topic, produce a plain and a keyed message, consume: byte for byte.
        for c in ("conn1", "conn2", "conn3", "conn4", "conn12", "conn9", "conn10", "conn11", "conn13"):
            got = replay(node, conns[c])
            want = [f for from_client, f in conns[c] if not from_client]
            assert got == want, f"{c}: {[g.hex() for g in got]} != {[w.hex() for w in want]}"
        # tank-cli's benchmark producer: one request naming the partition three times, then
        # four pipelined requests; an error byte per entry.
        for c in ("conn15", "conn16"):
            got = replay(node, conns[c])
            assert got == [f for from_client, f in conns[c] if not from_client], c
        # What differs from the broker's recording is what it held: the recording had a
        # message produced outside it and other topics.
        (ping, parts) = replay(node, conns["conn6"])
        assert ping == b"\x03\x00\x00\x00\x00"
        first, hwm = struct.unpack_from("<QQ", parts, 5 + 4 + 5 + 2)
        assert first == 1 and hwm > 20
        (_, topics) = replay(node, conns["conn7"])
        assert topics[5:] == struct.pack("<II", 1, 1) + b"\x00\x04wire\x01\x01\x00"
        (_, status) = replay(node, conns["conn8"])
        assert struct.unpack_from("<IBBIII", status, 5)[3:] == (1, 1, 1)
        # From the middle of a bundle: from its first message; past the end: the boundary.
        t = Tank(node.tank)
        assert t.frame() == b"\x03\x00\x00\x00\x00"
        t.send(consume_frame(7, b"wire", 4, fetch=1))
        base, _, got = messages_of(t.frame())
        assert (base, got) == (3, [b"m1", b"m2", b"m3"])
        t.send(consume_frame(8, b"wire", 999_999))
        answer = t.frame()
        assert answer[5 + 4 + 4 + 1 + 5 + 1 + 2] == 0x01  # boundary check
        assert struct.unpack_from("<Q", answer, len(answer) - 8)[0] == 1  # first available
        t.close()
    finally:
        node.stop()


def test_a_consume_at_the_tail_waits_for_a_produce_or_its_max_wait(tmp_path):
    node = Node(tmp_path / "data")
    try:
        replay(node, recorded()["conn1"])  # creates topic "wire"
        t = Tank(node.tank)
        t.frame()
        started = time.monotonic()
        t.send(consume_frame(1, b"wire", 1, max_wait_ms=400))
        base, hwm, got = messages_of(t.frame())
        assert got == [] and hwm == 0 and time.monotonic() - started >= 0.35
        # The tail (u64::MAX) with a long wait, woken by a produce on another connection.
        t.send(consume_frame(2, b"wire", 2**64 - 1, max_wait_ms=30_000))
        producer = Tank(node.tank)
        producer.frame()
        threading.Timer(0.3, lambda: producer.send(produce_frame(9, b"wire", [b"tailed"]))).start()
        started = time.monotonic()
        base, hwm, got = messages_of(t.frame(timeout=20))
        assert (base, hwm, got) == (1, 1, [b"tailed"])
        assert time.monotonic() - started < 10
        assert producer.frame() == b"\x01\x05\x00\x00\x00" + struct.pack("<I", 9) + b"\x00"
        producer.close()
        # On the connection that tails, as tank-cli's p2c does: the produce is not held up by
        # the consume waiting before it, and wakes it.
        t.send(consume_frame(3, b"wire", 2**64 - 1, max_wait_ms=30_000))
        time.sleep(0.2)
        t.send(produce_frame(4, b"wire", [b"same connection"]))
        answers = {f[0]: f for f in (t.frame(timeout=20), t.frame(timeout=20))}
        assert answers[0x01][-1] == 0  # the produce's error byte
        assert messages_of(answers[0x02])[2] == [b"same connection"]
        t.close()
        assert node.metric("sluice_tank_produced_messages_total") == 2
        assert node.metric("sluice_tank_long_polls") == 0
    finally:
        node.stop()


def test_acknowledged_messages_survive_kill9(tmp_path):
    node = Node(tmp_path / "data")
    replay(node, recorded()["conn1"])
    t = Tank(node.tank)
    t.frame()
    sent = []
    for i in range(200):
        batch = [f"m{i}-{j}".encode() for j in range(1 + i % 5)]
        t.send(produce_frame(i, b"wire", batch))
        ack = t.frame()
        assert ack[-1] == 0, ack.hex()
        sent += batch
    t.close()
    node.stop(sig=9)
    node = Node(tmp_path / "data")
    try:
        t = Tank(node.tank)
        t.frame()
        got, seq = [], 0
        while True:
            t.send(consume_frame(1, b"wire", seq, fetch=4096))
            base, hwm, msgs = messages_of(t.frame())
            if not msgs:
                break
            skip = max(0, seq - base) if seq else 0
            got += msgs[skip:]
            seq = base + len(msgs)
        assert got == sent
        t.close()
    finally:
        node.stop()


def test_topics_declared_in_the_config_are_created_at_start(tmp_path):
    config = tmp_path / "sluice.toml"
    config.write_text('[topics.events]\npartitions = 3\nsettings = "log.retention.bytes = 100000"\n')
    node = Node(tmp_path / "data", "--config", str(config))
    try:
        t = Tank(node.tank)
        t.frame()
        t.send(b"\x06" + struct.pack("<I", 11) + struct.pack("<I", 1) + b"\x06events")
        answer = t.frame()
        assert struct.unpack_from("<H", answer, 5 + 4 + 7)[0] == 3  # partitions
        t.close()
    finally:
        node.stop()
    # A restart keeps the topic as it was created.
    node = Node(tmp_path / "data", "--config", str(config))
    node.stop()
    bad = tmp_path / "bad.toml"
    bad.write_text('[topics.logs]\nsettings = "log.retention.fortnights = 2"\n')
    r = run_cli("serve", "--config", str(bad), "--data-dir", str(tmp_path / "d2"), *NO_DEFAULT_PORTS)
    assert r.returncode == 2, r.stderr
    assert "topics.logs.settings: log.retention.fortnights: not a topic setting" in r.stderr


def test_sluice_topic_creates_and_lists_topics(tmp_path):
    node = Node(tmp_path / "data")
    try:
        r = run_cli("topic", "create", "events", "--partitions", "2", "--address", node.tank)
        assert r.returncode == 0 and "created topic events with 2 partition(s)" in r.stdout, r.stderr
        again = run_cli("topic", "create", "events", "--address", node.tank)
        assert again.returncode == 1 and "the topic exists" in again.stderr
        bad = run_cli("topic", "create", "x", "--settings", "log.nope=1", "--address", node.tank)
        # Checked before it is sent: the broker's answer would say only "not valid".
        assert bad.returncode == 2 and "log.nope: not a topic setting" in bad.stderr, bad.stderr
        t = Tank(node.tank)
        t.frame()
        t.send(produce_frame(1, b"events", [b"a", b"b", b"c"]))
        assert t.frame()[-1] == 0
        t.close()
        listed = run_cli("topic", "list", "--address", node.tank)
        assert listed.returncode == 0, listed.stderr
        lines = [line.split() for line in listed.stdout.splitlines()]
        # An empty partition reads 0 and 0, as TANK's broker answers.
        assert lines[1:] == [["events", "0", "1", "3"], ["events", "1", "0", "0"]], listed.stdout
    finally:
        node.stop()
    down = run_cli("topic", "list", "--address", node.tank)
    assert down.returncode == 1, down.stderr
    assert f"nothing listens at {node.tank} (connection refused); expected a TANK listener" in down.stderr


def _rss_file_mib(node: Node) -> int:
    for line in Path(f"/proc/{node.proc.pid}/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) >> 10
    return 0


@pytest.mark.parametrize("wal_mode", ["write", "fsync"])
def test_a_topic_lives_in_its_segment_files_and_a_restart_reads_only_their_tails(tmp_path, wal_mode):
    """A partition's messages are its segment files (topics/<id>/<partition>/*.log): the WAL
    only points at them. After kill -9 (in fsync mode, each WAL sync syncs the segment files
    first), a restart opens the files and reads each one's index and tail, not the 64 MiB they
    retain; every message reads back."""
    from sluice.tank import TankConnection

    data = tmp_path / "d"
    cfg = tmp_path / "n.toml"
    cfg.write_text(f'[wal]\nmode = "{wal_mode}"\n')
    args = ("--config", str(cfg), *NO_DEFAULT_PORTS[:4], "--tank-listen", "127.0.0.1:0")
    node = Node(data, *args)
    msg = bytes(range(256)) * 4
    with TankConnection(node.tank) as t:
        t.create_topic("big", 1, "log.segment.bytes=8388608")
        for _ in range(640):
            t.produce("big", [msg] * 100)
    files = sorted((data / "topics").rglob("*.log"))
    assert len(files) >= 7 and sum(f.stat().st_size for f in files) > 60 << 20
    wal = sum(f.stat().st_size for f in (data / "wal").glob("*.xlog*"))
    assert wal < 8 << 20, f"the WAL holds {wal} bytes: the bundles went into it"
    node.proc.kill()
    node.proc.wait()
    node = Node(data, *args)
    try:
        assert _rss_file_mib(node) < 32, "the restart read the retained bytes"
        with TankConnection(node.tank) as t:
            assert t.partitions("big") == [(1, 64_000)]
            seq, n = 0, 0
            while True:
                f = t.consume("big", 0, seq, fetch_size=4 << 20)
                assert all(m.content == msg for m in f.messages)
                n += len(f.messages)
                if f.next_seq > f.high_water_mark:
                    break
                seq = f.next_seq
            assert n == 64_000
            t.produce("big", [b"after"])
            assert t.consume("big", 0, 64_001).messages[0].content == b"after"
    finally:
        assert node.stop() == 0, node.log()[-3000:]
