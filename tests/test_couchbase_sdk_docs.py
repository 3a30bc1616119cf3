"""The official Couchbase Python SDK's document operations against `sluice serve`: exists
(GET_META), get with expiry (a sub-document lookup of `$document.exptime`), lookup_in,
mutate_in, get_and_lock / unlock, get_any_replica."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from couchbase_sdk import sdk_cluster
from helpers import Node, write_users_config


@pytest.fixture
def collection(tmp_path):
    """The default collection of a node with users, through the SDK (user ada, read and write)."""
    users = tmp_path / "users.toml"
    write_users_config(users, '["read"]')
    node = Node(tmp_path / "n", "--config", str(users))
    try:
        cluster = sdk_cluster(node, "ada", "ada-secret", ["PLAIN"])
        try:
            yield cluster.bucket("default").default_collection()
        finally:
            cluster.close()
    finally:
        assert node.stop() == 0


def test_exists_and_get_with_expiry(collection):
    from couchbase.options import GetOptions, UpsertOptions

    collection.upsert("doc", {"a": 1}, UpsertOptions(expiry=timedelta(seconds=1000)))
    assert collection.exists("doc").exists
    assert not collection.exists("never").exists
    collection.upsert("gone", {"x": 1})
    collection.remove("gone")
    assert not collection.exists("gone").exists, "a tombstone does not exist"
    r = collection.get("doc", GetOptions(with_expiry=True))
    assert r.content_as[dict] == {"a": 1}
    assert abs(r.expiry_time.timestamp() - (time.time() + 1000)) < 60


def test_lookup_in_and_mutate_in(collection):
    import couchbase.subdocument as SD
    from couchbase.exceptions import PathExistsException

    collection.upsert("doc", {"a": 1, "b": [1, 2], "c": {"d": "x"}})
    r = collection.lookup_in("doc", [SD.get("c.d"), SD.exists("b"), SD.exists("nope"), SD.count("b")])
    assert r.content_as[str](0) == "x"
    assert r.exists(1) and not r.exists(2)
    assert r.content_as[int](3) == 2
    m = collection.mutate_in("doc", [SD.upsert("e", 5), SD.increment("a", 10), SD.array_append("b", 3)])
    assert m.content_as[int](1) == 11
    assert m.mutation_token() is not None
    with pytest.raises(PathExistsException):
        collection.mutate_in("doc", [SD.upsert("f", 1), SD.insert("e", 6)])
    assert collection.get("doc").content_as[dict] == {"a": 11, "b": [1, 2, 3], "c": {"d": "x"}, "e": 5}


def test_get_and_lock_then_unlock(collection):
    from couchbase.exceptions import DocumentLockedException

    collection.upsert("lk", {"v": 0})
    locked = collection.get_and_lock("lk", timedelta(seconds=10))
    with pytest.raises(DocumentLockedException):
        collection.upsert("lk", {"v": 1}, timeout=timedelta(seconds=1))
    collection.unlock("lk", locked.cas)
    collection.upsert("lk", {"v": 2})
    assert collection.get("lk").content_as[dict] == {"v": 2}


def test_get_any_replica_reads_the_document(collection):
    collection.upsert("rep", {"v": 1})
    assert collection.get_any_replica("rep").content_as[dict] == {"v": 1}
