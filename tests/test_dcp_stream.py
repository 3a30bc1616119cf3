"""DCP streams end to end: order and consistency with 64 vbuckets and writers running, resume
from saved state at random points, rollbacks, replica vbuckets, cursor dropping and memory,
through the native consumer (`sluice.Client`) and the hand-written one (dcp_wire.py)."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import bmemcached
import pyarrow as pa
import pytest
import sluice
from dcp_wire import DELETION, MUTATION, SNAPSHOT_MARKER, STREAM_END, DcpConnection, stream_req
from helpers import Node, admin_get

WRITES_PER_WRITER = 3000
KEYSPACE = 400


class Served:
    """An embedded engine served on a free port: tests see every write's seqno."""

    def __init__(self, data_dir: Path, buckets: dict | None = None) -> None:
        cfg = sluice.Config.from_dict(
            {
                "data_dir": str(data_dir),
                "snapshot": {"interval": 0},
                "checkpoint": {"max_items": 200},
                "buckets": buckets or {"default": {}},
            }
        )
        self.engine = sluice.open_engine(cfg)
        settings = json.dumps({"listeners": {"listen": "127.0.0.1:0"}, "admin_listen": "127.0.0.1:0"})
        self.server = sluice._native.Server(self.engine, settings)
        self.address = self.server.address
        self.host, port = self.address.rsplit(":", 1)
        self.port = int(port)

    def metrics(self) -> str:
        return admin_get(self.server.admin_address, "/metrics")

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path / "data")
    yield s
    s.close()


def write_load(engine, seed: int, history: dict, lock: threading.Lock, pause: float = 0.0) -> None:
    """Sets, overwrites and deletes over a small keyspace; records (vbucket, seqno) -> key."""
    rng = random.Random(seed)
    for i in range(WRITES_PER_WRITER):
        if pause and i % 50 == 0:
            time.sleep(pause)
        key = f"key{rng.randrange(KEYSPACE)}".encode()
        try:
            if rng.random() < 0.15:
                m = engine.delete(key)
            else:
                m = engine.set(key, f"{seed}:{i}".encode() * rng.randint(1, 4))
        except sluice.NotFoundError:
            continue
        with lock:
            history[(m.vbucket, m.seqno)] = key


def bucket_contents(engine) -> dict[bytes, bytes]:
    out = {}
    for i in range(KEYSPACE):
        it = engine.get(f"key{i}".encode())
        if it is not None:
            out[it.key] = it.value
    return out


def check_history(docs_by_vb: dict, snapshots_by_vb: dict, history: dict) -> None:
    """Per vbucket: seqnos strictly increasing; each document inside its snapshot marker's range;
    a key at most once per snapshot; a seqno missing from the stream only when the same key
    changed again later inside the same snapshot (dedup stays inside a snapshot)."""
    for vb, docs in docs_by_vb.items():
        seqnos = [d["seqno"] for d in docs]
        assert seqnos == sorted(set(seqnos)), f"vbucket {vb}: seqnos not strictly increasing"
        seen = set(seqnos)
        for snap in snapshots_by_vb[vb]:
            inside = [d for d in docs if snap["start"] <= d["seqno"] <= snap["end"]]
            assert all(d["snapshot"] is snap for d in inside)
            keys = [d["key"] for d in inside]
            assert len(keys) == len(set(keys)), f"vbucket {vb}: a key twice in one snapshot"
        for (hvb, s), key in history.items():
            if hvb != vb or s in seen or s > max(seqnos, default=0):
                continue
            snap = next(x for x in snapshots_by_vb[vb] if x["start"] <= s <= x["end"])
            later = [d for d in docs if d["key"] == key and s < d["seqno"] <= snap["end"]]
            assert later, f"vbucket {vb}: seqno {s} ({key!r}) missing without a later change in its snapshot"


def apply(docs: list[dict]) -> dict[bytes, bytes]:
    state: dict[bytes, bytes] = {}
    for d in sorted(docs, key=lambda d: (d["vbucket"], d["seqno"])):
        if d["op"] == MUTATION or d["op"] == "mutation":
            state[d["key"]] = d["value"]
        else:
            state.pop(d["key"], None)
    return state


def test_order_and_consistency_with_writers_on_64_vbuckets(served):
    history: dict = {}
    lock = threading.Lock()
    # Some history first, so streams start by backfill and then join the checkpoints.
    write_load(served.engine, 1, history, lock)
    c = DcpConnection(served.host, served.port, b"test:order")
    assert c.control("connection_buffer_size", "65536") == 0
    for vb in range(64):
        assert c.call(stream_req(vb))["word"] == 0
    writers = [threading.Thread(target=write_load, args=(served.engine, s, history, lock)) for s in (2, 3)]
    for w in writers:
        w.start()
    docs_by_vb: dict = {vb: [] for vb in range(64)}
    snaps_by_vb: dict = {vb: [] for vb in range(64)}
    current: dict = {}
    acked = 0

    def caught_up() -> bool:
        if any(w.is_alive() for w in writers):
            return False
        highs = served.engine.high_seqnos()
        return all((docs_by_vb[vb][-1]["seqno"] if docs_by_vb[vb] else 0) >= highs[vb] for vb in range(64))

    deadline = time.monotonic() + 120
    while not caught_up():
        assert time.monotonic() < deadline, "stream did not catch up"
        try:
            m = c.next_message(timeout=0.5)
        except TimeoutError:
            continue
        acked += m["size"]
        if acked > 16384:
            c.send(__import__("dcp_wire").buffer_ack(acked))
            acked = 0
        vb = m["vbucket"]
        if m["op"] == SNAPSHOT_MARKER:
            # A new marker only once the previous snapshot is complete.
            if vb in current and docs_by_vb[vb]:
                assert docs_by_vb[vb][-1]["seqno"] <= current[vb]["end"]
            current[vb] = m
            snaps_by_vb[vb].append(m)
        elif m["op"] in (MUTATION, DELETION):
            snap = current[vb]
            assert snap["start"] <= m["seqno"] <= snap["end"], (m, snap)
            m["snapshot"] = snap
            docs_by_vb[vb].append(m)
        else:
            pytest.fail(f"unexpected message {m}")
    c.close()
    for w in writers:
        w.join()
    check_history(docs_by_vb, snaps_by_vb, history)
    streamed = apply([d for docs in docs_by_vb.values() for d in docs])
    assert streamed == bucket_contents(served.engine)
    assert sum(1 for v in snaps_by_vb.values() for s in v if s["flags"] & 0x02) >= 1  # some backfill
    assert sum(1 for v in snaps_by_vb.values() for s in v if s["flags"] & 0x01) >= 1  # some memory


def test_resume_from_saved_state_at_random_points(served, tmp_path):
    history: dict = {}
    lock = threading.Lock()
    write_load(served.engine, 11, history, lock)
    writer = threading.Thread(target=write_load, args=(served.engine, 12, history, lock, 0.02))
    writer.start()
    rng = random.Random(7)
    state_file = tmp_path / "state.json"
    client = sluice.Client(served.address, name="test:resume")
    seen: list[sluice.Change] = []
    sessions = 0
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline
        sessions += 1
        stream = client.stream(state=state_file, format="python", batch_size=rng.randint(5, 200))
        for _ in range(rng.randint(1, 4)):
            batch = stream.poll(2)
            if batch is None:
                break
            seen.extend(batch)
        stream.save_state(state_file)
        stream.close()
        highs = served.engine.high_seqnos()
        positions = json.loads(state_file.read_text())["vbuckets"]
        if (
            sessions >= 5
            and not writer.is_alive()
            and all(positions.get(str(vb), {"seqno": 0})["seqno"] >= highs[vb] for vb in range(64))
        ):
            break
    writer.join()
    by_vb: dict = {}
    for ch in seen:
        by_vb.setdefault(ch.vbucket, []).append(ch.seqno)
    for vb, seqnos in by_vb.items():
        assert seqnos == sorted(set(seqnos)), f"vbucket {vb}: duplicates or disorder across restarts"
    docs = [
        {"vbucket": c.vbucket, "seqno": c.seqno, "op": c.op, "key": c.key, "value": c.value} for c in seen
    ]
    assert apply(docs) == bucket_contents(served.engine)
    # No gaps: every seqno a writer made is either streamed or superseded by a streamed change.
    streamed = {(c.vbucket, c.seqno) for c in seen}
    last = {}
    for c in seen:
        last[(c.vbucket, c.key)] = max(last.get((c.vbucket, c.key), 0), c.seqno)
    for (vb, s), key in history.items():
        assert (vb, s) in streamed or last.get((vb, key), 0) > s, f"gap at vbucket {vb} seqno {s}"


def test_arrow_batches(served):
    served.engine.set_many([(f"a{i}".encode(), b"v" * i) for i in range(100)])
    served.engine.delete(b"a5")
    with sluice.Client(served.address).stream(end="now") as stream:
        batches = list(stream)
    table = pa.Table.from_batches(batches)
    assert table.num_rows == 100
    assert table.schema.field("key").type == pa.binary()
    assert table.schema.field("value").type == pa.large_binary()
    rows = {r["key"]: r for r in table.to_pylist()}
    assert rows[b"a7"]["value"] == b"v" * 7 and rows[b"a7"]["op"] == "mutation"
    assert rows[b"a5"]["op"] == "deletion"
    assert len(stream.ended) == 64 and set(stream.ended.values()) == {0}


def test_a_catch_up_of_large_documents_comes_in_batches_of_at_most_16_mib(served):
    """A batch is handed over once it holds 16 MiB of keys and values, whatever its count: a
    reader catching up on large documents never holds `batch_size` of them at once, even with a
    flow-control window that lets the producer send far more."""
    mib = 1 << 20
    docs = 64
    served.engine.set_many([(f"big{i}".encode(), bytes([i]) * mib) for i in range(docs)])
    sizes = []
    seen = set()
    with sluice.Client(served.address).stream(
        end="now", batch_size=100_000, buffer_size=512 * mib, format=lambda raw: raw
    ) as stream:
        for raw in stream:
            rows = raw.rows()
            sizes.append(sum(len(r[3]) + len(r[4]) for r in rows))
            seen.update(r[3] for r in rows if len(r[4]) == mib and r[4] == r[4][:1] * mib)
    assert seen == {f"big{i}".encode() for i in range(docs)}
    assert max(sizes) <= 16 * mib + mib + 64, [s / mib for s in sizes]


def test_unknown_uuid_rolls_back_to_zero(served):
    served.engine.set_many([(f"r{i}".encode(), b"v") for i in range(50)])
    vb = served.engine.vbucket_of(b"r1")
    high = served.engine.high_seqnos()[vb]
    fake = {
        "version": 1,
        "vbuckets": {str(vb): {"failover_log": [[0xFEEDDECA, 0]], "seqno": high, "snapshot": [high, high]}},
    }
    client = sluice.Client(served.address)
    with client.stream([vb], state=fake) as stream, pytest.raises(sluice.RollbackError) as e:
        next(stream)
    assert (e.value.vbucket, e.value.seqno) == (vb, 0)
    # The state after the rollback is "no history": a restart from it streams everything.
    assert stream.state()["vbuckets"][str(vb)]["seqno"] == 0

    calls = []
    with client.stream([vb], state=fake, end="now", rollback=lambda v, s: calls.append((v, s))) as stream:
        got = [c for b in stream for c in b.to_pylist()]
    assert calls == [(vb, 0)]
    assert len(got) == sum(1 for i in range(50) if sluice.vbucket_of(f"r{i}".encode(), 64) == vb)

    with client.stream([vb], state=fake, end="now", rollback="resume", format="python") as stream:
        got = [c for b in stream for c in b]
    assert stream.rollbacks == [(vb, 0)] and got[0].seqno == 1


def test_rollback_after_an_unclean_restart(tmp_path):
    """failure-scenarios.md: a consumer ahead of the producer's new branch rolls back to the
    seqno where that branch began."""
    node = Node(tmp_path / "n")
    mc = bmemcached.Client([node.address])
    keys = [f"f{i}" for i in range(40)]
    for k in keys:
        mc.set(k, "v")
    vb = sluice.vbucket_of(keys[0].encode(), 64)
    with sluice.Client(node.address).stream([vb], end="now") as stream:
        list(stream)
        state = stream.state()
    high = state["vbuckets"][str(vb)]["seqno"]
    node.proc.kill()
    node.proc.wait()
    node = Node(tmp_path / "n")
    try:
        # Pretend the consumer saw 5 more changes of the old branch than survived.
        pos = state["vbuckets"][str(vb)]
        pos["seqno"] = high + 5
        pos["snapshot"] = [high + 1, high + 5]
        with (
            sluice.Client(node.address).stream([vb], state=state) as stream,
            pytest.raises(sluice.RollbackError) as e,
        ):
            next(stream)
        # The new branch began at the recovered high seqno: what the WAL held at the kill
        # (the last acknowledged writes may not have reached it without a durability level).
        assert e.value.seqno <= high
        # Continuing from the rollback point works, on the new branch.
        with sluice.Client(node.address).stream([vb], state=stream.state(), end="now") as s2:
            assert list(s2) == []
            log = s2.state()["vbuckets"][str(vb)]["failover_log"]
        assert len(log) == 2 and log[0][1] == e.value.seqno
    finally:
        assert node.stop() == 0


def test_streams_from_a_replica_vbucket(served):
    served.engine.set_many([(f"p{i}".encode(), b"v") for i in range(64)])
    vb = served.engine.vbucket_of(b"p3")
    served.engine.set_vbucket_state(vb, "replica")
    with sluice.Client(served.address).stream([vb], end="now", format="python") as stream:
        got = [c for b in stream for c in b]
    assert b"p3" in {c.key for c in got}


def checkpoint_bytes(metrics: str) -> int:
    for line in metrics.splitlines():
        if line.startswith('sluice_memory_bytes{bucket="default",kind="checkpoints"}'):
            return int(line.split()[-1])
    raise AssertionError("no checkpoint metric")


@pytest.mark.parametrize("cursor_dropping", [True, False])
def test_a_lagging_cursor_is_dropped_and_memory_stays_in_quota(tmp_path, cursor_dropping):
    quota = 64 << 20
    ratio = 0.05  # 3.2 MiB of checkpoints
    s = Served(tmp_path / "d", {"default": {"memory_quota": quota, "checkpoint_memory_ratio": ratio}})
    try:
        c = DcpConnection(s.host, s.port, b"test:lagging")
        assert c.control("connection_buffer_size", "4096") == 0
        if cursor_dropping:
            assert c.control("supports_cursor_dropping", "true") == 0
        for vb in range(64):
            assert c.call(stream_req(vb))["word"] == 0
        # 30 MiB of changes while the consumer reads nothing.
        value = b"x" * 1000
        peak = 0
        for i in range(30):
            s.engine.set_many([(f"lag{i}:{j}".encode(), value) for j in range(1000)])
            peak = max(peak, checkpoint_bytes(s.metrics()))
        time.sleep(1)
        # The quota is enforced by the maintenance thread, woken when a write passes it: once it
        # has run memory is within the quota; in between, writes may overshoot by a margin
        # (unbounded, the 30 MiB written would all be pinned).
        assert checkpoint_bytes(s.metrics()) <= quota * ratio
        assert peak <= 5 * quota * ratio
        assert s.engine.stats()["cursors_dropped"] >= 1
        # Now read everything.
        from dcp_wire import buffer_ack

        ended, docs = {}, {}
        c.send(buffer_ack(1 << 30))
        highs = s.engine.high_seqnos()
        deadline = time.monotonic() + 60
        while not all(vb in ended or docs.get(vb, 0) >= highs[vb] for vb in range(64)):
            assert time.monotonic() < deadline
            m = c.next_message(timeout=10)
            c.send(buffer_ack(m["size"]))
            if m["op"] == STREAM_END:
                ended[m["vbucket"]] = m["reason"]
            elif m["op"] == MUTATION:
                assert m["seqno"] > docs.get(m["vbucket"], 0)
                docs[m["vbucket"]] = m["seqno"]
        if cursor_dropping:
            assert 4 in ended.values()  # STREAM_END "too slow"
            assert "sluice_dcp_streams_too_slow_total 0" not in s.metrics()
        else:
            # Without cursor dropping the streams went on by backfill, to the end, no gaps.
            assert not ended
            assert all(docs[vb] == highs[vb] for vb in range(64))
        c.close()
    finally:
        s.close()


def test_a_stream_ends_when_its_vbucket_stops_being_active(served):
    served.engine.set_many([(f"s{i}".encode(), b"v") for i in range(64)])
    vb = served.engine.vbucket_of(b"s1")
    c = DcpConnection(served.host, served.port, b"test:state")
    assert c.call(stream_req(vb))["word"] == 0
    msgs = c.collect(lambda m: any(x["op"] == MUTATION for x in m))
    assert msgs[0]["op"] == SNAPSHOT_MARKER
    served.engine.set_vbucket_state(vb, "replica")
    end = c.next_message(timeout=10)
    assert (end["op"], end["vbucket"], end["reason"]) == (STREAM_END, vb, 0x02)  # state changed
    # A stream opened on the replica goes on while it stays a replica, and ends when it dies.
    assert c.call(stream_req(vb))["word"] == 0
    c.collect(lambda m: any(x["op"] == MUTATION for x in m))
    served.engine.set_vbucket_state(vb, "dead")
    end = c.next_message(timeout=10)
    assert (end["op"], end["reason"]) == (STREAM_END, 0x02)
    c.close()
