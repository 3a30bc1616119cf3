"""Recovery from the files on disk: clean restarts, torn tails, damage in the middle of the
WAL, snapshots with later WAL records, snapshot retention and damaged snapshots."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import sluice
from helpers import (
    first_lsn,
    flip_byte,
    item_state,
    layout,
    open_engine,
    segments,
    snapshots,
    wal_dump,
)


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


def test_torn_tail_in_the_last_block_is_truncated(data_dir):
    with open_engine(data_dir, wal__mode="write") as e:
        keys = _persist_writes(e, 10)
    (seg,) = segments(data_dir)
    lay = layout(seg)
    last = lay.blocks[-1]
    assert lay.eof_offset == last.end and len(lay.blocks) >= 10
    os.truncate(seg, last.offset + 12 + last.length // 2)  # cut inside the last block
    with open_engine(data_dir) as e:
        report = e.recovery_report()
        assert report["truncated"] == (str(seg), last.offset)
        assert report["unclean_shutdown"] is True
        assert [e.get(k).value for k in keys[:-1]] == [b"value-%d" % i for i in range(9)]
        assert e.get(keys[-1]) is None, "the torn block's write is gone"
        assert all(len(e.failover_log(vb)) == 2 for vb in range(64))
        e.set(b"new", b"write")
    # The truncated segment was sealed: it now ends cleanly where the tear began.
    assert wal_dump(seg)[-1] == {"end": "eof", "offset": last.offset}
    with open_engine(data_dir) as e:
        assert e.recovery_report()["unclean_shutdown"] is False
        assert e.get(b"new").value == b"write" and e.get(keys[-2]) is not None


@pytest.mark.parametrize("damage", ["checksum", "short-header", "zero-fill"])
def test_other_torn_tails_of_the_last_segment(data_dir, damage):
    with open_engine(data_dir, wal__mode="write") as e:
        keys = _persist_writes(e, 5)
    (seg,) = segments(data_dir)
    lay = layout(seg)
    last = lay.blocks[-1]
    os.truncate(seg, lay.eof_offset)  # as a crash leaves it: no EOF marker
    if damage == "checksum":
        flip_byte(seg, last.payload_offset + 1)  # the last block runs to the end of the file
        cut = last.offset
    elif damage == "short-header":
        with open(seg, "ab") as f:
            f.write(bytes.fromhex("d5ba0bab0000"))  # 6 bytes of a 12-byte block header
        cut = lay.eof_offset
    else:
        with open(seg, "ab") as f:
            f.write(b"\0" * 8192)  # a tail the file system extended with zeros
        cut = lay.eof_offset
    with open_engine(data_dir) as e:
        assert e.recovery_report()["truncated"] == (str(seg), cut)
        expected_last = None if damage == "checksum" else b"value-4"
        assert [e.get(k).value for k in keys[:-1]] == [b"value-%d" % i for i in range(4)]
        assert (e.get(keys[-1]).value if e.get(keys[-1]) else None) == expected_last


def test_checksum_damage_in_a_closed_file_is_not_a_torn_tail(data_dir):
    # The last block is followed by the EOF marker: a flipped byte there is damage, not a tear.
    with open_engine(data_dir, wal__mode="write") as e:
        _persist_writes(e, 5)
    (seg,) = segments(data_dir)
    last = layout(seg).blocks[-1]
    flip_byte(seg, last.payload_offset + 2)
    with pytest.raises(sluice.CorruptionError) as info:
        open_engine(data_dir)
    assert str(seg) in str(info.value) and f"byte offset {last.offset}" in str(info.value)


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
