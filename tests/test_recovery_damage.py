"""Recovery from the files on disk: clean restarts, torn tails, damage in the middle of the
WAL, snapshots with later WAL records, snapshot retention and damaged snapshots."""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import pytest
import sluice
from helpers import (
    Node,
    as_crash_left_it,
    first_lsn,
    flip_byte,
    item_state,
    layout,
    open_engine,
    segments,
    snapshots,
    wal_dump,
)
from sluice import _native


def _populate(e: sluice.EmbeddedEngine, keys: list[bytes], rng: random.Random, n: int) -> None:
    """A mix of sets, overwrites, deletes and expirations."""
    for _ in range(n):
        k = rng.choice(keys)
        r = rng.random()
        if r < 0.15:
            try:
                e.delete(k)
            except sluice.NotFoundError:
                pass
        elif r < 0.2:
            e.set(k, b"expired", expiry=int(time.time()) - 5, flags=3)
            e.get(k)  # becomes an EXPIRATION change
        else:
            e.set(
                k,
                rng.randbytes(rng.randrange(1, 300)),
                flags=rng.randrange(1 << 32),
                datatype=rng.randrange(2),
                expiry=rng.choice([0, 0, 3600]),
            )


def _state(e: sluice.EmbeddedEngine, keys: list[bytes]) -> dict:
    return {
        "items": {k: item_state(e, k) for k in keys},
        "high": e.high_seqnos(),
        "failover": [e.failover_log(vb) for vb in range(64)],
        "states": [e.vbucket_state(vb) for vb in range(64)],
    }


KEYS = [b"key-%d" % i for i in range(300)]


def _persist_writes(e: sluice.EmbeddedEngine, n: int, prefix: bytes = b"p", pad: int = 0) -> list[bytes]:
    """n separate persist writes (value-0, value-1, ...): each lands in its own WAL block."""
    keys = []
    for i in range(n):
        k = b"%s%d" % (prefix, i)
        e.set(k, b"value-%d" % i, flags=pad, durability="persist")
        if pad:
            e.set(k + b"-pad", b"." * pad, durability="persist")
        keys.append(k)
    return keys


def test_close_releases_the_data_dir_lock(data_dir):
    e = open_engine(data_dir)
    e.set(b"k", b"v")
    with pytest.raises(sluice.SluiceError, match="in use"):
        open_engine(data_dir)
    e.close()
    # The old handle is still referenced: close() alone must release the lock.
    with open_engine(data_dir) as again:
        assert again.get(b"k").value == b"v"
        with pytest.raises(sluice.ClosedError):
            e.get(b"k")


def test_clean_close_preserves_everything_without_a_failover_entry(data_dir):
    rng = random.Random(1)
    with open_engine(data_dir, wal__mode="write") as e:
        _populate(e, KEYS, rng, 2000)
        e.set_vbucket_state(3, "replica")
        before = _state(e, KEYS)
    assert [p.suffix for p in segments(data_dir)] == [".xlog"]
    for _ in range(2):  # and a second clean restart changes nothing either
        with open_engine(data_dir) as e:
            report = e.recovery_report()
            assert report["unclean_shutdown"] is False
            assert report["truncated"] is None and report["skipped_damage"] == []
            assert _state(e, KEYS) == before


def test_torn_tail_in_the_last_block_is_truncated(data_dir, caplog):
    with open_engine(data_dir, wal__mode="write") as e:
        keys = _persist_writes(e, 10)
    (seg,) = segments(data_dir)
    lay = layout(seg)
    last = lay.blocks[-1]
    assert lay.eof_offset == last.end and len(lay.blocks) >= 10
    open_seg = as_crash_left_it(seg)
    os.truncate(open_seg, last.offset + 12 + last.length // 2)  # a write cut inside the last block
    with open_engine(data_dir) as e:
        report = e.recovery_report()
        assert report["truncated"] == (str(open_seg), last.offset)
        assert report["unclean_shutdown"] is True
        assert report["dropped"] == [] and report["moved_aside"] == []
        assert [e.get(k).value for k in keys[:-1]] == [b"value-%d" % i for i in range(9)]
        assert e.get(keys[-1]) is None, "the torn block's write is gone"
        assert all(len(e.failover_log(vb)) == 2 for vb in range(64))
        e.set(b"new", b"write")
    assert _native.flush_logs(10)  # the engine's log lines reach Python's logging from a thread
    assert any(
        r.levelname == "WARNING" and f"torn write at byte offset {last.offset}" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    # The truncated segment was sealed: it now ends cleanly where the tear began.
    assert wal_dump(seg)[-1] == {"end": "eof", "offset": last.offset}
    with open_engine(data_dir) as e:
        assert e.recovery_report()["unclean_shutdown"] is False
        assert e.get(b"new").value == b"write" and e.get(keys[-2]) is not None


@pytest.mark.parametrize("damage", ["short-header", "zero-fill", "lost-pages"])
def test_other_torn_tails_of_the_last_segment(data_dir, damage):
    with open_engine(data_dir, wal__mode="write") as e:
        keys = _persist_writes(e, 5)
        e.set(b"big", b"x" * 10000)  # a last block over several pages
    (seg,) = segments(data_dir)
    lay = layout(seg)
    last = lay.blocks[-1]
    seg = as_crash_left_it(seg)
    if damage == "short-header":
        with open(seg, "ab") as f:
            f.write(bytes.fromhex("d5ba0bab0000"))  # 6 bytes of a 12-byte block header
        cut = lay.eof_offset
    elif damage == "zero-fill":
        with open(seg, "ab") as f:
            f.write(b"\0" * 8192)  # a tail the file system extended with zeros
        cut = lay.eof_offset
    else:  # the last write's pages from a page boundary on never reached the disk
        page = (last.payload_offset // 4096 + 1) * 4096
        with open(seg, "r+b") as f:
            f.seek(page)
            f.write(b"\0" * (lay.eof_offset - page))
        cut = last.offset
    with open_engine(data_dir) as e:
        assert e.recovery_report()["truncated"] == (str(seg), cut)
        assert [e.get(k).value for k in keys] == [b"value-%d" % i for i in range(5)]
        assert (e.get(b"big") is None) == (damage == "lost-pages")


def _refused_at(data_dir: Path, seg: Path, offset: int) -> None:
    """Start-up stops naming the file and the byte offset, every time, leaving the file as it is."""
    before = seg.read_bytes()
    for _ in range(2):
        with pytest.raises(sluice.CorruptionError) as info:
            open_engine(data_dir)
        assert str(seg) in str(info.value) and f"byte offset {offset}" in str(info.value), info.value
        assert seg.read_bytes() == before


def test_checksum_damage_in_a_closed_file_is_not_a_torn_tail(data_dir):
    # The last block is followed by the EOF marker: a flipped byte there is damage, not a tear.
    with open_engine(data_dir, wal__mode="write") as e:
        _persist_writes(e, 5)
    (seg,) = segments(data_dir)
    last = layout(seg).blocks[-1]
    flip_byte(seg, last.payload_offset + 2)
    _refused_at(data_dir, seg, last.offset)


def test_checksum_damage_at_the_end_of_an_open_segment_is_not_a_torn_tail(data_dir):
    # A complete last block whose checksum fails: no write cut short leaves one.
    with open_engine(data_dir, wal__mode="write") as e:
        _persist_writes(e, 5)
    (seg,) = segments(data_dir)
    last = layout(seg).blocks[-1]
    seg = as_crash_left_it(seg)
    flip_byte(seg, last.payload_offset + 1)
    _refused_at(data_dir, seg, last.offset)


@pytest.mark.parametrize("damage", ["last 16 bytes flipped", "last 4 KiB zeroed", "cut in the last block"])
def test_damage_at_the_end_of_a_closed_segment_is_refused(data_dir, damage):
    """The issue's finding: such damage was cut as a torn tail, persist-acknowledged writes
    silently gone and the shutdown called unclean."""
    with open_engine(data_dir, wal__mode="write") as e:
        keys = _persist_writes(e, 40, pad=100)
    (seg,) = segments(data_dir)
    lay = layout(seg)
    assert lay.size > 8192
    original = seg.read_bytes()
    data = bytearray(original)
    if damage == "last 16 bytes flipped":
        start = lay.size - 16
        data[start:] = bytes(b ^ 0xFF for b in data[start:])
    elif damage == "last 4 KiB zeroed":
        start = lay.size - 4096
        data[start:] = bytes(4096)
    else:
        start = lay.blocks[-1].offset + 20
        del data[start:]
    seg.write_bytes(bytes(data))
    damaged = max(b.offset for b in lay.blocks if b.offset <= start)
    _refused_at(data_dir, seg, damaged)
    with open_engine(data_dir, force_recovery=True) as e:
        report = e.recovery_report()
        (dropped,) = report["dropped"]
        assert dropped["file"] == str(seg) and dropped["offset"] == damaged and dropped["bytes"] > 0
        # Every write before the damaged block is back (its padding write follows it).
        intact = [k for k in keys if original.find(k + b"-pad") < damaged]
        assert len(intact) >= 15
        assert [e.get(k).value for k in intact] == [b"value-%d" % i for i in range(len(intact))]


def test_damage_before_later_blocks_stops_recovery(data_dir):
    # Small segments, so that the damaged segment is neither the first nor the last.
    with open_engine(data_dir, wal__mode="write", wal__segment_size=4096) as e:
        keys = _persist_writes(e, 60, pad=300)
    segs = segments(data_dir)
    assert len(segs) >= 4 and all(p.suffix == ".xlog" for p in segs)
    victim = segs[len(segs) // 2]
    lay = layout(victim)
    assert len(lay.blocks) >= 2
    header_end = victim.read_bytes().index(b"\n\n") + 2
    assert lay.blocks[0].offset == header_end
    flip_byte(victim, lay.blocks[0].payload_offset + lay.blocks[0].length // 2)
    before = victim.read_bytes()

    for _ in range(2):  # refused every time, and the file is left as it was
        with pytest.raises(sluice.CorruptionError) as info:
            open_engine(data_dir)
        msg = str(info.value)
        assert str(victim) in msg and f"byte offset {header_end}" in msg, msg
        assert victim.read_bytes() == before
    assert wal_dump(victim)[-1]["end"] == "corrupt"
    assert wal_dump(victim)[-1]["offset"] == header_end

    with open_engine(data_dir, force_recovery=True) as e:
        report = e.recovery_report()
        assert any(str(victim) in d and f"byte offset {header_end}" in d for d in report["skipped_damage"])
        # What precedes the damaged segment is intact.
        assert e.get(keys[0]).value == b"value-0"
        assert e.get(b"new") is None
        e.set(b"new", b"after forced recovery", durability="persist")
        # A snapshot makes the damaged segment unnecessary ...
        e.snapshot()
        state = {k: item_state(e, k) for k in keys + [b"new"]}
    # ... so that the next start needs no force.
    with open_engine(data_dir) as e:
        assert e.recovery_report()["skipped_damage"] == []
        assert {k: item_state(e, k) for k in keys + [b"new"]} == state


def test_snapshot_plus_later_wal_recovers_the_same_state(data_dir):
    rng = random.Random(2)
    with open_engine(data_dir, wal__mode="write") as e:
        _populate(e, KEYS, rng, 1500)
        e.set_vbucket_state(7, "replica")
        snap = e.snapshot()
        e.set_vbucket_state(7, "active")
        _populate(e, KEYS, rng, 1500)
        expected = _state(e, KEYS)
    assert Path(snap).parent == data_dir / "snap" and Path(snap).suffix == ".snap"
    assert [p.name for p in snapshots(data_dir)] == [Path(snap).name]
    with open_engine(data_dir) as e:
        report = e.recovery_report()
        assert report["snapshot"] == str(snap)
        assert report["snapshot_lsn"] == first_lsn(Path(snap))
        assert report["wal_records"] > 0
        assert _state(e, KEYS) == expected
    # The snapshot file itself is readable by wal-dump and complete.
    lines = wal_dump(Path(snap))
    assert lines[0]["file"] == "snap" and lines[-1]["end"] == "eof"
    assert sum(1 for r in lines if r.get("op") == "vbucket_snapshot") == 64


def test_snapshot_retention(data_dir):
    rng = random.Random(3)
    snaps = []
    with open_engine(data_dir, wal__mode="write", snapshot__count=2) as e:
        for _ in range(3):
            for i in range(40):
                e.set(rng.choice(KEYS), b"v%d" % i, durability="persist")
            snaps.append(Path(e.snapshot()))
        for i in range(10):
            e.set(b"tail-%d" % i, b"v", durability="persist")
        expected = _state(e, KEYS)
    assert [p.name for p in snapshots(data_dir)] == [p.name for p in snaps[1:]]
    oldest_kept = first_lsn(snaps[1])
    segs = segments(data_dir)
    firsts = [first_lsn(p) for p in segs]
    assert firsts[0] <= oldest_kept + 1, "the WAL still covers everything after the oldest kept snapshot"
    assert all(f > oldest_kept + 1 for f in firsts[1:]), (
        f"segments {[p.name for p in segs]} hold one wholly older than snapshot {oldest_kept}"
    )
    with open_engine(data_dir) as e:
        assert e.recovery_report()["snapshot"] == str(snaps[2])
        assert _state(e, KEYS) == expected


def test_corrupt_newest_snapshot_falls_back_to_the_older_one(data_dir):
    rng = random.Random(4)
    with open_engine(data_dir, wal__mode="write", snapshot__count=2) as e:
        _populate(e, KEYS, rng, 500)
        older = Path(e.snapshot())
        _populate(e, KEYS, rng, 500)
        newest = Path(e.snapshot())
        _populate(e, KEYS, rng, 500)
        expected = _state(e, KEYS)
    lay = layout(newest)
    flip_byte(newest, lay.blocks[0].payload_offset + 10)
    with open_engine(data_dir) as e:
        report = e.recovery_report()
        assert report["snapshot"] == str(older)
        # The WAL covers everything after the older snapshot: nothing is lost, nothing skipped,
        # and the damaged file is moved aside so that retention never counts it.
        assert report["skipped_damage"] == []
        assert report["moved_aside"] == [str(newest) + ".damaged"]
        assert Path(str(newest) + ".damaged").exists() and not newest.exists()
        assert _state(e, KEYS) == expected
    # The fresh snapshot written at that open makes the next start an ordinary one.
    with open_engine(data_dir) as e:
        assert e.recovery_report()["moved_aside"] == []
        assert _state(e, KEYS) == expected


def _damage_the_only_snapshot(data_dir: Path) -> tuple[Path, int]:
    """Leaves one snapshot, damaged, and a WAL that no longer reaches back behind it."""
    with open_engine(data_dir, wal__mode="write", snapshot__count=1) as e:
        _persist_writes(e, 20)
        e.snapshot()
        _persist_writes(e, 20, b"q")
        snap = Path(e.snapshot())  # the first snapshot and the WAL before this one are gone
        _persist_writes(e, 5, b"r")
    assert snapshots(data_dir) == [snap]
    lay = layout(snap)
    flip_byte(snap, lay.blocks[0].payload_offset + 10)
    return snap, lay.blocks[0].offset


def test_corrupt_only_snapshot_without_the_wal_behind_it(data_dir):
    snap, offset = _damage_the_only_snapshot(data_dir)
    with pytest.raises(sluice.CorruptionError) as info:
        open_engine(data_dir)
    assert str(snap) in str(info.value) and f"byte offset {offset}" in str(info.value)
    with open_engine(data_dir, force_recovery=True) as e:
        assert any(str(snap) in d for d in e.recovery_report()["skipped_damage"])
        assert e.get(b"p0") is None  # only in the damaged snapshot: lost, as forced
        e.set(b"after", b"forced", durability="persist")
        assert e.get(b"after").value == b"forced"


def test_writes_acknowledged_after_a_forced_recovery_survive(data_dir):
    damaged, _ = _damage_the_only_snapshot(data_dir)
    highest_on_disk = max(first_lsn(p) for p in snapshots(data_dir) + segments(data_dir))
    with open_engine(data_dir, force_recovery=True, snapshot__count=1) as e:
        m = e.set(b"after", b"forced", durability="persist")
        # New history must not reuse LSNs of files still on disk: retention and the next
        # recovery order files by LSN.
        assert m.lsn > highest_on_disk
        snap = Path(e.snapshot())
        assert first_lsn(snap) > first_lsn(damaged)
        e.set(b"later", b"too", durability="persist")
    with open_engine(data_dir, force_recovery=True, snapshot__count=1) as e:
        assert e.get(b"after") is not None and e.get(b"later") is not None


def test_unfinished_snapshot_is_removed(data_dir):
    with open_engine(data_dir) as e:
        e.set(b"k", b"v", durability="persist")
    leftover = data_dir / "snap" / f"{999:020d}.snap.inprogress"
    leftover.write_bytes(b"SLUICE-SNAP\n1\n")  # as a crash during a snapshot leaves it
    with open_engine(data_dir) as e:
        assert e.get(b"k").value == b"v"
        assert e.recovery_report()["snapshot"] is None
    assert not leftover.exists()


def _two_damaged_snapshots(data_dir: Path) -> tuple[dict[bytes, bytes], list[tuple[Path, int]]]:
    """3,000 items of 1 KiB: 1,500 before the older snapshot (so only in snapshots), 1,500 after
    it (also in the WAL). One flipped byte in each snapshot, in blocks covering different
    vbuckets: the older one's last block, the newer one's first."""
    rng = random.Random(5)
    items = {b"item-%d" % i: rng.randbytes(1024) for i in range(3000)}
    keys = list(items)
    with open_engine(data_dir, wal__mode="write", snapshot__count=2) as e:
        for k in keys[:1500]:
            e.set(k, items[k])
        older = Path(e.snapshot())
        for k in keys[1500:]:
            e.set(k, items[k])
        newer = Path(e.snapshot())
    damaged = []
    for snap, block in ((older, -1), (newer, 0)):
        lay = layout(snap)
        assert len(lay.blocks) >= 2
        b = lay.blocks[block]
        flip_byte(snap, b.payload_offset + b.length // 2)
        damaged.append((snap, b.offset))
    return items, damaged


def test_force_recovery_salvages_two_damaged_snapshots_and_keeps_the_wal(data_dir, tmp_path):
    """The issue's finding: this started with 0 of 3,000 items and moved every WAL segment aside."""
    items, damaged = _two_damaged_snapshots(data_dir)
    (newer, newer_offset) = damaged[1]
    wal_before = segments(data_dir)
    assert wal_before
    shutil.copytree(data_dir, tmp_path / "copy")
    with pytest.raises(sluice.CorruptionError) as info:
        open_engine(data_dir)
    assert str(newer) in str(info.value) and f"byte offset {newer_offset}" in str(info.value)

    with open_engine(data_dir, force_recovery=True) as e:
        report = e.recovery_report()
        lost = [k for k, v in items.items() if (it := e.get(k)) is None or it.value != v]
        assert lost == [], f"{len(lost)} of 3,000 items not recovered"
        # Each damaged block is reported by file and offset; nothing else was dropped.
        assert sorted((d["file"], d["offset"]) for d in report["dropped"]) == sorted(
            (str(p), off) for p, off in damaged
        )
        assert all(d["bytes"] > 0 for d in report["dropped"])
        # The damaged snapshots go aside; every WAL record was replayed and no segment moved
        # aside (the snapshot written after the recovery holds them, so retention may remove
        # them, as after any snapshot).
        assert sorted(report["moved_aside"]) == sorted(str(p) + ".damaged" for p, _ in damaged)
        assert report["wal_records"] >= 1500 and report["wal_segments"] == len(wal_before)
        assert not [p for p in segments(data_dir) if p.suffix == ".damaged"]
    # The snapshot written after the forced recovery makes the next start an ordinary one.
    with open_engine(data_dir) as e:
        assert e.recovery_report()["dropped"] == []
        assert all(e.get(k).value == v for k, v in items.items())

    # `sluice serve --force-recovery` logs what was dropped, by file and offset, before its ready line.
    node = Node(tmp_path / "copy", "--force-recovery")
    try:
        before_ready = "".join(node.lines)
        for p, off in damaged:
            copy = tmp_path / "copy" / "snap" / p.name
            assert f"--force-recovery dropped {copy} byte offset {off}" in before_ready, before_ready
        assert "3000 items" in node.lines[-1] and "2 damaged part(s) dropped" in node.lines[-1]
    finally:
        assert node.stop() == 0
