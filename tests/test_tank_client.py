"""The Python TANK client (`sluice.tank`) and `sluice tail --topic` against `sluice serve`:
produce with and without keys, Snappy and plain, one and many messages a bundle; consume from
the first, from inside a bundle and from the tail with long-poll; min-bytes; fetch sizes
smaller than a bundle; ProduceWithSeqnum, sparse bundles among them; retention and the
boundary-check answer."""

from __future__ import annotations

import gc
import json
import pickle
import struct
import threading
import time

import pytest
from helpers import Node, run_cli
from sluice.tank import TAIL, Message, OutOfRange, TankConnection, TankError


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path / "data")
    yield n
    n.stop()


def test_produced_messages_are_consumed_with_their_numbers_keys_and_stamps(node):
    with TankConnection(node.tank) as tank:
        tank.create_topic("events", 2)
        tank.produce("events", [b"one"], ts_ms=1_000)
        tank.produce("events", [(b"k1", b"two"), b"three", (b"k2", b"four")], ts_ms=2_000)
        many = [(f"key-{i}".encode(), f"value-{i}".encode() * 20) for i in range(500)]
        tank.produce("events", many, snappy=True, ts_ms=3_000)
        tank.produce("events", [b"elsewhere"], partition=1)

        got = tank.consume("events", seq=0)
        assert got.high_water_mark == 504
        first = [(m.seq, m.ts, m.key, m.content) for m in got.messages[:4]]
        assert first == [
            (1, 1_000, None, b"one"),
            (2, 2_000, b"k1", b"two"),
            (3, 2_000, None, b"three"),
            (4, 2_000, b"k2", b"four"),
        ]
        # Messages are the client's NamedTuple, made natively and left out of the cyclic
        # collector (which otherwise took most of a large consume's time walking them).
        m = got.messages[1]
        assert type(m) is Message and m == Message(2, 2_000, b"k1", b"two") == (2, 2_000, b"k1", b"two")
        assert m._asdict() == {"seq": 2, "ts": 2_000, "key": b"k1", "content": b"two"}
        assert pickle.loads(pickle.dumps(m)) == m and not gc.is_tracked(m)
        messages, seq = list(got.messages), got.next_seq
        while seq <= 504:
            more = tank.consume("events", seq=seq)
            messages += more.messages
            seq = more.next_seq
        assert [m.seq for m in messages] == list(range(1, 505))
        assert [(m.key, m.content) for m in messages[4:]] == many
        assert {m.ts for m in messages[4:]} == {3_000}

        # From inside a bundle: from that message on.
        middle = tank.consume("events", seq=3)
        assert [m.seq for m in middle.messages[:2]] == [3, 4]
        # A fetch size smaller than a bundle: the bundle is asked for again, whole.
        small = tank.consume("events", seq=100, fetch_size=16)
        assert small.messages[0].seq == 100 and small.messages[-1].seq == 504
        # The other partition numbers its own.
        other = tank.consume("events", partition=1, seq=0)
        assert [(m.seq, m.content) for m in other.messages] == [(1, b"elsewhere")]

        with pytest.raises(TankError, match="unknown"):
            tank.consume("nope")
        with pytest.raises(TankError, match="no partition 7"):
            tank.consume("events", partition=7)
        with pytest.raises(TankError, match="unknown"):
            tank.produce("nope", [b"x"])
        # TANK's broker's codes: 0x01 for a partition the topic lacks, 0x0a for a bad bundle.
        with pytest.raises(TankError, match="no such partition"):
            tank.produce("events", [b"x"], partition=7)
        with pytest.raises(OutOfRange) as out:
            tank.consume("events", seq=10_000)
        assert (out.value.first_available, out.value.high_water_mark) == (1, 504)

    # Pointed at a port that does not speak TANK (the iproto port greets with "Tarantool ..."):
    # an error saying so, not a frame length read from those bytes and allocated.
    with (
        TankConnection(node.iproto, timeout=5) as wrong,
        pytest.raises(TankError, match="not a TANK listener"),
    ):
        wrong.topics()

        # Any bytes-like content, and pairs as any two-item sequence; anything else is refused
        # before a frame is sent.
        tank.create_topic("shapes")
        tank.produce("shapes", [bytearray(b"ba"), memoryview(b"mv"), [b"k", b"pair"]], ts_ms=7)
        got = tank.consume("shapes", seq=0).messages
        assert got == [(1, 7, None, b"ba"), (2, 7, None, b"mv"), (3, 7, b"k", b"pair")]
        for bad, why in [
            (["text"], "bytes or a"),
            ([(b"k", b"v", b"x")], "bytes or a"),
            ([("k", b"v")], "key"),
        ]:
            with pytest.raises(TypeError, match=why):
                tank.produce("shapes", bad)
        with pytest.raises(TankError, match="one message or more"):
            tank.produce("shapes", [])
        assert tank.partitions("shapes") == [(1, 3)]

    # Per partition in /metrics and `sluice status`.
    def metric(name: str, partition: str) -> float:
        return node.metric(name, topic="events", partition=partition)

    assert metric("sluice_topic_high_water_mark", "0") == 504
    assert metric("sluice_topic_first_seq", "0") == 1
    assert metric("sluice_topic_produced_messages_total", "0") == 504
    assert metric("sluice_topic_produced_messages_total", "1") == 1
    assert metric("sluice_topic_consumed_bytes_total", "0") >= metric("sluice_topic_bytes", "0") > 0
    status = run_cli("status", "--admin", node.admin)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    at = lines.index("topic events: 2 partition(s), 0 consume(s) waiting")
    assert lines[at + 2].split()[:3] == ["0", "1", "504"]
    assert lines[at + 3].split()[:3] == ["1", "1", "1"]


def test_long_poll_waits_for_min_bytes_or_its_max_wait(node):
    with TankConnection(node.tank) as tank:
        tank.create_topic("feed")
        # Nothing at the tail: an empty answer once the wait is over.
        started = time.monotonic()
        empty = tank.consume("feed", seq=TAIL, max_wait=0.4)
        assert empty.messages == [] and empty.next_seq == 1
        assert time.monotonic() - started >= 0.35

        # Woken by a produce on another connection.
        def later() -> None:
            with TankConnection(node.tank) as producer:
                producer.produce("feed", [b"tailed"])

        def waiting() -> None:
            deadline = time.monotonic() + 20
            while node.metric("sluice_topic_long_polls", topic="feed") != 1:
                assert time.monotonic() < deadline, "the consume is not counted as waiting"
                time.sleep(0.05)
            later()

        threading.Thread(target=waiting).start()
        started = time.monotonic()
        got = tank.consume("feed", seq=TAIL, max_wait=30)
        assert [(m.seq, m.content) for m in got.messages] == [(1, b"tailed")]
        assert time.monotonic() - started < 10

        # min_bytes holds back a consume at the tail (as TANK's broker, which answers at once
        # whatever it has when not at the tail): a small bundle does not answer it ...
        def small() -> None:
            time.sleep(0.1)
            with TankConnection(node.tank) as producer:
                producer.produce("feed", [b"small"])

        threading.Thread(target=small).start()
        started = time.monotonic()
        got = tank.consume("feed", seq=2, max_wait=0.6, min_bytes=10_000)
        assert [m.content for m in got.messages] == [b"small"]
        assert time.monotonic() - started >= 0.55

        # ... until enough is produced.
        def bulk() -> None:
            time.sleep(0.2)
            with TankConnection(node.tank) as producer:
                producer.produce("feed", [b"x" * 20_000])

        threading.Thread(target=bulk).start()
        started = time.monotonic()
        got = tank.consume("feed", seq=3, max_wait=30, min_bytes=10_000)
        assert [m.seq for m in got.messages] == [3]
        assert time.monotonic() - started < 10


def sparse_bundle(seqs: list[int], content: bytes = b"m") -> bytes:
    """A plain sparse bundle numbering its messages `seqs`, as TANK's mirroring writes them."""
    b = bytes([0x40 | len(seqs) << 2]) + struct.pack("<Q", seqs[0])
    if len(seqs) > 1:
        b += bytes([seqs[-1] - seqs[0] - 1])
    for i, s in enumerate(seqs):
        b += b"\x00"
        if 0 < i < len(seqs) - 1:
            b += bytes([s - seqs[i - 1] - 1])
        b += struct.pack("<Q", 5) + bytes([len(content)]) + content
    return b


def test_produce_with_seqnum_places_bundles_and_sparse_ones_keep_their_numbers(tmp_path):
    node = Node(tmp_path / "data")
    try:
        tank = TankConnection(node.tank)
        tank.create_topic("mirror")
        tank.produce("mirror", [b"a", b"b"])
        tank.produce("mirror", [b"c", b"d"], seq=100)
        with pytest.raises(TankError, match="not valid"):
            tank.produce("mirror", [b"behind"], seq=50)
        # A sparse bundle as a mirroring tool sends it: ProduceWithSeqnum (0x5), its first
        # sequence number in the request and in its own header.
        bundle = sparse_bundle([110, 112, 115])
        body = struct.pack("<HI", 2, 77) + b"\x00" + b"\x01" + struct.pack("<I", 0) + b"\x01"
        body += b"\x06mirror\x01" + struct.pack("<H", 0) + bytes([len(bundle)])
        body += struct.pack("<Q", 110) + bundle
        tank._sock.sendall(b"\x05" + struct.pack("<I", len(body)) + body)
        assert tank._frame() == (0x01, struct.pack("<I", 77) + b"\x00")
        tank.produce("mirror", [b"after"])

        got = tank.consume("mirror", seq=0)
        numbers = [m.seq for m in got.messages]
        seq = got.next_seq
        while seq <= got.high_water_mark:
            more = tank.consume("mirror", seq=seq)
            numbers += [m.seq for m in more.messages]
            seq = more.next_seq
        assert numbers == [1, 2, 100, 101, 110, 112, 115, 116]
        # A chunk that starts with the sparse bundle is numbered by that bundle (errorOrFlags
        # 0xfe, no base sequence number), from a number it skips too.
        got = tank.consume("mirror", seq=111)
        assert [m.seq for m in got.messages] == [112, 115, 116]
        tank.close()
    finally:
        node.stop()
    node = Node(tmp_path / "data")
    try:
        with TankConnection(node.tank) as tank:
            assert [m.seq for m in tank.consume("mirror", seq=110).messages] == [110, 112, 115, 116]
    finally:
        node.stop()


def test_retention_drops_old_messages_and_a_consume_before_them_is_told_where_to_start(node):
    with TankConnection(node.tank) as tank:
        tank.create_topic("logs", 1, "log.segment.bytes=4096\nlog.retention.bytes=8192")
        for i in range(100):
            tank.produce("logs", [f"{i:0>200}".encode()])
        deadline = time.monotonic() + 30
        while tank.partitions("logs")[0][0] == 1:
            assert time.monotonic() < deadline, "retention never ran"
            time.sleep(0.1)
        first, hwm = tank.partitions("logs")[0]
        assert 1 < first <= hwm == 100
        with pytest.raises(OutOfRange) as out:
            tank.consume("logs", seq=1)
        assert (out.value.first_available, out.value.high_water_mark) == (first, 100)
        got = tank.consume("logs", seq=0)
        assert got.messages[0].seq == first


def test_sluice_tail_topic_prints_messages_and_resumes_from_its_state(node, tmp_path):
    with TankConnection(node.tank) as tank:
        tank.create_topic("events", 2)
        tank.produce("events", [b"a", (b"k", b"b")], partition=0)
        tank.produce("events", [b"c"], partition=1)
    state = tmp_path / "pos.json"
    args = ("tail", "--topic", "events", "--address", node.tank, "--from", "beginning", "--until-now")
    r = run_cli(*args, "--state", str(state))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert sorted((x["partition"], x["seq"], x.get("key"), x["content"]) for x in rows) == [
        (0, 1, None, "a"),
        (0, 2, "k", "b"),
        (1, 1, None, "c"),
    ]
    # Again from the state: only what came since.
    with TankConnection(node.tank) as tank:
        tank.produce("events", [b"d"], partition=1)
    r = run_cli(*args, "--state", str(state), "--format", "table")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["partition", "seq", "ts", "key", "content"]
    assert [line.split()[:2] + line.split()[3:] for line in lines[1:]] == [["1", "2", "-", "d"]]
    bad = run_cli("tail", "--topic", "events", "--address", node.tank, "--vbuckets", "1")
    assert bad.returncode == 2 and "--vbuckets are for buckets, not --topic" in bad.stderr
    unknown = run_cli("tail", "--topic", "nope", "--address", node.tank, "--until-now")
    assert unknown.returncode == 1 and "topic 'nope' is unknown" in unknown.stderr


def test_a_topic_streams_over_dcp_partition_by_partition(node):
    from sluice.client import Client

    with TankConnection(node.tank) as tank:
        tank.create_topic("events", 2)
        tank.produce("events", [b"one", (b"k", b"two")], ts_ms=1_000)
        tank.produce("events", [f"m{i}".encode() for i in range(300)], snappy=True, ts_ms=2_000)
        tank.produce("events", [b"p1"], partition=1, ts_ms=3_000)
        tank.produce("events", [b"placed"], seq=1000, ts_ms=4_000)

    client = Client(node.address)
    got = []
    with client.stream(topic="events", end="now", format="python") as stream:
        for batch in stream:
            got += batch
    by_partition = {p: [c for c in got if c.vbucket == p] for p in (0, 1)}
    zero = by_partition[0]
    assert [c.seqno for c in zero] == [*range(1, 303), 1000]
    assert all(c.op == "mutation" for c in got)
    # A message without a key carries its sequence number as its DCP key, flags 0.
    assert [(c.key, c.value, c.cas, c.flags) for c in zero[:2]] == [
        (b"1", b"one", 1_000_000_000, 0),
        (b"k", b"two", 1_000_000_000, 1),
    ]
    assert [c.value for c in zero[2:302]] == [f"m{i}".encode() for i in range(300)]
    assert (zero[-1].value, zero[-1].cas) == (b"placed", 4_000_000_000)
    assert [(c.seqno, c.value) for c in by_partition[1]] == [(1, b"p1")]

    # Following: once caught up, a later produce arrives.
    with client.stream([0], topic="events", format="python") as stream:
        seen = 0
        deadline = time.monotonic() + 20
        while seen < 1000:
            assert time.monotonic() < deadline, f"caught up only to {seen}"
            seen = max([seen, *(c.seqno for c in stream.poll(1) or [])])
        with TankConnection(node.tank) as tank:
            tank.produce("events", [b"later"])
        later = stream.poll(20)
    assert later is not None, "the produce never streamed"
    assert [(c.seqno, c.value) for c in later] == [(1001, b"later")]


def test_a_replica_copies_topics_and_serves_their_consumes(tmp_path):
    active = Node(tmp_path / "a")
    replica = None
    try:
        with TankConnection(active.tank) as tank:
            tank.create_topic("events", 2, "log.retention.bytes=100000000")
            tank.produce("events", [b"one", (b"k", b"two")], ts_ms=1_000)
            tank.produce("events", [f"m{i}".encode() for i in range(200)], snappy=True, ts_ms=2_000)
            tank.produce("events", [b"p1"], partition=1, ts_ms=3_000)
            tank.produce("events", [b"placed"], seq=500, ts_ms=4_000)
        replica = Node(tmp_path / "r", "--replica-of", active.address)

        def copied(want_hwm: int) -> list:
            deadline = time.monotonic() + 30
            with TankConnection(replica.tank) as r:
                while True:
                    topics = dict(r.topics())
                    if topics.get("events") == 2 and r.partitions("events")[0][1] >= want_hwm:
                        return read_all(r, "events", 0)
                    assert time.monotonic() < deadline, f"not copied: {topics}"
                    time.sleep(0.1)

        with TankConnection(active.tank) as a:
            want = read_all(a, "events", 0)
        assert [m.seq for m in want] == [*range(1, 203), 500]
        assert copied(500) == want
        with TankConnection(replica.tank) as r:
            assert [(m.seq, m.content) for m in r.consume("events", 1).messages] == [(1, b"p1")]
            # A replica's copy takes no produce: TANK's read-only answer.
            with pytest.raises(TankError, match="read-only"):
                r.produce("events", [b"here"])
        # What comes later on the active follows, in order and with its numbers.
        with TankConnection(active.tank) as a:
            a.produce("events", [(b"late", b"later")], ts_ms=5_000)
            want = read_all(a, "events", 0)
        assert copied(501) == want
        assert want[-1] == (501, 5_000, b"late", b"later")
        status = run_cli("status", "--admin", replica.admin)
        assert "topic events: 2 partition(s)" in status.stdout, status.stdout
        # The replica asks for new topics every second on one connection it keeps: the
        # active's log does not fill with a connection each time.
        time.sleep(3)
        assert active.log().count("'replication-topics:") == 1, active.log()[-3000:]
    finally:
        if replica:
            replica.stop()
        active.stop()


def read_all(tank: TankConnection, topic: str, partition: int) -> list:
    """Every message of a partition, from its first."""
    out, seq = [], 0
    while True:
        got = tank.consume(topic, partition, seq)
        out += got.messages
        if got.next_seq > got.high_water_mark:
            return out
        seq = got.next_seq


def test_a_topic_whose_oldest_segments_retention_dropped_streams_and_copies_from_its_first(tmp_path):
    """Retention deletes a partition's oldest segment files; a DCP stream of the topic from
    the beginning, and a replica copying it, start at the first message kept, and a restart
    keeps the same first message."""
    from sluice.client import Client

    active = Node(tmp_path / "a")
    replica = None
    try:
        with TankConnection(active.tank) as t:
            t.create_topic("short", 1, "log.segment.bytes=8192\nlog.retention.bytes=20000")
            for i in range(100):
                t.produce("short", [b"m%03d" % i + b"x" * 500])
            deadline = time.monotonic() + 20
            while t.partitions("short")[0][0] == 1:
                assert time.monotonic() < deadline, "retention never ran"
                time.sleep(0.2)
            first, last = t.partitions("short")[0]
        segments = sorted((tmp_path / "a" / "topics").rglob("*.log"))
        assert segments[0].name == f"{first:020}.log", segments
        with Client(active.address) as c, c.stream(topic="short", end="now", format="python") as s:
            seqnos = [ch.seqno for batch in s for ch in batch]
        assert seqnos == list(range(first, last + 1))
        replica = Node(tmp_path / "r", "--replica-of", active.address)
        deadline = time.monotonic() + 30
        with TankConnection(replica.tank) as r:
            while not (dict(r.topics()).get("short") and r.partitions("short")[0][1] == last):
                assert time.monotonic() < deadline, "not copied"
                time.sleep(0.1)
            assert [m.seq for m in read_all(r, "short", 0)] == list(range(first, last + 1))
        assert active.stop() == 0
        active = Node(tmp_path / "a")
        with TankConnection(active.tank) as t:
            assert t.partitions("short")[0] == (first, last)
    finally:
        if replica:
            replica.stop()
        active.stop()
