"""The Couchbase Python SDK's whole KV API against `sluice serve`: every operation an application
calls on a collection and its binary view, mutation tokens that name sluice's vbucket uuid and
seqno, durable writes at each level on an active with a replica, replica reads, and a steady
writer that keeps going, unchanged, while the replica is promoted after its active dies."""

from __future__ import annotations

import collections
import threading
import time
from datetime import timedelta

import couchbase.subdocument as SD
import pytest
import sluice
from couchbase.durability import DurabilityLevel, ServerDurability
from couchbase.exceptions import (
    CasMismatchException,
    DocumentExistsException,
    DocumentNotFoundException,
    DurabilityImpossibleException,
    DurabilitySyncWriteAmbiguousException,
)
from couchbase.options import (
    DecrementOptions,
    DeltaValue,
    GetOptions,
    IncrementOptions,
    MutateInOptions,
    ReplaceOptions,
    SignedInt64,
    UpsertOptions,
)
from couchbase.transcoder import RawBinaryTranscoder
from couchbase_sdk import sdk_cluster
from helpers import NUM_VBUCKETS, run_cli, start_node, wait_converged
from test_couchbase_bootstrap import replicated_everywhere, wait_for_map
from test_permissions import PASSWORD, users_config

USERS = users_config({"app": ["read", "write"], "repl": ["replication"], "ops": ["admin"]})


def replica_login(tmp_path) -> str:
    """The [replication] section a replica logs in to its active with."""
    (tmp_path / "repl.pw").write_text(PASSWORD + "\n")
    return f'[replication]\nuser = "repl"\npassword_file = "{tmp_path / "repl.pw"}"\n'


def vbucket_status(node, vb: int) -> dict:
    return next(v for v in node.status()["buckets"][0]["vbuckets"] if v["vbucket"] == vb)


def test_every_collection_operation(tmp_path):
    node = start_node(tmp_path, "n", extra=USERS)
    try:
        cluster = sdk_cluster(node, "app", PASSWORD)
        try:
            coll = cluster.bucket("default").default_collection()
            first = coll.insert("doc", {"v": 1})
            with pytest.raises(DocumentExistsException):
                coll.insert("doc", {"v": 2})
            got = coll.get("doc")
            assert got.content_as[dict] == {"v": 1} and got.cas == first.cas
            replaced = coll.replace("doc", {"v": 3}, ReplaceOptions(cas=first.cas))
            with pytest.raises(CasMismatchException):
                coll.replace("doc", {"v": 4}, ReplaceOptions(cas=first.cas))
            with pytest.raises(DocumentNotFoundException):
                coll.replace("absent", {"v": 1})
            assert coll.get("doc").cas == replaced.cas

            coll.touch("doc", timedelta(seconds=300))
            expiry = coll.get("doc", GetOptions(with_expiry=True)).expiry_time
            assert expiry is not None and 250 < expiry.timestamp() - time.time() <= 301
            touched = coll.get_and_touch("doc", timedelta(seconds=600))
            assert touched.content_as[dict] == {"v": 3}
            expiry = coll.get("doc", GetOptions(with_expiry=True)).expiry_time
            assert 550 < expiry.timestamp() - time.time() <= 601

            # PreserveTTL: a write that asks for it keeps the document's expiry; one that does
            # not gives the document its own (none).
            def ttl(key: str) -> float | None:
                e = coll.get(key, GetOptions(with_expiry=True)).expiry_time
                return None if e is None else e.timestamp() - time.time()

            coll.upsert("doc", {"v": 5}, UpsertOptions(preserve_expiry=True))
            assert 550 < ttl("doc") <= 601
            coll.replace("doc", {"v": 6}, ReplaceOptions(preserve_expiry=True))
            coll.mutate_in("doc", [SD.upsert("w", 7)], MutateInOptions(preserve_expiry=True))
            assert 550 < ttl("doc") <= 601 and coll.get("doc").content_as[dict] == {"v": 6, "w": 7}
            coll.upsert("fresh", {"v": 1}, UpsertOptions(expiry=timedelta(seconds=120), preserve_expiry=True))
            assert 100 < ttl("fresh") <= 121  # a new document takes the expiry given
            coll.upsert("doc", {"v": 8})
            assert ttl("doc") is None

            assert coll.exists("doc").exists and not coll.exists("absent").exists
            coll.remove("doc")
            assert not coll.exists("doc").exists
            with pytest.raises(DocumentNotFoundException):
                coll.remove("doc")

            counters = coll.binary()
            made = counters.increment("hits", IncrementOptions(initial=SignedInt64(10), delta=DeltaValue(5)))
            assert made.content == 10  # created with the initial value
            assert counters.increment("hits", IncrementOptions(delta=DeltaValue(5))).content == 15
            assert counters.decrement("hits", DecrementOptions(delta=DeltaValue(20))).content == 0

            raw = RawBinaryTranscoder()
            coll.upsert("log", b"middle", UpsertOptions(transcoder=raw))
            counters.append("log", b">end")
            counters.prepend("log", b"start<")
            assert coll.get("log", GetOptions(transcoder=raw)).value == b"start<middle>end"

            # A mutation token names the vbucket, sluice's vbucket uuid and the write's seqno.
            token = coll.upsert("tok", {"t": 1}).mutation_token()
            vb = sluice.vbucket_of(b"tok", NUM_VBUCKETS)
            status = vbucket_status(node, vb)
            assert token.partition_id == vb
            assert token.partition_uuid == status["failover_uuid"]
            assert token.sequence_number == status["high_seqno"]
            assert token.bucket_name == "default"

            # Durability a single node cannot give is refused as Couchbase refuses it.
            with pytest.raises(DurabilityImpossibleException):
                coll.upsert("d", {}, UpsertOptions(durability=ServerDurability(DurabilityLevel.MAJORITY)))
        finally:
            cluster.close()
    finally:
        assert node.stop() == 0


def test_durable_writes_and_replica_reads(tmp_path):
    active = start_node(tmp_path, "a", extra=USERS)
    replica = start_node(tmp_path, "r", "--replica-of", active.address, extra=USERS + replica_login(tmp_path))
    try:
        wait_for_map(active, replicated_everywhere, user=("app", PASSWORD))
        cluster = sdk_cluster(active, "app", PASSWORD)
        try:
            coll = cluster.bucket("default").default_collection()
            levels = [
                DurabilityLevel.MAJORITY,
                DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE,
                DurabilityLevel.PERSIST_TO_MAJORITY,
            ]
            for n, level in enumerate(levels):
                key = f"durable:{n}"
                r = coll.upsert(key, {"level": n}, UpsertOptions(durability=ServerDurability(level)))
                # Acknowledged at a majority level: the replica holds it already.
                got = coll.get_any_replica(key)
                assert got.content_as[dict] == {"level": n}
                copies = coll.get_all_replicas(key)
                assert sorted(c.is_replica for c in copies) == [False, True]
                assert all(c.content_as[dict] == {"level": n} and c.cas == r.cas for c in copies)
        finally:
            cluster.close()
    finally:
        replica.stop()
        active.stop()


class SteadyWriter:
    """One thread upserting keys across every vbucket through the SDK, remembering what each
    acknowledged write left. The errors it may meet are those Couchbase documents as ambiguous
    (the write may or may not have happened: the key is then not checked until a later write
    is acknowledged) and, while a dead active is not yet failed over, timeouts and requests
    cancelled by its closed connection."""

    def __init__(self, coll, level: DurabilityLevel | None = None) -> None:
        self.coll = coll
        self.level = level
        self.acked: dict[str, int] = {}
        self.ambiguous: set[str] = set()
        self.errors: list[str] = []
        # Set by the test: from `outage_from` until `outage_until`, timeouts are expected.
        self.outage_from: float | None = None
        self.outage_until: float | None = None
        # When each acknowledgement came (monotonic), for the longest stretch without one.
        self.acked_at: list[float] = []
        # The last operations: (started, ended, key, outcome), for a failure's message.
        self.timeline: collections.deque[tuple[float, float, str, str]] = collections.deque(maxlen=400)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)
        self.thread.start()

    def in_outage(self, started: float) -> bool:
        return self.outage_from is not None and (self.outage_until is None or started < self.outage_until)

    def run(self) -> None:
        from couchbase.exceptions import (
            AmbiguousTimeoutException,
            RequestCanceledException,
            UnAmbiguousTimeoutException,
        )

        # What an operation in flight to a node that dies, or sent while it is dead, raises; a
        # durable write whose replica died under it is refused as impossible (not done).
        outage = (
            AmbiguousTimeoutException,
            RequestCanceledException,
            UnAmbiguousTimeoutException,
            DurabilityImpossibleException,
        )

        i = 0
        while not self.stop.is_set() and i < 200_000:
            key = f"steady:{i % 2000}"
            started = time.monotonic()
            level = self.level
            options = (
                UpsertOptions(durability=ServerDurability(level)) if level is not None else UpsertOptions()
            )
            outcome = "ok"
            try:
                self.coll.upsert(key, {"i": i}, options)
                self.acked[key] = i
                self.acked_at.append(time.monotonic())
                self.ambiguous.discard(key)
            except DurabilitySyncWriteAmbiguousException as e:
                self.ambiguous.add(key)
                outcome = type(e).__name__
            except outage as e:
                self.ambiguous.add(key)
                outcome = type(e).__name__
                if not self.in_outage(started):
                    self.errors.append(f"{key}: {type(e).__name__} outside an outage: {e}")
            except Exception as e:  # anything else is an error an application would see
                outcome = type(e).__name__
                self.errors.append(f"{key}: {type(e).__name__}: {e}")
            self.timeline.append((started, time.monotonic(), key, outcome))
            i += 1

    def longest_stall(self, since: float) -> float:
        """The longest stretch without an acknowledgement from `since` to the last one."""
        stamps = [since] + [t for t in self.acked_at if t > since]
        return (
            max(b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True))
            if len(stamps) > 1
            else float("inf")
        )

    def since(self, t0: float) -> str:
        """The operations that ended after `t0`, a line each (seconds from `t0`), acknowledged
        runs collapsed."""
        lines: list[str] = []
        oks = 0
        for started, ended, key, outcome in self.timeline:
            if ended < t0:
                continue
            if outcome == "ok":
                oks += 1
                continue
            if oks:
                lines.append(f"  {oks} acknowledged")
                oks = 0
            lines.append(f"  {started - t0:+.2f}..{ended - t0:+.2f} s {key}: {outcome}")
        if oks:
            lines.append(f"  {oks} acknowledged")
        return "\n".join(lines) or "  (no operation ended)"

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()

    def check(self, coll) -> None:
        """Every acknowledged write reads back (a key written ambiguously since may hold either)."""
        assert self.errors == []
        assert len(self.acked) > 100
        wrong = []
        for key, i in self.acked.items():
            if key in self.ambiguous:
                continue
            got = coll.get(key).content_as[dict]
            if got != {"i": i}:
                wrong.append((key, i, got))
        assert wrong == []


def test_a_steady_sdk_writer_rides_a_failover(tmp_path, monkeypatch):
    active = start_node(tmp_path, "a", extra=USERS)
    replica = start_node(tmp_path, "r", "--replica-of", active.address, extra=USERS + replica_login(tmp_path))
    try:
        wait_for_map(active, replicated_everywhere, user=("app", PASSWORD))
        cluster = sdk_cluster(active, "app", PASSWORD)
        try:
            coll = cluster.bucket("default").default_collection()
            monkeypatch.setenv("SLUICE_PASSWORD", PASSWORD)  # the operator's, for the CLI
            # Failover: writes acknowledged at majority survive the active's death; once the
            # replica is promoted (it has no replica of its own), writes go on at level none.
            wait_converged(active, replica)
            writer = SteadyWriter(coll, DurabilityLevel.MAJORITY)
            time.sleep(1.0)
            writer.outage_from = time.monotonic()
            active.stop(sig=9)
            writer.level = None
            promoted = run_cli("promote", "--admin", replica.admin, "--user", "ops")
            assert promoted.returncode == 0, promoted.stdout + promoted.stderr
            writer.outage_until = time.monotonic()
            before = sum(v["high_seqno"] for v in replica.status()["buckets"][0]["vbuckets"])
            deadline = time.monotonic() + 30
            while sum(v["high_seqno"] for v in replica.status()["buckets"][0]["vbuckets"]) < before + 200:
                assert time.monotonic() < deadline, "the writer never reached the promoted replica"
                time.sleep(0.2)
            writer.finish()
            writer.check(coll)
        finally:
            cluster.close()
    finally:
        replica.stop()
        active.stop()


def test_a_steady_sdk_writer_rides_a_vbucket_move(tmp_path, monkeypatch):
    """X with its replica Y; vbucket 5 moves from X to Z, a node of its own, under an SDK writer
    that bootstrapped from X alone: the writer follows X's new map to Z for vbucket 5, and only
    for it (Z's own view, every vbucket active there, never wins over the newer map)."""
    login_as = replica_login(tmp_path)
    x = start_node(tmp_path, "x", extra=USERS)
    y = start_node(tmp_path, "y", "--replica-of", x.address, extra=USERS + login_as)
    z = start_node(tmp_path, "z", extra=USERS + login_as)
    vb = 5
    try:
        wait_for_map(x, replicated_everywhere, user=("app", PASSWORD))
        cluster = sdk_cluster(x, "app", PASSWORD)
        try:
            coll = cluster.bucket("default").default_collection()
            writer = SteadyWriter(coll)
            time.sleep(1.0)
            monkeypatch.setenv("SLUICE_PASSWORD", PASSWORD)  # the operator's, for both nodes
            moved = run_cli(
                "move-vbucket",
                "--vb",
                str(vb),
                "--from",
                x.admin,
                "--to",
                z.admin,
                "--user",
                "ops",
                timeout=120,
            )
            assert moved.returncode == 0, moved.stdout + moved.stderr
            on_z = vbucket_status(z, vb)["high_seqno"]
            deadline = time.monotonic() + 30
            while vbucket_status(z, vb)["high_seqno"] < on_z + 20:
                assert time.monotonic() < deadline, "the writer never reached vbucket 5 on Z"
                time.sleep(0.2)
            time.sleep(3.0)  # past the SDK's 2.5 s map polls of both nodes
            writer.finish()
            writer.check(coll)
            written_on_z = {v["vbucket"] for v in z.status()["buckets"][0]["vbuckets"] if v["high_seqno"]}
            assert written_on_z == {vb}
        finally:
            cluster.close()
    finally:
        for node in (z, y, x):
            node.stop()


def test_range_prefix_and_sampling_scans(tmp_path):
    """The SDK's KV range scans over every vbucket: a range with its documents, a prefix with
    ids only, a sample of a given size, consistent with a mutation just made; keys written
    elsewhere, deleted or expired are not returned."""
    from couchbase.kv_range_scan import PrefixScan, RangeScan, SamplingScan, ScanTerm
    from couchbase.mutation_state import MutationState
    from couchbase.options import ScanOptions

    node = start_node(tmp_path, "n", extra=USERS)
    try:
        cluster = sdk_cluster(node, "app", PASSWORD)
        try:
            coll = cluster.bucket("default").default_collection()
            for i in range(300):
                coll.upsert(f"scan:{i:03d}", {"i": i})
            coll.upsert("other", {"i": -1})
            coll.remove("scan:150")
            coll.upsert("scan:151", {"i": 151}, UpsertOptions(expiry=timedelta(seconds=1)))
            last = coll.upsert("scan:299", {"i": 299, "again": True})
            time.sleep(2.2)

            def scanned(scan_type, **options):
                return list(coll.scan(scan_type, ScanOptions(**options)))

            got = scanned(
                RangeScan(ScanTerm("scan:100"), ScanTerm("scan:200", exclusive=True)),
                consistent_with=MutationState(last),
                batch_item_limit=7,
            )
            want = {f"scan:{i:03d}" for i in range(100, 200)} - {"scan:150", "scan:151"}
            assert sorted(r.id for r in got) == sorted(want)
            assert all(r.content_as[dict] == {"i": int(r.id[5:])} for r in got)
            assert all(not r.ids_only and r.cas for r in got)

            ids = scanned(PrefixScan("scan:2"), ids_only=True)
            assert sorted(r.id for r in ids) == [f"scan:{i}" for i in range(200, 300)]
            assert all(r.ids_only for r in ids)

            sample = scanned(SamplingScan(40, seed=7))
            assert len(sample) == 40 and len({r.id for r in sample}) == 40
            docs = {f"scan:{i:03d}" for i in range(300)} - {"scan:150", "scan:151"} | {"other"}
            assert {r.id for r in sample} <= docs
        finally:
            cluster.close()
    finally:
        assert node.stop() == 0
