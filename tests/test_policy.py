"""Python policy plugins in a real `sluice serve`: one that raises, one that sleeps past its
timeout, one that changes the ACK interval while the stream runs, one that drops a key prefix,
a SlowConsumerPolicy choosing which cursor goes, and SIGHUP swapping a plugin; each seen on the
wire and in /metrics while the daemon keeps serving. Then configuration errors: one message
each and exit code 2."""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
from pathlib import Path

import bmemcached
import pytest
import sluice
from dcp_wire import FLAG_TO_LATEST, STREAM_END, DcpConnection, buffer_ack, stream_req
from helpers import NO_DEFAULT_PORTS, Node, run_cli
from mcbp_wire import GET_REPLICA, read_response, request
from tap_wire import BACKFILL, MUTATION, SUPPORT_ACK, TapClient, ack

PLUGINS = '''
import time
from sluice.policy import AckPolicy, Prefixes, RetransmitPolicy, SlowConsumerPolicy, StreamFilter, DROP, KEEP


class Raising(AckPolicy):
    def on_ack(self, stats):
        raise RuntimeError("plugin bug")


class Sleepy(StreamFilter):
    def filter(self, batch):
        time.sleep(1.0)
        return DROP  # too late: the default (keep everything) was used


class EveryThird(AckPolicy):
    """Asks for an ACK every 3 messages once it has seen 2 ACKs."""

    def on_ack(self, stats):
        return (3, 1000) if stats.acked_total >= 2 else None


class NoTmp(StreamFilter):
    def filter(self, batch):
        return bytes(DROP if k.startswith(b"tmp:") else KEEP for k in batch.keys)


class NoSession(StreamFilter):
    def filter(self, batch):
        return Prefixes(drop=(b"session:",))


class LateReader(StreamFilter):
    """Keeps each batch and reads its keys in the next call, after it was answered."""

    def __init__(self):
        self.last = None

    def filter(self, batch):
        if self.last is not None:
            self.last.keys
        self.last = batch
        return Prefixes(drop=(b"tmp:",))


class SmallDcpBuffer(AckPolicy):
    """A replica's DCP buffer of 96 KiB, acknowledged every 16 KiB."""

    def on_ack(self, stats):
        if stats.protocol == "dcp":
            return (16384, 98304)
        return None


class ShortGrace(RetransmitPolicy):
    def on_disconnect(self, connection, unacked):
        return (0.0, False)
'''


def start(
    tmp_path: Path, name: str, policy: dict[str, str], tap: str = "", args: tuple[str, ...] = ()
) -> tuple[Node, Path]:
    (tmp_path / "myplugins.py").write_text(PLUGINS)
    cfg = tmp_path / f"{name}.toml"
    lines = ["[snapshot]", "interval = 0", "[buckets.default]", "num_vbuckets = 8", "[tap]", tap, "[policy]"]
    lines += [f'{k} = "{v}"' for k, v in policy.items()]
    cfg.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return Node(tmp_path / name, "--config", str(cfg), *args, env=env), cfg


def write(node: Node, keys: list[str]) -> None:
    mc = bmemcached.Client([node.address])
    for k in keys:
        mc.set(k, b"value")


def stream_keys(node: Node, n: int, flags: int = 0) -> set[bytes]:
    """The keys of the first `n` changes of a TAP stream of everything."""
    c = TapClient((node.host, node.port), b"", flags | BACKFILL, struct.pack(">Q", 0))
    msgs = c.mutations_until(n, timeout=10)
    c.close()
    return {m.key for m in msgs if m.opcode == MUTATION}


def test_a_raising_plugin_is_counted_and_the_stream_goes_on(tmp_path: Path) -> None:
    n, _ = start(tmp_path, "raise", {"ack": "myplugins:Raising"}, "ack_interval = 5")
    try:
        write(n, [f"k{i}" for i in range(200)])
        assert len(stream_keys(n, 200, SUPPORT_ACK)) == 200
        deadline = time.monotonic() + 10
        while n.metric("sluice_policy_errors_total", policy="ack") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert n.metric("sluice_policy_errors_total", policy="ack") >= 1
        assert n.metric("sluice_policy_calls_total", policy="ack") >= 1
        assert "plugin bug" in "".join(n.lines) or n.wait_for("plugin bug", timeout=5)
        assert bmemcached.Client([n.address]).get("k1") == b"value", "the daemon keeps serving"
    finally:
        assert n.stop() == 0


def test_a_plugin_past_its_timeout_gets_the_default(tmp_path: Path) -> None:
    n, _ = start(tmp_path, "sleep", {"filter": "myplugins:Sleepy"})
    try:
        keys = [f"s{i}" for i in range(50)]
        write(n, keys)
        started = time.monotonic()
        assert stream_keys(n, 50) == {k.encode() for k in keys}, "kept: the default"
        assert time.monotonic() - started < 5
        assert n.metric("sluice_policy_timeouts_total", policy="filter") >= 1
    finally:
        n.stop()


def test_an_ack_policy_changes_the_interval_at_run_time(tmp_path: Path) -> None:
    # The plugin's answers are what is tested, not how fast they come: the native default's
    # 50 ms can pass on a busy machine before the plugin's thread runs (a late answer is
    # dropped: test_a_plugin_past_its_timeout_gets_the_default).
    n, _ = start(
        tmp_path,
        "interval",
        {"ack": "myplugins:EveryThird", "timeout": "10s"},
        "ack_interval = 20\nack_window = 20",
    )
    try:
        write(n, [f"i{i:04d}" for i in range(400)])
        c = TapClient((n.host, n.port), b"", SUPPORT_ACK | BACKFILL, struct.pack(">Q", 0))
        gaps, since = [], 0
        for m in c.mutations_until(400):
            since += 1
            if m.wants_ack:
                gaps.append(since)
                since = 0
                ack(c.sock, m)
                time.sleep(0.05)  # a round trip: the policy's answer lands before the next batch
        c.close()
        assert gaps[0] == 20, gaps
        assert gaps[-10:].count(3) >= 8, f"every third message asks once the policy says so: {gaps}"
        assert n.metric("sluice_policy_calls_total", policy="ack") >= 2
    finally:
        n.stop()


@pytest.mark.parametrize("plugin", ["NoTmp", "NoSession"])
def test_a_filter_drops_a_key_prefix(tmp_path: Path, plugin: str) -> None:
    prefix = "tmp:" if plugin == "NoTmp" else "session:"
    n, _ = start(tmp_path, plugin, {"filter": f"myplugins:{plugin}"})
    try:
        kept = [f"user:{i}" for i in range(100)]
        write(n, kept + [f"{prefix}{i}" for i in range(100)])
        got = stream_keys(n, 100)
        c = TapClient((n.host, n.port), b"", BACKFILL, struct.pack(">Q", 0))
        c.mutations_until(100)
        assert not [m.key for m in c.drain() if m.opcode == MUTATION], "nothing beyond the kept keys"
        c.close()
        assert got == {k.encode() for k in kept}
        assert n.metric("sluice_tap_filtered_total") >= 200
        assert n.metric("sluice_policy_installed", policy="filter") == 1
    finally:
        n.stop()


def test_a_filter_dropping_whole_batches_does_not_stall_the_stream(tmp_path: Path) -> None:
    """Several rounds of nothing but filtered keys, then kept ones: the stream carries on to
    the kept keys at once (a round that sends nothing still has the next one staged)."""
    n, _ = start(tmp_path, "whole", {"filter": "myplugins:NoTmp"})
    try:
        mc = bmemcached.Client([n.address])
        big = os.urandom(1000)  # incompressible: the client would otherwise shrink it
        for i in range(0, 3000, 500):
            mc.set_multi({f"tmp:{j}": big for j in range(i, i + 500)})
        kept = [f"user:{i}" for i in range(50)]
        write(n, kept)
        time.sleep(1)  # the writes' own wake-ups are over
        started = time.monotonic()
        c = TapClient((n.host, n.port), b"", BACKFILL, struct.pack(">Q", 0))
        got = c.mutations_until(50, timeout=5)
        c.close()
        assert {m.key for m in got if m.opcode == MUTATION} == {k.encode() for k in kept}
        assert time.monotonic() - started < 5
        assert n.metric("sluice_tap_filtered_total") == 3000
    finally:
        n.stop()


def test_a_filtered_batch_larger_than_the_ack_window_goes_out_window_by_window(tmp_path: Path) -> None:
    """A StreamFilter judges a batch of about 1 MiB; with an ACK window of 50 messages it goes
    out over many windows: every kept key arrives once and no filtered one. The ACK interval
    (100) is longer than the window: the message that fills the window asks for the ACK."""
    n, _ = start(tmp_path, "window", {"filter": "myplugins:NoTmp"}, "ack_interval = 100\nack_window = 50")
    try:
        mc = bmemcached.Client([n.address])
        big = os.urandom(500)
        for i in range(0, 2000, 250):
            mc.set_multi({(f"tmp:{j}" if j % 2 else f"user:{j}"): big for j in range(i, i + 250)})
        c = TapClient((n.host, n.port), b"", SUPPORT_ACK | BACKFILL, struct.pack(">Q", 0))
        # Read until the stream pauses, then acknowledge: each burst is what the window let out.
        got, bursts = [], []
        while len(got) < 1000:
            burst = c.drain(quiet=0.2)
            assert burst, f"the stream stalled after {len(got)} keys"
            got += [m.key for m in burst if m.opcode == MUTATION]
            bursts.append(len(burst))
            ack(c.sock, [m for m in burst if m.wants_ack][-1])
        assert not [m.key for m in c.drain() if m.opcode == MUTATION], "nothing beyond the kept keys"
        c.close()
        assert sorted(got) == sorted(f"user:{j}".encode() for j in range(0, 2000, 2))
        assert len(set(got)) == len(got)
        assert max(bursts) <= 51 and len(bursts) >= 20, f"the window of 50 held: {bursts}"
        assert n.metric("sluice_tap_filtered_total") == 1000
        assert n.metric("sluice_policy_calls_total", policy="filter") < 10, (
            "a few batches, not one per window"
        )
    finally:
        n.stop()


def test_a_batchs_keys_are_there_only_during_the_filter_call(tmp_path: Path) -> None:
    """A plugin that keeps a batch and reads its keys later gets an error (counted; that call
    gets the default), not keys from a buffer the connection has moved on from."""
    n, _ = start(tmp_path, "late", {"filter": "myplugins:LateReader"})
    try:
        write(n, [f"user:{i}" for i in range(20)] + [f"tmp:{i}" for i in range(20)])
        assert stream_keys(n, 20) == {f"user:{i}".encode() for i in range(20)}  # first call: fine
        write(n, ["user:late"])
        keys = stream_keys(n, 21)
        assert b"user:late" in keys
        n.wait_for("the call was answered", timeout=10)
        assert n.metric("sluice_policy_errors_total", policy="filter") >= 1
    finally:
        n.stop()


def test_a_filter_drops_a_key_prefix_on_dcp_streams_within_the_window(tmp_path: Path) -> None:
    """A DCP consumer with a small flow-control buffer: dropped changes never reach it, and the
    bytes they would have taken do not count against its window (else the stream stalls)."""
    n, _ = start(tmp_path, "dcp-filter", {"filter": "myplugins:NoSession"})
    try:
        kept = [f"user:{i}" for i in range(300)]
        write(n, kept + [f"session:{i}" for i in range(3000)])
        c = DcpConnection(n.host, n.port, name=b"filtered-reader")
        assert c.control("connection_buffer_size", "4096") == 0
        for vb in range(8):
            assert c.call(stream_req(vb, flags=FLAG_TO_LATEST))["word"] == 0
        keys, ended = [], 0
        while ended < 8:
            m = c.next_message(timeout=20)
            c.send(buffer_ack(m["size"]))
            if m["op"] == STREAM_END:
                ended += 1
            elif "key" in m:
                keys.append(m["key"])
        c.close()
        assert sorted(keys) == sorted(k.encode() for k in kept)
        assert n.metric("sluice_dcp_filtered_total") == 3000
        assert n.metric("sluice_policy_calls_total", policy="filter") >= 1
    finally:
        n.stop()


def test_an_ack_policy_sizes_a_replicas_dcp_buffer(tmp_path: Path) -> None:
    """On a replica, the AckPolicy sizes the DCP connection's flow control: the active hears
    the new buffer size, and replication goes on within it. The active's StreamFilter leaves
    replication whole."""
    active, _ = start(tmp_path, "active", {"filter": "myplugins:NoSession"})
    replica = None
    try:
        write(active, [f"r{i}" for i in range(2000)])
        replica, _ = start(
            tmp_path, "replica", {"ack": "myplugins:SmallDcpBuffer"}, args=("--replica-of", active.address)
        )
        write(active, [f"s{i}" for i in range(20_000)])
        active.wait_for("resizes its buffer from 33554432 to 98304 bytes")
        replica.wait_for("sets the buffer to 98304 bytes, acknowledged every 16384 bytes", timeout=5)
        bmemcached.Client([active.address]).set_multi({"session:1": b"kept", "last": b"done"})
        sock = socket.create_connection((replica.host, replica.port), timeout=10)
        want = {b"last": b"done", b"session:1": b"kept"}
        deadline, got = time.monotonic() + 60, {}
        while time.monotonic() < deadline and got != want:
            for k in want:
                sock.sendall(request(GET_REPLICA, key=k))
                got[k] = read_response(sock).get("value")
            time.sleep(0.05)
        sock.close()
        # Replication goes on within the plugin's buffer, and the filter leaves it whole.
        assert got == want
        assert replica.metric("sluice_policy_calls_total", policy="ack") >= 1
        assert active.metric("sluice_dcp_filtered_total") == 0
    finally:
        if replica is not None:
            replica.stop()
        active.stop()


def test_sighup_replaces_and_removes_plugins(tmp_path: Path) -> None:
    n, cfg = start(tmp_path, "hup", {})
    try:
        write(n, ["tmp:1", "user:1"])
        assert stream_keys(n, 2) == {b"tmp:1", b"user:1"}
        cfg.write_text(cfg.read_text() + 'filter = "myplugins:NoTmp"\n')
        n.proc.send_signal(signal.SIGHUP)
        n.wait_for("policy filter: myplugins:NoTmp")
        assert stream_keys(n, 1) == {b"user:1"}
        assert n.metric("sluice_policy_installed", policy="filter") == 1
        cfg.write_text(cfg.read_text().replace('filter = "myplugins:NoTmp"\n', ""))
        n.proc.send_signal(signal.SIGHUP)
        n.wait_for("policy filter: back to the native default")
        assert n.metric("sluice_policy_installed", policy="filter") == 0
        assert stream_keys(n, 2) == {b"tmp:1", b"user:1"}
    finally:
        assert n.stop() == 0


def test_a_retransmit_policy_decides_the_grace(tmp_path: Path) -> None:
    n, _ = start(tmp_path, "grace", {"retransmit": "myplugins:ShortGrace"}, 'grace_period = "1h"')
    try:
        write(n, [f"g{i}" for i in range(10)])
        c = TapClient((n.host, n.port), b"named", SUPPORT_ACK | BACKFILL, struct.pack(">Q", 0))
        c.mutations_until(10, auto_ack=False)
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()
        deadline = time.monotonic() + 10
        while n.metric("sluice_tap_sessions_expired_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert n.metric("sluice_tap_sessions_expired_total") == 1, "a grace of 0 instead of 1 h"
    finally:
        n.stop()


def _config(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[tap]\nttl = "three"\n', "tap.ttl: expected an integer, got str 'three'"),
        ("[tap]\nack_intervall = 5\n", "tap.ack_intervall: unknown key"),
        ('[policy]\nack = "no_such_module:Policy"\n', "policy.ack: cannot import module 'no_such_module'"),
        ('[policy]\nfilter = "sluice.policy:AckPolicy"\n', "is not a subclass of sluice.policy.StreamFilter"),
        ("[tap]\nttl = 40\n", "tap.ttl: 40 is not in 1..31"),
    ],
)
def test_config_errors_name_the_key_and_exit_2(tmp_path: Path, text: str, message: str) -> None:
    cfg = _config(tmp_path, text)
    for args in (
        ["config", "check", str(cfg)],
        ["serve", "--config", str(cfg), "--data-dir", str(tmp_path / "d"), *NO_DEFAULT_PORTS],
    ):
        r = run_cli(*args)
        assert r.returncode == 2, r
        assert message in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1, f"one clear message: {r.stderr}"


def test_the_base_classes_decide_nothing() -> None:
    from sluice import policy

    assert policy.AckPolicy().on_ack(policy.AckStats("c", 0.1, 0, 0, 0, 1, 1)) is None
    assert (
        policy.StreamFilter().filter(
            policy.FilterBatch(
                {"connection": "c", "value_bytes": 0, "docs": 1},
                lambda: (b"ab", struct.pack("I", 2), struct.pack("H", 1)),
            )
        )
        is None
    )
    loads = []

    def load() -> tuple[bytes, bytes, bytes]:
        loads.append(1)
        return b"abcde", struct.pack("II", 2, 5), struct.pack("HH", 1, 7)

    b = policy.FilterBatch({"connection": "c", "value_bytes": 3, "docs": 2}, load)
    assert len(b) == 2 and not loads, "keys are read only when asked for"
    assert b.keys == [b"ab", b"cde"] and list(b.vbuckets) == [1, 7] and len(loads) == 1
    assert sluice.policy.load_plugin("ack", "sluice.policy:AckPolicy").on_ack is not None
