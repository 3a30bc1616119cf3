"""Couchbase's own Python SDK (`couchbase` on PyPI, Couchbase's C++ core underneath) against
`sluice serve`, unchanged: it bootstraps (error map, cluster map), writes and reads the default
collection, and follows the map to a promoted replica."""

from __future__ import annotations

import time

import pytest
from couchbase.exceptions import DocumentNotFoundException
from couchbase_sdk import sdk_cluster
from helpers import run_cli, start_node, wait_converged
from test_couchbase_bootstrap import replicated_everywhere, wait_for_map
from test_permissions import PASSWORD, users_config


def test_the_sdk_bootstraps_and_round_trips_documents(tmp_path):
    node = start_node(tmp_path, "n", extra=users_config({"app": ["read", "write"]}))
    try:
        cluster = sdk_cluster(node, "app", PASSWORD)
        try:
            coll = cluster.bucket("default").default_collection()
            docs = {f"user::{i}": {"name": f"user {i}", "n": i} for i in range(50)}
            for key, doc in docs.items():
                coll.upsert(key, doc)
            for key, doc in docs.items():
                assert coll.get(key).content_as[dict] == doc
            coll.remove("user::7")
            with pytest.raises(DocumentNotFoundException):
                coll.get("user::7")
        finally:
            cluster.close()
        assert "Failed to connect" not in node.log()
    finally:
        node.stop()


def test_the_sdk_follows_the_map_to_a_promoted_replica(tmp_path):
    users = users_config({"app": ["read", "write"], "repl": ["replication"]})
    (tmp_path / "repl.pw").write_text(PASSWORD + "\n")
    login_as = f'[replication]\nuser = "repl"\npassword_file = "{tmp_path / "repl.pw"}"\n'
    active = start_node(tmp_path, "a", extra=users)
    replica = start_node(tmp_path, "r", "--replica-of", active.address, extra=users + login_as)
    try:
        # A client finds the replica in the active's map once the replica streams from it; one
        # that only ever knew the active has nowhere to go when it dies.
        wait_for_map(active, replicated_everywhere, user=("app", PASSWORD))
        cluster = sdk_cluster(active, "app", PASSWORD)
        try:
            coll = cluster.bucket("default").default_collection()
            for i in range(20):
                coll.upsert(f"k{i}", {"i": i})
            wait_converged(active, replica)
            # Failover: the active dies, the replica is promoted; the SDK, which bootstrapped
            # from the active, finds the replica in the map and its new map (rev raised).
            active.stop(sig=9)
            token = str(tmp_path / "r" / "admin.token")
            promoted = run_cli("promote", "--admin", replica.admin, "--token-file", token)
            assert promoted.returncode == 0, promoted.stderr + promoted.stdout
            deadline = time.monotonic() + 30
            while True:
                try:
                    assert coll.get("k3").content_as[dict] == {"i": 3}
                    break
                except AssertionError:
                    raise
                except Exception:
                    assert time.monotonic() < deadline, "the SDK never reached the promoted replica"
                    time.sleep(0.5)
            coll.upsert("after", {"ok": True})
            assert coll.get("after").content_as[dict] == {"ok": True}
        finally:
            cluster.close()
    finally:
        replica.stop()
        active.stop()
