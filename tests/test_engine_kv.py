"""The embedded engine's key-value behaviour as a user of the Python API sees it: stores and
their conflicts, CAS, seqnos and revisions, tombstones, expiry, vbucket states, durability
levels and buckets."""

from __future__ import annotations

import collections
import random
import time
from itertools import pairwise
from pathlib import Path

import pytest
import sluice
from helpers import open_engine, segments


@pytest.fixture
def engine(data_dir: Path):
    with open_engine(data_dir) as e:
        yield e


def test_set_get_delete_roundtrip(engine):
    m = engine.set(b"user:1", b'{"name": "ada"}', flags=0xDEADBEEF, datatype=1)
    it = engine.get(b"user:1")
    assert it is not None
    assert (it.key, it.value, it.flags, it.datatype) == (b"user:1", b'{"name": "ada"}', 0xDEADBEEF, 1)
    assert (it.cas, it.seqno, it.deleted, it.expiry) == (m.cas, m.seqno, False, 0)
    assert m.vbucket == engine.vbucket_of(b"user:1") == sluice.vbucket_of(b"user:1", 64)
    assert m.seqno == 1

    engine.set(b"user:1", b"v2")
    assert engine.get(b"user:1").value == b"v2"
    d = engine.delete(b"user:1")
    assert d.vbucket == m.vbucket and d.seqno == 3
    assert engine.get(b"user:1") is None
    with pytest.raises(sluice.NotFoundError):
        engine.delete(b"user:1")
    assert engine.get(b"never-written") is None
    assert engine.get_meta(b"never-written") is None
    stats = engine.stats()
    assert (stats["items"], stats["tombstones"], stats["sets"], stats["deletes"]) == (0, 1, 2, 1)


def test_add_and_replace_conflicts(engine):
    with pytest.raises(sluice.NotFoundError):
        engine.set(b"k", b"v", mode="replace")
    assert engine.get(b"k") is None

    engine.set(b"k", b"first", mode="add")
    with pytest.raises(sluice.ExistsError):
        engine.set(b"k", b"second", mode="add")
    assert engine.get(b"k").value == b"first"

    engine.set(b"k", b"replaced", mode="replace")
    assert engine.get(b"k").value == b"replaced"

    # A deleted key counts as absent for both.
    engine.delete(b"k")
    with pytest.raises(sluice.NotFoundError):
        engine.set(b"k", b"x", mode="replace")
    engine.set(b"k", b"added-after-delete", mode="add")
    assert engine.get(b"k").value == b"added-after-delete"

    with pytest.raises(ValueError, match="cas"):
        engine.set(b"k", b"x", mode="cas")


def test_cas_mismatch(engine):
    m1 = engine.set(b"k", b"v1")
    m2 = engine.set(b"k", b"v2", cas=m1.cas)  # the current CAS: accepted
    assert m2.cas != m1.cas
    with pytest.raises(sluice.ExistsError):
        engine.set(b"k", b"stale", cas=m1.cas)
    with pytest.raises(sluice.ExistsError):
        engine.delete(b"k", cas=m1.cas)
    assert engine.get(b"k").value == b"v2"
    with pytest.raises(sluice.NotFoundError):
        engine.set(b"missing", b"v", cas=m1.cas)

    engine.delete(b"k", cas=m2.cas)
    assert engine.get(b"k") is None
    with pytest.raises(sluice.NotFoundError):
        engine.set(b"k", b"v", cas=m2.cas)


def test_seqnos_and_cas_strictly_increase_per_vbucket(engine):
    rng = random.Random(7)
    seen: dict[int, list[int]] = collections.defaultdict(list)
    cas_seen: dict[int, list[int]] = collections.defaultdict(list)
    keys = [f"key-{i}".encode() for i in range(200)]
    for _ in range(1500):
        key = rng.choice(keys)
        try:
            m = engine.delete(key) if rng.random() < 0.2 else engine.set(key, rng.randbytes(16))
        except sluice.NotFoundError:
            continue  # a failed delete takes no seqno
        seen[m.vbucket].append(m.seqno)
        cas_seen[m.vbucket].append(m.cas)
    high = engine.high_seqnos()
    assert len(high) == 64
    for vb, seqnos in seen.items():
        # One seqno per change, from 1, no gaps, none repeated.
        assert seqnos == list(range(1, len(seqnos) + 1)), f"vbucket {vb}"
        assert high[vb] == seqnos[-1]
        cas = cas_seen[vb]
        assert all(a < b for a, b in pairwise(cas)), f"CAS of vbucket {vb} is not monotonic"
    for vb in set(range(64)) - set(seen):
        assert high[vb] == 0


def test_rev_seqno_and_tombstones(engine):
    for i in range(3):
        engine.set(b"r", b"v%d" % i)
    assert engine.get(b"r").rev_seqno == 3
    d = engine.delete(b"r")
    tomb = engine.get_meta(b"r")
    assert tomb is not None and tomb.deleted
    assert (tomb.value, tomb.rev_seqno, tomb.seqno, tomb.cas) == (b"", 4, d.seqno, d.cas)
    assert abs(tomb.expiry - time.time()) < 5, "a tombstone's expiry field is its delete time"
    assert engine.get(b"r") is None
    # A new revision after the tombstone continues the count.
    m = engine.set(b"r", b"back")
    it = engine.get(b"r")
    assert (it.rev_seqno, it.seqno, it.deleted) == (5, m.seqno, False)
    assert engine.get_meta(b"r").deleted is False


def test_relative_expiry(engine, clock):
    start = time.time()
    m = engine.set(b"short", b"v", expiry=1)
    engine.set(b"long", b"v", expiry=30 * 86400)  # the largest relative value
    engine.set(b"never", b"v")
    short = engine.get_meta(b"short")
    assert start - 1 <= short.expiry - 1 <= time.time() + 1, "stored as an absolute time"
    assert abs(engine.get(b"long").expiry - (start + 30 * 86400)) <= 2
    assert engine.get(b"never").expiry == 0

    clock.advance(3)
    high = engine.high_seqnos()[m.vbucket]
    assert engine.get(b"short") is None
    # Reading it turned it into an EXPIRATION change with its own seqno: a tombstone.
    tomb = engine.get_meta(b"short")
    assert tomb.deleted and tomb.value == b""
    assert tomb.seqno == high + 1 == engine.high_seqnos()[m.vbucket]
    assert tomb.rev_seqno == 2
    assert engine.get(b"long") is not None and engine.get(b"never") is not None
    assert engine.stats()["expired_on_access"] == 1
    # Expired means absent for ADD and REPLACE too.
    with pytest.raises(sluice.NotFoundError):
        engine.set(b"short", b"x", mode="replace")
    engine.set(b"short", b"again", mode="add")
    assert engine.get(b"short").value == b"again"


def test_absolute_expiry(engine):
    now = int(time.time())
    m = engine.set(b"past", b"v", expiry=now - 100)
    engine.set(b"future", b"v", expiry=now + 3600)
    # Just over 30 days is an absolute Unix time (in January 1970): long expired.
    engine.set(b"just-over-30-days", b"v", expiry=30 * 86400 + 1)
    assert engine.get(b"past") is None
    assert engine.get(b"just-over-30-days") is None
    assert engine.get(b"future").expiry == now + 3600
    tomb = engine.get_meta(b"past")
    assert tomb.deleted and tomb.seqno == m.seqno + 1


def test_expiry_pager_turns_expired_items_into_expirations(engine):
    past = int(time.time()) - 10
    keys = [b"exp-%d" % i for i in range(20)]
    muts = {k: engine.set(k, b"v", expiry=past) for k in keys}
    engine.set(b"live", b"v", expiry=3600)
    engine.set(b"forever", b"v")
    before = engine.high_seqnos()
    assert engine.stats()["items"] == 22

    assert engine.run_expiry_pager() == 20
    after = engine.high_seqnos()
    per_vb = collections.Counter(m.vbucket for m in muts.values())
    for vb in range(64):
        assert after[vb] == before[vb] + per_vb.get(vb, 0), f"vbucket {vb}"
    for k, m in muts.items():
        tomb = engine.get_meta(k)
        assert tomb.deleted and tomb.seqno > m.seqno
        assert engine.get(k) is None
    assert engine.get(b"live") is not None and engine.get(b"forever") is not None
    stats = engine.stats()
    assert (stats["expired_by_pager"], stats["items"], stats["tombstones"]) == (20, 2, 20)
    # Nothing left to expire: a second run changes nothing.
    assert engine.run_expiry_pager() == 0
    assert engine.high_seqnos() == after


@pytest.mark.parametrize("state", ["replica", "pending", "dead"])
def test_vbucket_not_active_refuses_access_and_reactivation_adds_failover_entry(engine, state):
    m = engine.set(b"k", b"v")
    vb = m.vbucket
    other = next(i for i in range(1000) if engine.vbucket_of(b"o%d" % i) != vb)
    log_before = engine.failover_log(vb)
    assert engine.vbucket_state(vb) == "active" and len(log_before) == 1

    engine.set_vbucket_state(vb, state)
    assert engine.vbucket_state(vb) == state
    # A pending vbucket is being handed over: writes are to be retried, not sent elsewhere.
    write_error = sluice.TempFailError if state == "pending" else sluice.NotMyVbucketError
    with pytest.raises(write_error, match=f"vbucket {vb}"):
        engine.set(b"k", b"w")
    with pytest.raises(sluice.NotMyVbucketError):
        engine.get(b"k")
    with pytest.raises(write_error):
        engine.delete(b"k")
    assert engine.get_meta(b"k").value == b"v", "get_meta works whatever the state"
    engine.set(b"o%d" % other, b"fine")  # other vbuckets are unaffected
    assert engine.failover_log(vb) == log_before

    engine.set_vbucket_state(vb, "active")
    log = engine.failover_log(vb)
    assert len(log) == 2 and log[1:] == log_before
    assert log[0][1] == engine.high_seqnos()[vb] == m.seqno
    assert log[0][0] != log_before[0][0]
    assert engine.get(b"k").value == b"v"
    engine.set(b"k", b"w")
    assert engine.get(b"k").value == b"w"


def test_vbucket_state_errors_and_persistence(data_dir):
    with open_engine(data_dir) as e:
        with pytest.raises(ValueError, match="bogus"):
            e.set_vbucket_state(0, "bogus")
        with pytest.raises(IndexError, match="no vbucket 64"):
            e.set_vbucket_state(64, "replica")
        with pytest.raises(IndexError):
            e.failover_log(64)
        e.set_vbucket_state(5, "replica")
        e.set_vbucket_state(5, "replica")  # no change, no error
        log5 = e.failover_log(5)
    with open_engine(data_dir) as e:
        assert e.vbucket_state(5) == "replica"
        assert e.vbucket_state(6) == "active"
        assert e.failover_log(5) == log5


def test_persist_returns_after_the_wal_sync_even_in_write_mode(data_dir):
    with open_engine(data_dir, wal__mode="write") as e:
        for i in range(50):
            value = b"marker-%d-%s" % (i, random.randbytes(8).hex().encode())
            m = e.set(b"k%d" % i, value, durability="persist")
            assert e.stats()["wal_synced_lsn"] >= m.lsn
            # Another reader of the file (here: us) sees the record once the call returned.
            (seg,) = [p for p in segments(data_dir) if p.name.endswith(".inprogress")]
            assert value in seg.read_bytes()
        # Writes at level none are written but not synced by themselves in write mode.
        plain = e.set(b"plain", b"v")
        deadline = time.monotonic() + 10
        while e.stats()["wal_written_lsn"] < plain.lsn and time.monotonic() < deadline:
            time.sleep(0.01)
        assert e.stats()["wal_written_lsn"] >= plain.lsn
        d = e.delete(b"k0", durability="persist")
        assert e.stats()["wal_synced_lsn"] >= d.lsn
        n = e.set_many([(b"m%d" % i, b"v") for i in range(100)], durability="persist")
        assert e.stats()["wal_synced_lsn"] >= n


def test_persisted_seqnos_cover_an_acknowledged_persist_write(data_dir):
    # Many writes, because a wrong order (waking the waiter before updating the persisted
    # seqnos) shows as a race that a few hundred writes may miss.
    with open_engine(data_dir, wal__mode="write") as e:
        lagging = []
        for i in range(2000):
            m = e.set(b"k%d" % i, b"v", durability="persist")
            if e.persisted_seqnos()[m.vbucket] < m.seqno:
                lagging.append((m.vbucket, m.seqno))
        assert lagging == []


def test_persist_is_impossible_without_a_wal(data_dir):
    with open_engine(data_dir, wal__mode="none") as e:
        with pytest.raises(sluice.DurabilityImpossibleError, match="wal.mode is none"):
            e.set(b"k", b"v", durability="persist")
        assert e.get(b"k") is None, "a refused write is not applied"
        e.set(b"k", b"v", durability="none")
        with pytest.raises(sluice.DurabilityImpossibleError):
            e.delete(b"k", durability="persist")
        assert e.get(b"k").value == b"v"
        assert e.stats()["wal_synced_lsn"] == 0
    assert list((data_dir / "wal").iterdir()) == [], "wal.mode none writes nothing"


@pytest.mark.parametrize("level", ["majority", "majority_and_persist_active", "persist_to_majority"])
def test_majority_levels_are_impossible_without_replicas(engine, level):
    with pytest.raises(sluice.DurabilityImpossibleError, match="replica"):
        engine.set(b"k", b"v", durability=level)
    assert engine.get(b"k") is None
    engine.set(b"k", b"v")
    with pytest.raises(sluice.DurabilityImpossibleError):
        engine.delete(b"k", durability=level)
    with pytest.raises(sluice.DurabilityImpossibleError):
        engine.set_many([(b"a", b"b")], durability=level)
    assert engine.get(b"k").value == b"v" and engine.get(b"a") is None


def test_unknown_durability_level(engine):
    with pytest.raises(sluice.ConfigError, match="durability"):
        engine.set(b"k", b"v", durability="eventually")
    assert engine.get(b"k") is None


def test_bucket_default_durability_applies_to_writes(tmp_path):
    cfg = sluice.Config.from_dict(
        {
            "data_dir": str(tmp_path / "d"),
            "snapshot": {"interval": 0},
            "buckets": {"default": {}, "strict": {"durability": "majority"}},
        }
    )
    with sluice.EmbeddedEngine(cfg.to_native()) as e:
        with pytest.raises(sluice.DurabilityImpossibleError):
            e.set(b"k", b"v", bucket="strict")
        e.set(b"k", b"v", bucket="strict", durability="persist")  # an explicit level wins
        assert e.get(b"k", bucket="strict").value == b"v"
        e.set(b"k", b"v")  # the default bucket's default level is none


def _two_buckets(data_dir: Path, b2: dict | None = None) -> sluice.Config:
    return sluice.Config.from_dict(
        {
            "data_dir": str(data_dir),
            "snapshot": {"interval": 0},
            "buckets": {"default": {}, "b2": b2 if b2 is not None else {"num_vbuckets": 16}},
        }
    )


def test_buckets_from_config_are_isolated(data_dir):
    with sluice.EmbeddedEngine(_two_buckets(data_dir).to_native()) as e:
        e.set(b"shared", b"in-default")
        m = e.set(b"shared", b"in-b2", bucket="b2")
        assert m.vbucket == sluice.vbucket_of(b"shared", 16) == e.vbucket_of(b"shared", bucket="b2")
        e.set(b"only-b2", b"x", bucket="b2")
        assert e.get(b"shared").value == b"in-default"
        assert e.get(b"shared", bucket="b2").value == b"in-b2"
        assert e.get(b"only-b2") is None
        e.delete(b"shared")
        assert e.get(b"shared") is None
        assert e.get(b"shared", bucket="b2").value == b"in-b2"
        assert len(e.high_seqnos()) == 64 and len(e.high_seqnos(bucket="b2")) == 16
        assert sum(e.high_seqnos(bucket="b2")) == 2
        assert e.stats()["items"] == 0 and e.stats(bucket="b2")["items"] == 2
        e.set_vbucket_state(m.vbucket, "replica", bucket="b2")
        with pytest.raises(sluice.NotMyVbucketError):
            e.get(b"shared", bucket="b2")
        e.set_vbucket_state(m.vbucket, "active", bucket="b2")
    with sluice.EmbeddedEngine(_two_buckets(data_dir).to_native()) as e:
        assert e.get(b"shared") is None
        assert e.get(b"shared", bucket="b2").value == b"in-b2"
        assert e.get(b"only-b2", bucket="b2").value == b"x"
    # The vbucket count of a bucket with data cannot change.
    with pytest.raises(sluice.ConfigError, match="buckets.b2.num_vbuckets"):
        sluice.EmbeddedEngine(_two_buckets(data_dir, {"num_vbuckets": 32}).to_native())


def test_bucket_with_data_but_not_configured_is_still_served(data_dir):
    with sluice.EmbeddedEngine(_two_buckets(data_dir).to_native()) as e:
        e.set(b"k", b"in-b2", bucket="b2")
    with open_engine(data_dir) as e:
        assert e.get(b"k", bucket="b2").value == b"in-b2"


def test_no_such_bucket(engine):
    calls = [
        lambda: engine.set(b"k", b"v", bucket="nope"),
        lambda: engine.get(b"k", bucket="nope"),
        lambda: engine.get_meta(b"k", bucket="nope"),
        lambda: engine.delete(b"k", bucket="nope"),
        lambda: engine.set_many([(b"k", b"v")], bucket="nope"),
        lambda: engine.high_seqnos(bucket="nope"),
        lambda: engine.stats(bucket="nope"),
        lambda: engine.failover_log(0, bucket="nope"),
    ]
    for call in calls:
        with pytest.raises(sluice.NoSuchBucketError, match="nope"):
            call()
    assert engine.get(b"k") is None
    engine.set(b"k", b"v")


def test_closed_engine_refuses_calls(data_dir):
    e = open_engine(data_dir)
    e.set(b"k", b"v")
    e.close()
    e.close()  # idempotent
    with pytest.raises(sluice.ClosedError):
        e.set(b"k", b"v")
    with pytest.raises(sluice.ClosedError):
        e.get(b"k")


def test_set_many_is_all_or_nothing_when_a_vbucket_is_not_active(engine):
    keys = [b"many-%d" % i for i in range(200)]
    replica_vb = engine.vbucket_of(keys[0])
    engine.set_vbucket_state(replica_vb, "replica")
    highs = engine.high_seqnos()
    with pytest.raises(sluice.NotMyVbucketError):
        engine.set_many([(k, b"v") for k in keys])
    assert engine.high_seqnos() == highs, "no vbucket took any of the batch"
    engine.set_vbucket_state(replica_vb, "active")
    engine.set_many([(k, b"v") for k in keys])
    assert all(engine.get(k).value == b"v" for k in keys)


def test_read_modify_write_operations(engine):
    with pytest.raises(sluice.NotStoredError):
        engine.append(b"rmw", b"x")
    engine.set(b"rmw", b"mid", flags=7)
    engine.append(b"rmw", b"-end")
    engine.prepend(b"rmw", b"start-")
    item = engine.get(b"rmw")
    assert (item.value, item.flags) == (b"start-mid-end", 7)
    assert engine.incr(b"counter", 5, initial=10)[1] == 10
    assert engine.incr(b"counter", 5)[1] == 15
    assert engine.decr(b"counter", 100)[1] == 0
    with pytest.raises(sluice.NotFoundError):
        engine.incr(b"absent", 1, expiry=0xFFFFFFFF)
    with pytest.raises(sluice.NotNumericError):
        engine.incr(b"rmw", 1)
    m, touched = engine.gat(b"rmw", 100)
    assert touched.value == b"start-mid-end" and touched.expiry > 0 and m.seqno == touched.seqno
    assert engine.flush() == 2
    assert engine.get(b"rmw") is None and engine.get(b"counter") is None
