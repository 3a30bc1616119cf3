"""Replication between real `sluice serve` processes on 127.0.0.1: a replica following its
active over DCP, failover by promotion, the old active's rejoin with rollback, durable writes at
majority, and a proxy injecting network faults between the two."""

from __future__ import annotations

import random
import re
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import bmemcached
import pytest
import sluice
from fault_proxy import FaultProxy
from helpers import (
    NO_DEFAULT_PORTS,
    NUM_VBUCKETS,
    Node,
    contents,
    node_config,
    run_cli,
    start_node,
    wait_converged,
)
from mcbp_wire import (
    FLUSH,
    GET,
    GET_REPLICA,
    HELLO,
    NOOP,
    SET,
    connect,
    durability_framing,
    flex_request,
    read_response,
    request,
    set_extras,
)


def get_replica(sock: socket.socket, key: bytes) -> dict:
    sock.sendall(request(GET_REPLICA, key=key))
    return read_response(sock)


def wait_stopped(pid: int) -> None:
    """Waits until every thread of `pid` is stopped: a SIGSTOP reaches a busy thread late."""
    deadline = time.monotonic() + 10
    while True:
        states = [
            (t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()
        ]
        if all(s == "T" for s in states):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.01)


def majority_set(
    sock: socket.socket, key: bytes, value: bytes, timeout_ms: int | None = None, level: int = 1
) -> int:
    """SET with the durability frame info (level 1 majority, 2 majority and persist on the
    active, 3 persist to majority); returns the status."""
    sock.sendall(flex_request(SET, durability_framing(level, timeout_ms), key, value, set_extras()))
    return read_response(sock)["status"]


def until_majority_is_met(sock: socket.socket, key: bytes) -> None:
    """Retries a majority SET until a replica follows and acknowledges it (within 30 s)."""
    deadline = time.monotonic() + 30
    while majority_set(sock, key, b"v") != 0:
        assert time.monotonic() < deadline, "no replica acknowledged a majority write"
        time.sleep(0.05)


def plain_sets_behind(n: int = 8) -> bytes:
    """`n` pipelined plain SETs of behind0.. with opaques 2.., to follow a held write (opaque 1)."""
    return b"".join(request(SET, f"behind{i}".encode(), b"x", set_extras(), opaque=2 + i) for i in range(n))


def test_a_replica_converges_under_overwrites_and_deletes(tmp_path):
    active = start_node(tmp_path, "a")
    replica = start_node(tmp_path, "b", "--replica-of", active.address)
    try:
        rng = random.Random(5)
        c = bmemcached.Client([active.address])
        keys = [f"key:{i}" for i in range(40_000)]
        written = 0
        while written < 200_000:
            batch = {rng.choice(keys): f"v{written + j}".encode() * rng.randint(1, 8) for j in range(500)}
            c.set_multi(batch)
            written += len(batch)
            if written % 10_000 < 500:
                c.delete_multi(rng.sample(keys, 200))
                written += 200
        wait_converged(active, replica)
        a, b = contents(active), contents(replica)
        assert len(a) > 30_000
        assert a == b
        # The replica serves reads of its vbuckets with GET_REPLICA; writes and plain reads
        # belong to the active.
        s = connect(replica)
        live = next(k for k, v in a.items() if v[1] == "mutation")
        r = get_replica(s, live[1])
        assert r["status"] == 0 and r["value"] == a[live][2]
        s.sendall(request(GET, key=live[1]))
        assert read_response(s)["status"] == 0x07
        s.sendall(request(SET, key=b"x", value=b"y", extras=set_extras()))
        assert read_response(s)["status"] == 0x07
        st = replica.status()
        assert st["replication"]["replica_of"] == active.address
        assert st["replication"]["buckets"][0]["connected"]
        assert 'sluice_replica_lag_seqnos{bucket="default",vbucket="0"} 0' in replica.metrics()
        followers = active.status()["buckets"][0]["vbuckets"][0]["followers"]
        assert len(followers) == 1
        out = run_cli("status", "--admin", replica.admin)
        assert out.returncode == 0 and f"replica of {active.address}" in out.stdout, out
        assert "lag 0 seqnos" in out.stdout
        out = run_cli("status", "--admin", active.admin)
        assert "role: active" in out.stdout and "acked" in out.stdout, out.stdout
    finally:
        replica.stop()
        active.stop()


def test_a_chain_and_a_restarted_replica_resume_without_a_full_resync(tmp_path):
    active = start_node(tmp_path, "a")
    middle = start_node(tmp_path, "b", "--replica-of", active.address)
    tail = start_node(tmp_path, "c", "--replica-of", middle.address)
    try:
        c = bmemcached.Client([active.address])
        c.set_multi({f"k{i}": b"one" for i in range(5000)})
        wait_converged(active, middle)
        wait_converged(middle, tail)
        sent_before = active.metric_sum("sluice_dcp_items_total")
        middle.stop()
        c.set_multi({f"k{i}": b"two" for i in range(0, 5000, 2)})
        # Back on the same address, so the tail finds it again.
        middle = start_node(tmp_path, "b", "--replica-of", active.address, "--listen", middle.address)
        wait_converged(active, middle)
        wait_converged(middle, tail)
        # Only the new changes crossed the wire again: the restarted replica resumed from its
        # own WAL, not from zero.
        assert active.metric_sum("sluice_dcp_items_total") - sent_before <= 2500
        assert contents(active) == contents(tail)
    finally:
        for n in (tail, middle, active):
            n.stop()


def test_faults_between_active_and_replica(tmp_path):
    active = start_node(tmp_path, "a")
    proxy = FaultProxy(active.address)
    replica = start_node(tmp_path, "b", "--replica-of", proxy.address)
    stop = threading.Event()
    try:
        c = bmemcached.Client([active.address])
        c.set_multi({f"base{i}": b"x" * 100 for i in range(20_000)})
        wait_converged(active, replica)

        written = [20_000]

        def load() -> None:
            rng = random.Random(9)
            n = 0
            while not stop.is_set() and n < 150_000:
                batch = {f"k{rng.randrange(30_000)}": f"{n}-{j}".encode() for j in range(200)}
                c.set_multi(batch)
                n += len(batch)
                written[0] += len(batch)
                time.sleep(0.005)

        t = threading.Thread(target=load)
        t.start()
        done = proxy.chaos(random.Random(3), 12)
        stop.set()
        t.join()
        assert {"stall", "drop", "cut"} <= set(done) or len(done) >= 6, done
        wait_converged(active, replica, timeout=90)
        # Resumed where it stood each time: the active sent at most what was written (less,
        # deduplicated), plus partial snapshots again. A single full resync would add the
        # whole bucket (50,000 keys).
        sent = active.metric_sum("sluice_dcp_items_total")
        assert sent < written[0] + 25_000, (sent, written[0])
        assert replica.metric_sum("sluice_replica_connects_total") >= 2
        assert replica.metric_sum("sluice_replica_rollbacks_total") == 0
        assert contents(active) == contents(replica)
    finally:
        stop.set()
        proxy.close()
        replica.stop()
        active.stop()


def test_majority_writes_survive_a_kill_of_the_active(tmp_path):
    active = start_node(tmp_path, "a", durability_timeout="5s")
    replica = start_node(tmp_path, "b", "--replica-of", active.address)
    acked: list[bytes] = []
    stop = threading.Event()
    try:
        # Before a replica follows, majority is impossible; with one, it is met.
        s = connect(active)
        until_majority_is_met(s, b"probe")

        def writer(n: int) -> None:
            w = connect(active)
            i = 0
            while not stop.is_set():
                key = f"w{n}:{i}".encode()
                try:
                    st = majority_set(w, key, key * 3)
                except OSError:
                    return
                if st == 0:
                    acked.append(key)
                i += 1

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        active.stop(sig=9)
        stop.set()
        for t in threads:
            t.join()
        assert len(acked) > 500
        out = run_cli("promote", "--admin", replica.admin)
        assert out.returncode == 0 and "promoted to active" in out.stdout, out
        s = connect(replica)
        missing = []
        for k in acked:
            s.sendall(request(GET, key=k))
            r = read_response(s)
            if r["status"] != 0 or r["value"] != k * 3:
                missing.append((k, r["status"]))
        assert missing == []
        # The promoted node takes writes.
        assert bmemcached.Client([replica.address]).set("after", "failover")
    finally:
        stop.set()
        replica.stop()
        active.stop(sig=9)


def test_durability_impossible_and_ambiguous(tmp_path):
    active = start_node(tmp_path, "a", replicas=1)
    try:
        s = connect(active)
        assert majority_set(s, b"k", b"v") == 0xA1  # no replica follows
        replica = start_node(tmp_path, "b", "--replica-of", active.address)
        until_majority_is_met(s, b"k")
        for level in (2, 3):
            assert majority_set(s, f"level{level}".encode(), b"v", level=level) == 0
        assert majority_set(s, b"k", b"v", level=4) == 0xA0  # no such level
        replica.proc.send_signal(19)  # SIGSTOP: follows on paper, acknowledges nothing
        try:
            wait_stopped(replica.proc.pid)
            t0 = time.monotonic()
            assert majority_set(s, b"k2", b"v", timeout_ms=300) == 0xA3
            assert 0.25 < time.monotonic() - t0 < 5
        finally:
            replica.proc.send_signal(18)  # SIGCONT
        replica.stop()
    finally:
        active.stop()


def test_a_durability_requirement_on_a_command_that_cannot_meet_one_is_refused(tmp_path):
    """FLUSH, GET and NOOP with a durability frame info get EINVAL (as Couchbase's servers
    answer), and are not carried out without it."""
    node = start_node(tmp_path, "a")
    try:
        s = connect(node)
        s.sendall(request(SET, b"k", b"v", set_extras()))
        assert read_response(s)["status"] == 0
        for opcode, key in ((FLUSH, b""), (GET, b"k"), (NOOP, b"")):
            s.sendall(flex_request(opcode, durability_framing(1), key, b"", b""))
            got = read_response(s)
            assert got["status"] == 0x04, (hex(opcode), got)
            assert b"does not support durability" in got["value"]
        s.sendall(request(GET, b"k"))
        assert read_response(s)["value"] == b"v"  # the refused FLUSH flushed nothing
        s.close()
    finally:
        node.stop()


def test_persist_to_majority_is_acknowledged_once_the_replica_synced_the_write(tmp_path):
    """In `wal.mode = write` a replica's WAL is not synced by itself: a persist_to_majority
    write waits until the replica synced it, not only wrote it."""
    active = start_node(tmp_path, "a", replicas=1)
    replica = start_node(tmp_path, "b", "--replica-of", active.address)
    try:
        s = connect(active)
        until_majority_is_met(s, b"k")
        assert majority_set(s, b"k", b"v", level=1) == 0  # majority: held there, not synced
        written_before = replica.metric("sluice_wal_lsn", kind="written")
        assert majority_set(s, b"persisted", b"v", level=3) == 0
        # The replica's record of the write is newer than anything it wrote before it.
        assert replica.metric("sluice_wal_lsn", kind="synced") > written_before
        assert replica.metric("sluice_wal_sync_seconds_count") >= 1
        s.close()
    finally:
        replica.stop()
        active.stop()


def test_a_held_durable_write_does_not_hold_up_the_requests_behind_it(tmp_path):
    """A majority SET that cannot be acknowledged (the replica is stopped) waits for its
    timeout, but the plain SETs pipelined behind it on the same connection are applied at once
    (another client reads them meanwhile); the replies still come in request order."""
    active = start_node(tmp_path, "a", replicas=1)
    replica = start_node(tmp_path, "b", "--replica-of", active.address)
    try:
        s = connect(active)
        until_majority_is_met(s, b"warm")
        replica.proc.send_signal(19)  # SIGSTOP
        try:
            wait_stopped(replica.proc.pid)
            framing = durability_framing(1, 3000)  # majority, 3 s
            s.sendall(flex_request(SET, framing, b"held", b"v", set_extras(), opaque=1) + plain_sets_behind())
            t0 = time.monotonic()
            reader = bmemcached.Client([active.address])
            while reader.get("behind7") not in (b"x", "x"):
                assert time.monotonic() - t0 < 1.5, "the requests behind the held write were not applied"
                time.sleep(0.02)
            applied_after = time.monotonic() - t0
            replies = [read_response(s) for _ in range(9)]
            answered_after = time.monotonic() - t0
        finally:
            replica.proc.send_signal(18)  # SIGCONT
        assert [r["opaque"] for r in replies] == list(range(1, 10))
        assert replies[0]["status"] == 0xA3  # ambiguous: not acknowledged in time
        assert all(r["status"] == 0 for r in replies[1:])
        # The replica's silence ends the held write (its timeout, or the replica dropped for
        # missing NOOPs): well after the requests behind it were applied.
        assert answered_after > applied_after + 0.5
        replica.stop()
    finally:
        active.stop()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_replies_queued_behind_a_held_write_are_bounded_in_memory(tmp_path):
    """GETs of a 1 MiB value pipelined behind a durable write that cannot be acknowledged:
    their replies cannot be sent before it, and the server stops reading once a few MiB of
    them wait, instead of holding all 100 MiB."""
    active = start_node(tmp_path, "a", replicas=1)
    replica = start_node(tmp_path, "b", "--replica-of", active.address)
    try:
        s = connect(active)
        until_majority_is_met(s, b"warm")
        big = b"x" * (1 << 20)
        s.sendall(request(SET, b"big", big, set_extras()))
        assert read_response(s)["status"] == 0
        before = rss_bytes(active.proc.pid)
        replica.proc.send_signal(19)  # SIGSTOP
        try:
            wait_stopped(replica.proc.pid)
            gets = b"".join(request(GET, b"big", opaque=2 + i) for i in range(100))
            s.sendall(
                flex_request(SET, durability_framing(1, 3000), b"held", b"v", set_extras(), opaque=1) + gets
            )
            time.sleep(1.0)  # the held write waits; the server reads what it may meanwhile
            grown = rss_bytes(active.proc.pid) - before
        finally:
            replica.proc.send_signal(18)  # SIGCONT
        assert grown < 40 << 20, f"{grown >> 20} MiB held for the replies behind the write"
        replies = [read_response(s) for _ in range(101)]
        assert [r["opaque"] for r in replies] == list(range(1, 102))
        assert replies[0]["status"] in (0, 0xA3)
        assert all(r["status"] == 0 and r["value"] == big for r in replies[1:])
        replica.stop()
    finally:
        active.stop()


def test_a_client_that_allows_unordered_execution_gets_a_held_writes_reply_last(tmp_path):
    """HELLO UnorderedExecution (0x0e), as Couchbase's SDKs send it: a majority SET that waits
    (the replica is stopped) no longer holds back the replies of the SETs behind it; its own
    comes when it is settled. A client that did not ask keeps its replies in request order."""
    active = start_node(tmp_path, "a", replicas=1)
    replica = start_node(tmp_path, "b", "--replica-of", active.address)
    try:
        unordered, ordered = connect(active), connect(active)
        unordered.sendall(request(HELLO, b"test", struct.pack(">HH", 0x0E, 0x10)))
        assert read_response(unordered)["value"] == struct.pack(">HH", 0x0E, 0x10)
        ordered.sendall(request(HELLO, b"test", struct.pack(">H", 0x10)))
        assert read_response(ordered)["value"] == struct.pack(">H", 0x10)
        until_majority_is_met(unordered, b"warm")
        replica.proc.send_signal(19)  # SIGSTOP
        try:
            wait_stopped(replica.proc.pid)
            framing = durability_framing(1, 2000)  # majority, 2 s
            behind = plain_sets_behind()
            for s in (unordered, ordered):
                s.sendall(flex_request(SET, framing, b"held", b"v", set_extras(), opaque=1) + behind)
            first = read_response(unordered)
            answered = [first] + [read_response(unordered) for _ in range(8)]
            in_order = [read_response(ordered) for _ in range(9)]
        finally:
            replica.proc.send_signal(18)  # SIGCONT
        assert [r["opaque"] for r in answered] == list(range(2, 10)) + [1]
        assert answered[-1]["status"] == 0xA3 and all(r["status"] == 0 for r in answered[:-1])
        assert [r["opaque"] for r in in_order] == list(range(1, 10))
        replica.stop()
    finally:
        active.stop()


def test_a_rejoining_old_active_drops_only_what_was_never_replicated(tmp_path):
    a = start_node(tmp_path, "a")
    proxy = FaultProxy(a.address)
    b = start_node(tmp_path, "b", "--replica-of", proxy.address)
    try:
        ca = bmemcached.Client([a.address])
        ca.set_multi({f"s1:{i}": b"replicated" for i in range(3000)})
        wait_converged(a, b)
        before = a.seqnos()
        proxy.drop(True)  # the replica hears nothing more
        ca.set_multi({f"s2:{i}": b"lost" for i in range(1000)})  # acknowledged at level none
        ca.set_multi({f"s1:{i}": b"overwritten-then-lost" for i in range(0, 3000, 3)})
        a.stop(sig=9)
        proxy.close()
        assert run_cli("promote", "--admin", b.admin).returncode == 0
        cb = bmemcached.Client([b.address])
        cb.set_multi({f"s3:{i}": b"new" for i in range(1000)})
        a = start_node(tmp_path, "a", "--replica-of", b.address)
        wait_converged(b, a)
        got_a, got_b = contents(a), contents(b)
        assert got_a == got_b
        keys = {k for (_, k) in got_a}
        assert not any(k.startswith(b"s2:") for k in keys)
        assert sum(k.startswith(b"s3:") for k in keys) == 1000
        assert all(v[2] == b"replicated" for (_, k), v in got_a.items() if k.startswith(b"s1:"))
        # Each vbucket went back exactly to where the new active's history began, from its own
        # WAL (a rollback to 0 would mean a full re-stream).
        a.wait_for("rolled back to seqno")
        time.sleep(0.5)
        while not a._q.empty():
            a.lines.append(a._q.get() or "")
        rolled = [int(x) for x in re.findall(r"rolled back to seqno (\d+)", "".join(a.lines))]
        assert len(rolled) == NUM_VBUCKETS, "".join(a.lines)
        assert sorted(rolled) == sorted(before), "".join(a.lines)
        assert a.metric_sum("sluice_replica_rollbacks_total") == NUM_VBUCKETS
    finally:
        b.stop()
        a.stop()


@pytest.mark.parametrize("bad", ["nowhere", "127.0.0.1:99999"])
def test_a_bad_replica_of_is_a_config_error(tmp_path, bad):
    r = run_cli("serve", "--data-dir", str(tmp_path / "d"), "--replica-of", bad, *NO_DEFAULT_PORTS)
    assert r.returncode == 2
    assert "replication.replica_of" in r.stderr


def test_takeover_of_one_vbucket_under_a_steady_write_load(tmp_path):
    a = start_node(tmp_path, "a")
    b = start_node(tmp_path, "b")
    vb = 5
    keys = [
        k for k in (f"key:{i}".encode() for i in range(20_000)) if sluice.vbucket_of(k, NUM_VBUCKETS) == vb
    ]
    stop = threading.Event()
    acked: dict[bytes, tuple[str, bytes]] = {}
    refused = {"tmpfail": 0, "not_my_vbucket": 0}
    taken = {"a": 0, "b": 0}
    try:
        ca = bmemcached.Client([a.address])
        ca.set_multi({k.decode(): b"start" for k in keys})

        def writer() -> None:
            sa, sb = connect(a), connect(b)
            n = 0
            target = ("a", sa)
            while not stop.is_set() and n < 200_000:
                key = keys[n % len(keys)]
                value = f"{n}".encode()
                name, sock = target
                sock.sendall(request(SET, key=key, value=value, extras=set_extras(), vbucket=vb))
                st = read_response(sock)["status"]
                if st == 0:
                    acked[key] = (name, value)
                    taken[name] += 1
                    n += 1
                elif st == 0x86:  # pending on the source: retry
                    refused["tmpfail"] += 1
                    time.sleep(0.0005)
                elif st == 0x07 and name == "a":  # the vbucket moved: follow it
                    refused["not_my_vbucket"] += 1
                    target = ("b", sb)
                else:
                    raise AssertionError(f"status {st:#x} from {name}")

        t = threading.Thread(target=writer)
        t.start()
        time.sleep(1.0)
        out = run_cli("move-vbucket", "--vb", str(vb), "--from", a.admin, "--to", b.admin, timeout=120)
        assert out.returncode == 0, out.stderr
        # Both nodes named the same way: KV address, then admin endpoint.
        source, target = f"{a.address} (admin {a.admin})", f"{b.address} (admin {b.admin})"
        assert f"moved from the node at {source} to the node at {target}:" in out.stdout, out.stdout
        paused = float(re.search(r"writes to it paused ([\d.]+) ms", out.stdout).group(1))
        time.sleep(1.0)
        stop.set()
        t.join()
        assert refused["not_my_vbucket"] == 1
        assert taken["a"] > 100 and taken["b"] > 100, taken
        assert paused < 5000
        states_a = {v["vbucket"]: v["state"] for v in a.status()["buckets"][0]["vbuckets"]}
        states_b = {v["vbucket"]: v["state"] for v in b.status()["buckets"][0]["vbuckets"]}
        assert states_a[vb] == "dead" and states_b[vb] == "active"
        # Every acknowledged write is on the new active, whichever node took it.
        sb = connect(b)
        for key, (_, value) in acked.items():
            sb.sendall(request(GET, key=key, vbucket=vb))
            r = read_response(sb)
            assert r["status"] == 0 and r["value"] == value, key
        # The old active refuses the vbucket from now on.
        sa = connect(a)
        sa.sendall(request(SET, key=keys[0], value=b"late", extras=set_extras(), vbucket=vb))
        assert read_response(sa)["status"] == 0x07
    finally:
        stop.set()
        b.stop()
        a.stop()


def test_a_replica_follows_its_active_through_a_vbucket_move(tmp_path):
    x = start_node(tmp_path, "x")
    y = start_node(tmp_path, "y", "--replica-of", x.address)
    z = start_node(tmp_path, "z")
    vb = 5
    later: dict[bytes, bytes] = {}  # written to X's other vbuckets after the move

    def write_to_x(n: int, tag: str) -> None:
        """`n` writes to X's vbuckets other than the moved one, each read back from Y later."""
        w = connect(x)
        i = 0
        while i < n:
            key = f"{tag}:{i}".encode()
            i += 1
            if sluice.vbucket_of(key, NUM_VBUCKETS) == vb:
                continue
            w.sendall(request(SET, key=key, value=key * 2, extras=set_extras()))
            assert read_response(w)["status"] == 0, key
            later[key] = key * 2

    stop = threading.Event()
    taken = {"moved": 0, "others": 0}
    try:
        bmemcached.Client([x.address]).set_multi({f"base{i}": b"b" for i in range(3000)})
        wait_converged(x, y)

        def writer() -> None:
            # Every vbucket, the moved one included, until X refuses it.
            w = connect(x)
            i = 0
            moved_away = False
            while not stop.is_set():
                key = f"during:{i}".encode()
                i += 1
                on_vb = sluice.vbucket_of(key, NUM_VBUCKETS) == vb
                if on_vb and moved_away:
                    continue
                w.sendall(request(SET, key=key, value=b"d", extras=set_extras()))
                st = read_response(w)["status"]
                if st == 0x07 and on_vb:
                    moved_away = True
                elif st == 0x86 and on_vb:  # pending: writes to it wait for the hand-over
                    time.sleep(0.001)
                else:
                    assert st == 0, (key, hex(st))
                    taken["moved" if on_vb else "others"] += 1

        t = threading.Thread(target=writer)
        t.start()
        time.sleep(0.5)
        out = run_cli("move-vbucket", "--vb", str(vb), "--from", x.admin, "--to", z.admin, timeout=120)
        assert out.returncode == 0, out.stderr
        time.sleep(0.5)
        stop.set()
        t.join()
        assert taken["moved"] > 0 and taken["others"] > 100, taken

        y.wait_for("it is dead here and no longer followed")
        connects = y.metric_sum("sluice_replica_connects_total")
        write_to_x(600, "after")

        def reached_y() -> None:
            # Y holds every other vbucket exactly as X does, and each later write reads back.
            deadline = time.monotonic() + 30
            while True:
                sx, sy = x.seqnos(), y.seqnos()
                if all(sx[v] == sy[v] for v in range(NUM_VBUCKETS) if v != vb):
                    break
                assert time.monotonic() < deadline, (sx, sy)
                time.sleep(0.05)
            s = connect(y)
            missing = []
            for key, value in later.items():
                r = get_replica(s, key)
                if r["status"] != 0 or r["value"] != value:
                    missing.append((key, r["status"]))
            assert missing == []

        reached_y()
        states = {v["vbucket"]: v["state"] for v in y.status()["buckets"][0]["vbuckets"]}
        assert states[vb] == "dead" and all(states[v] == "replica" for v in states if v != vb), states
        moved_key = next(
            k for k in (f"base{i}".encode() for i in range(3000)) if sluice.vbucket_of(k, NUM_VBUCKETS) == vb
        )
        assert get_replica(connect(y), moved_key)["status"] == 0x07
        # The stream that ended was asked for again on the same connection: no reconnect loop.
        assert y.metric_sum("sluice_replica_connects_total") == connects
        log = "".join(y.lines)
        assert "refused with status" not in log and "reconnecting" not in log, log[-3000:]
        lags = y.metrics()
        assert f'sluice_replica_lag_seqnos{{bucket="default",vbucket="{vb}"}}' not in lags
        out = run_cli("status", "--admin", y.admin)
        assert out.returncode == 0, out.stderr
        assert re.search(rf"^\s*{vb}\s+dead\s.*not followed", out.stdout, re.M), out.stdout

        # A restart keeps it: the dead vbucket is not asked for, the others go on.
        assert y.stop() == 0
        y = start_node(tmp_path, "y", "--replica-of", x.address)
        write_to_x(300, "restarted")
        reached_y()
        log = "".join(y.lines)
        assert "refused with status" not in log and "reconnecting" not in log, log[-3000:]
        assert y.status()["buckets"][0]["vbuckets"][vb]["state"] == "dead"
        # The moved vbucket lives on Z, with what X took before the move.
        states_z = {v["vbucket"]: v["state"] for v in z.status()["buckets"][0]["vbuckets"]}
        assert states_z[vb] == "active"
    finally:
        stop.set()
        for n in (y, z, x):
            n.stop()


def test_the_lag_metric_counts_what_the_active_has_and_the_replica_not_yet(tmp_path):
    """A slow link between active and replica: the lag is measured against the active's own
    high seqnos (asked on a connection of its own), not against what already arrived. The
    replication user holds only the `replication` permission (which includes `stream`)."""
    repl = sluice.config.hash_password("repl-secret", iterations=1000)
    writer = sluice.config.hash_password("w-secret", iterations=1000)
    users = (
        f'[users.repl]\npassword_hash = "{repl}"\nbuckets = {{ default = ["replication"] }}\n'
        f'[users.w]\npassword_hash = "{writer}"\nbuckets = {{ default = ["read", "write"] }}\n'
    )
    active = start_node(tmp_path, "a", extra=users)
    proxy = FaultProxy(active.address)
    (tmp_path / "repl.pw").write_text("repl-secret\n")
    replication = f'[replication]\nuser = "repl"\npassword_file = "{tmp_path / "repl.pw"}"\n'
    replica = start_node(tmp_path, "b", "--replica-of", proxy.address, extra=replication)
    try:
        c = bmemcached.Client([active.address], "w", "w-secret")
        c.set_multi({f"k{i}": b"x" for i in range(2000)})
        wait_converged(active, replica)
        proxy.throttle(100_000)
        for n in range(10):
            c.set_multi({f"k{n}:{i}": b"v" * 300 for i in range(1000)})
        time.sleep(2.5)  # the probe asks every second
        behind_before = sum(active.seqnos()) - sum(replica.seqnos())
        lag = replica.metric_sum("sluice_replica_lag_seqnos")
        behind_after = sum(active.seqnos()) - sum(replica.seqnos())
        assert behind_after > 3000, (behind_before, behind_after)
        assert behind_after * 0.95 <= lag <= behind_before * 1.05, (behind_before, lag, behind_after)
        proxy.throttle(0)
        wait_converged(active, replica)
        deadline = time.monotonic() + 10
        while replica.metric_sum("sluice_replica_lag_seqnos") != 0:
            assert time.monotonic() < deadline, replica.metrics()
            time.sleep(0.2)
    finally:
        proxy.close()
        replica.stop()
        active.stop()


def test_a_takeover_slower_than_5_s_is_reported_when_done(tmp_path):
    """The target's POST /takeover answers when the vbucket has moved, however long that takes:
    here 45 incompressible 100 KB values cross a link that holds every chunk (64 KiB at most)
    0.1 s, so the move cannot take less than ~7 s."""
    import os

    a = start_node(tmp_path, "a")
    b_config = node_config(tmp_path, "b")
    # The source's NOOPs wait behind megabytes of slow data: the default 1 s would call it dead.
    b_config.write_text(b_config.read_text() + "[replication]\nnoop_interval = 30\n")
    b = Node(tmp_path / "b", "--config", str(b_config))
    link = FaultProxy(a.address)
    try:
        keys = [
            k for k in (f"key:{i}" for i in range(2000)) if sluice.vbucket_of(k.encode(), NUM_VBUCKETS) == 5
        ]
        values = {k: os.urandom(100_000) for k in keys[:45]}
        bmemcached.Client([a.address]).set_multi(values)
        link.slow(0.1)
        began = time.monotonic()
        out = run_cli(
            "move-vbucket",
            "--vb",
            "5",
            "--from",
            a.admin,
            "--to",
            b.admin,
            "--source-address",
            link.address,
            timeout=120,
        )
        took = time.monotonic() - began
        assert out.returncode == 0, out.stderr
        assert took > 5, f"the move took only {took:.1f} s: it proves nothing about the 5 s limit"
        assert "vbucket 5 of bucket default moved" in out.stdout and "45 changes streamed" in out.stdout
        states = {v["vbucket"]: v["state"] for v in b.status()["buckets"][0]["vbuckets"]}
        assert states[5] == "active"
        cb = bmemcached.Client([b.address])
        assert all(cb.get(k) == v for k, v in values.items())
    finally:
        link.close()
        b.stop()
        a.stop()


def test_a_paused_replica_keeps_its_streams(tmp_path):
    """A replica stopped and resumed (SIGSTOP and SIGCONT: a debugger, a cgroup freeze), or sent
    SIGHUP (a reload), goes on on the same DCP connection while majority writes wait on it:
    Linux ends a read with a timeout that the stop or the handler interrupted with EINTR, which
    is a read to try again, not a lost connection."""
    from sluice import Client

    active = start_node(tmp_path, "a", replicas=1)
    replica = start_node(tmp_path, "b", "--replica-of", active.address)
    try:
        c = bmemcached.Client([active.address])
        c.set_multi({f"k{i}": b"v" for i in range(2_000)})
        wait_converged(active, replica)
        failed: list[BaseException] = []
        written = [0]
        done = threading.Event()

        def write() -> None:
            with Client(active.address) as w:
                i = 0
                while not done.is_set() and i < 100_000:
                    try:
                        w.set(b"m%d" % (i % 500), b"x%d" % i, durability="majority", durability_timeout=10)
                        written[0] += 1
                    except Exception as e:  # noqa: BLE001 - every failure is the finding
                        failed.append(e)
                    i += 1

        writer = threading.Thread(target=write)
        writer.start()
        try:
            for _ in range(10):
                replica.proc.send_signal(signal.SIGSTOP)
                time.sleep(0.05)
                replica.proc.send_signal(signal.SIGCONT)
                time.sleep(0.2)
            for _ in range(3):
                replica.proc.send_signal(signal.SIGHUP)
                time.sleep(0.3)
        finally:
            done.set()
            writer.join(60)
        assert failed == [], failed[:3]
        assert written[0] > 0
        c.set_multi({f"k{i}": b"w" for i in range(2_000)})
        wait_converged(active, replica)
        assert contents(active) == contents(replica)
        log = replica.log()
        assert "DCP connection lost" not in log and "Interrupted system call" not in log, log[-3000:]
    finally:
        replica.stop()
        active.stop()
