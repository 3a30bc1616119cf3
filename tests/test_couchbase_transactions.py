"""Couchbase's distributed ACID transactions, run by its Python SDK against an active with a
replica: the SDK stages each change in the document's extended attributes, records the
attempt in an active transaction record (ATR), and commits or rolls back with sub-document
commands (doc flags, macros, REPLACE_BODY_WITH_XATTR). What the tests look at is what an
application sees: balances after commits, rollbacks and conflicts, and no staged change left
behind once the SDK's cleanup has finished a transaction cut short by a killed active."""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta

import couchbase.subdocument as SD
import pytest
from couchbase.exceptions import PathNotFoundException, TransactionFailed
from couchbase.options import TransactionConfig, TransactionOptions
from couchbase.transactions import TransactionKeyspace
from couchbase_sdk import sdk_cluster
from helpers import run_cli, start_node, wait_converged
from test_couchbase_bootstrap import replicated_everywhere, wait_for_map
from test_couchbase_sdk_kv import USERS, replica_login
from test_permissions import PASSWORD


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """An active and its replica, the SDK's map naming the replica for every vbucket; fault
    injection on (`Node.inject`)."""
    monkeypatch.setenv("SLUICE_ERRINJ", "")
    active = start_node(tmp_path, "a", extra=USERS)
    replica = start_node(tmp_path, "r", "--replica-of", active.address, extra=USERS + replica_login(tmp_path))
    try:
        wait_for_map(active, replicated_everywhere, user=("app", PASSWORD))
        yield active, replica
    finally:
        replica.stop()
        active.stop()


def staged(coll, key: str) -> bool:
    """Whether `key` still carries a transaction's staged change (its `txn` attribute)."""
    try:
        coll.lookup_in(key, [SD.get("txn", xattr=True)], access_deleted=True).content_as[dict](0)
    except PathNotFoundException:
        return False
    return True


def test_transactions_commit_roll_back_and_serialize_on_one_document(pair):
    active, replica = pair
    cluster = sdk_cluster(active, "app", PASSWORD)
    try:
        coll = cluster.bucket("default").default_collection()
        # Two accounts in different vbuckets (the SDK's key hashing differs for these).
        coll.upsert("alice", {"balance": 100})
        coll.upsert("bob", {"balance": 0})
        coll.upsert("old-receipt", {"amount": 1})

        def move(ctx):
            a, b = ctx.get(coll, "alice"), ctx.get(coll, "bob")
            ctx.replace(a, {"balance": a.content_as[dict]["balance"] - 30})
            ctx.replace(b, {"balance": b.content_as[dict]["balance"] + 30})
            ctx.insert(coll, "receipt", {"amount": 30})
            ctx.remove(ctx.get(coll, "old-receipt"))

        result = cluster.transactions.run(move)
        assert result.unstaging_complete
        assert coll.get("alice").content_as[dict] == {"balance": 70}
        assert coll.get("bob").content_as[dict] == {"balance": 30}
        assert coll.get("receipt").content_as[dict] == {"amount": 30}
        assert not coll.exists("old-receipt").exists
        assert not any(staged(coll, k) for k in ("alice", "bob", "receipt"))
        # Committed at majority: the replica holds it.
        wait_converged(active, replica)
        assert coll.get_any_replica("alice").content_as[dict] == {"balance": 70}

        # An exception in the logic rolls everything back: nothing changed, nothing staged.
        def fail(ctx):
            a = ctx.get(coll, "alice")
            ctx.replace(a, {"balance": 0})
            ctx.insert(coll, "never", {"x": 1})
            raise RuntimeError("the application changes its mind")

        with pytest.raises(TransactionFailed):
            cluster.transactions.run(fail)
        assert coll.get("alice").content_as[dict] == {"balance": 70}
        assert not coll.exists("never").exists
        assert not staged(coll, "alice")

        # Two threads each add 1 to one document ten times, transactionally. A transaction
        # that stages after the other changed the document meets its CAS, or finds it staged by
        # the other for longer than the SDK waits: the Python SDK ends that attempt
        # (TransactionFailed, its staging rolled back; unlike the C++ and Java SDKs it does not
        # retry the logic itself), and the application runs it again. No increment is lost or
        # doubled.
        coll.upsert("counter", {"n": 0})
        errors: list[BaseException] = []
        conflicts = []

        def bump(ctx):
            d = ctx.get(coll, "counter")
            ctx.replace(d, {"n": d.content_as[dict]["n"] + 1})

        def worker():
            try:
                for _ in range(10):
                    for _ in range(100):
                        try:
                            cluster.transactions.run(bump, TransactionOptions(timeout=timedelta(seconds=30)))
                            break
                        except TransactionFailed as e:
                            if not any(c in str(e) for c in CONFLICTS):
                                raise
                            conflicts.append(e)
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                errors.append(e)

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert errors == [] and not any(t.is_alive() for t in threads)
        assert coll.get("counter").content_as[dict] == {"n": 20}
        assert not staged(coll, "counter")
    finally:
        cluster.close()


# The causes of a TransactionFailed that another transaction on the same document gives: a CAS
# that moved under the staging, or the document staged by the other (a write-write conflict).
CONFLICTS = ("cas_mismatch", "document is in another transaction")


def test_a_commit_cut_by_a_killed_active_is_finished_by_cleanup_after_promotion(pair, tmp_path, monkeypatch):
    """The active dies while the SDK unstages a committed transaction (its ATR says COMMITTED,
    some documents hold their new body, the others still their staged one). The replica held
    all of it (majority writes) and is promoted, and a new node replicates it (the cleanup
    writes at the transaction's own level, majority, which a lone node refuses as Couchbase
    does). The SDK's cleanup of lost transactions, running against them, finishes the commit:
    every document has its new body, none is left staged."""
    active, replica = pair
    keys = [f"acct:{i}" for i in range(100)]
    cluster = sdk_cluster(active, "app", PASSWORD)
    try:
        coll = cluster.bucket("default").default_collection()
        for k in keys:
            coll.upsert(k, {"v": 0})
        wait_converged(active, replica)

        # The staging done, the active is set to kill itself (SIGKILL) at its 11th write from
        # then: the commit's ATR record is the first, which the SDK has at majority (on the
        # replica) before it unstages any document, and the 11th is one of the documents
        # unstaged. What is applied streams to the replica at once, so a kill from outside,
        # however quick, could find the whole commit there.
        def logic(ctx):
            for k in keys:
                ctx.replace(ctx.get(coll, k), {"v": 1})
            active.inject("kill_at_write", 11)

        try:
            cluster.transactions.run(logic, TransactionOptions(timeout=timedelta(seconds=10)))
        except Exception:  # noqa: BLE001 - the commit's end is cut off: an error, or not
            pass
        assert active.proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        cluster.close()

    monkeypatch.setenv("SLUICE_PASSWORD", PASSWORD)
    promoted = run_cli("promote", "--admin", replica.admin, "--user", "ops")
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    login_as = USERS + replica_login(tmp_path)
    spare = start_node(tmp_path, "spare", "--replica-of", replica.address, extra=login_as)
    survivor = None
    try:
        wait_for_map(replica, replicated_everywhere, user=("app", PASSWORD))
        cleanup = TransactionConfig(
            cleanup_window=timedelta(seconds=2),
            metadata_collection=TransactionKeyspace(
                bucket="default", scope="_default", collection="_default"
            ),
        )
        survivor = sdk_cluster(replica, "app", PASSWORD, transactions=cleanup)
        coll = survivor.bucket("default").default_collection()
        left = [k for k in keys if staged(coll, k)]
        assert left, "the kill came after the whole commit: nothing for cleanup to do"
        # The cleanup thread starts with the SDK's transactions; it finds the expired attempt.
        survivor.transactions  # noqa: B018 - starts the lost-attempt cleanup
        deadline = time.monotonic() + 90
        while any(staged(coll, k) for k in left):
            assert time.monotonic() < deadline, [k for k in left if staged(coll, k)][:5]
            time.sleep(0.5)
        assert all(coll.get(k).content_as[dict] == {"v": 1} for k in keys)
    finally:
        if survivor is not None:
            survivor.close()
        spare.stop()
