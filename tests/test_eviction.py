"""Eviction end to end: a `sluice serve` whose default bucket has a 4 MiB quota and
`eviction = "lru"` takes a write load of four times its quota over the binary protocol. Every
write is acknowledged (one refused with TMPFAIL while checkpoints still hold the room evictions
free is retried, as a client would), memory stays under the quota, /metrics and STAT count the evictions, a
DCP stream sees the evicted keys as deletions, and neither a graceful restart nor kill -9
brings an evicted key back."""

from __future__ import annotations

import socket
import time

from dcp_wire import DELETION, MUTATION, STREAM_END, DcpConnection, stream_req
from helpers import NUM_VBUCKETS, Node, node_config, run_cli
from mcbp_wire import SET, STAT, get_many, read_response, request, set_extras

TMPFAIL = 0x86
QUOTA = 4 << 20
VALUE = b"v" * 1024
WRITES = 4 * QUOTA // len(VALUE)
BATCH = 256


def write_load(node: Node, keys: list[bytes]) -> None:
    """Pipelined SETs as a memcached client sends them to a busy node: a write refused with
    TMPFAIL (the room evictions free is still held by checkpoints the WAL writer or a replica's
    stream has not passed yet) is sent again shortly after. Every other answer must be SUCCESS,
    every write succeeds within 30 s, and memory checked after each batch stays under the
    quota."""
    deadline = time.monotonic() + 30
    with socket.create_connection((node.host, node.port), timeout=60) as s:
        for at in range(0, len(keys), BATCH):
            chunk = keys[at : at + BATCH]
            while chunk:
                s.sendall(
                    b"".join(request(SET, k, VALUE, set_extras(), opaque=i) for i, k in enumerate(chunk))
                )
                statuses = [read_response(s)["status"] for _ in chunk]
                assert set(statuses) <= {0, TMPFAIL}, f"refused at write {at}: {set(statuses)}"
                chunk = [k for k, st in zip(chunk, statuses, strict=True) if st == TMPFAIL]
                assert time.monotonic() < deadline, f"{len(chunk)} writes still refused at write {at}"
                if chunk:
                    time.sleep(0.05)
            used = node.metric("sluice_memory_bytes", bucket="default", kind="used")
            assert used <= QUOTA, f"{used} bytes used after {at + BATCH} writes"


def binary_stats(node: Node) -> dict[str, str]:
    with socket.create_connection((node.host, node.port), timeout=10) as s:
        s.sendall(request(STAT))
        stats = {}
        while (r := read_response(s))["key"]:
            stats[r["key"].decode()] = r["value"].decode()
    return stats


def dcp_current_versions(node: Node) -> dict[bytes, int]:
    """Each key's current version as a DCP stream of every vbucket from 0 gives it:
    key -> MUTATION or DELETION opcode."""
    seen: dict[bytes, int] = {}
    c = DcpConnection(node.host, node.port, name=b"eviction-check")
    try:
        for vb, high in enumerate(node.seqnos()):
            if high == 0:
                continue
            assert c.call(stream_req(vb, 0, high))["word"] == 0
            for m in c.collect(lambda ms: ms and ms[-1]["op"] == STREAM_END):
                if m["op"] in (MUTATION, DELETION):
                    seen[m["key"]] = m["op"]
    finally:
        c.close()
    return seen


def test_an_lru_bucket_evicts_under_a_load_past_its_quota_and_evictions_stay(tmp_path):
    config = node_config(tmp_path, "cache", memory_quota=QUOTA, eviction="lru")
    data_dir = tmp_path / "cache"
    keys = [b"key-%06d" % i for i in range(WRITES)]
    node = Node(data_dir, "--config", str(config))
    try:
        write_load(node, keys)
        evictions = node.metric("sluice_evictions_total", bucket="default")
        assert evictions > WRITES / 2, evictions
        assert int(binary_stats(node)["evictions"]) == evictions
        r = run_cli("status", "--admin", node.admin)
        assert r.returncode == 0, r.stderr
        assert f"eviction lru, {int(evictions):,} evicted" in r.stdout

        readable = set(get_many(node.host, node.port, keys))
        evicted = set(keys) - readable
        assert len(evicted) == evictions, "each missing key was evicted once, and counted"
        # The most recent writes are the ones kept.
        assert set(keys[-200:]) <= readable

        # DCP: evicted keys stream as deletions, kept keys as mutations (a deletion's tombstone
        # may have been purged since: then the key does not appear at all).
        streamed = dcp_current_versions(node)
        deleted = {k for k, op in streamed.items() if op == DELETION}
        assert deleted and deleted <= evicted, (len(deleted), len(evicted))
        assert {k for k, op in streamed.items() if op == MUTATION} == readable
        assert len(node.seqnos()) == NUM_VBUCKETS
    finally:
        assert node.stop() == 0

    # A graceful restart recovers the evictions from the WAL and snapshot.
    node = Node(data_dir, "--config", str(config))
    try:
        assert set(get_many(node.host, node.port, keys)) == readable
        # More writes evict more (some of these keys, some of the new ones) ...
        more = [b"more-%06d" % i for i in range(WRITES // 4)]
        write_load(node, more)
        assert node.metric("sluice_evictions_total", bucket="default") > 0
        before = readable
        readable = set(get_many(node.host, node.port, keys + more))
        assert readable & set(keys) < before, "older keys made room for the new ones"
    finally:
        # ... and kill -9 straight after their acknowledgements loses none of those evictions.
        node.stop(sig=9)
    node = Node(data_dir, "--config", str(config))
    try:
        assert set(get_many(node.host, node.port, keys + more)) == readable
    finally:
        assert node.stop() == 0


def test_a_replica_follows_the_evictions_of_its_active(tmp_path):
    """Evictions stream as deletions: a replica of an lru bucket (same quota) ends with the
    active's keys exactly, and evicts nothing of its own."""
    from helpers import contents, start_node, wait_converged

    active = start_node(tmp_path, "active", memory_quota=QUOTA, eviction="lru")
    replica = None
    try:
        replica = start_node(
            tmp_path, "replica", "--replica-of", active.address, memory_quota=QUOTA, eviction="lru"
        )
        keys = [b"key-%06d" % i for i in range(WRITES)]
        write_load(active, keys)
        assert active.metric("sluice_evictions_total", bucket="default") > WRITES / 2
        wait_converged(active, replica)
        # Live items match exactly. Tombstones need not: each node purges its own when they
        # crowd its memory, so the replica may keep some the active already dropped.
        ours, theirs = contents(active), contents(replica)
        live = {key: v for key, v in ours.items() if v[1] == "mutation"}
        assert live == {key: v for key, v in theirs.items() if v[1] == "mutation"}
        assert {k for (_, k) in live} == set(get_many(active.host, active.port, keys))
        for key, v in ours.items():
            if v[1] == "deletion":
                assert theirs.get(key) == v, f"{key} is deleted on the active, not on the replica"
        assert replica.metric("sluice_evictions_total", bucket="default") == 0
        assert replica.metric("sluice_memory_bytes", bucket="default", kind="used") <= QUOTA
    finally:
        if replica is not None:
            replica.stop()
        active.stop()
