"""sluice replication against Redis (primary + replica) and Tarantool (master + replica), Debian
packages, same machine, 127.0.0.1 only. Writes bench/results/replication.{json,md,png}.

    apt-get install redis-server tarantool && pip install redis msgpack matplotlib
    python bench/replication_bench.py [--items 1000000] [--runs 3] [--duration 10] [--skip-peers]

Every system runs in fresh processes on fresh temp dirs for each measurement; runs alternate the
order of the systems. All keys are 16 bytes (b"key:%012d"), all values the same 100 bytes of hex
digits (no repeats inside the value, so Redis' LZF finds nothing to compress in the RDB).

1. Catch-up from empty: the primary is loaded with --items items, then the replica is spawned on
   an empty data dir and timed from its spawn until it holds every item (polled every 10 ms):
   sluice by the replica vbuckets' high seqnos (admin /status) summing to the active's; Redis by
   `master_link_status:up` and DBSIZE on the replica; Tarantool by box.space.kv:len() on the
   replica. Loads: sluice by pipelined SETs over 4 connections (raw memcached binary protocol);
   Redis by redis-py pipelines (transaction=False, 10k per batch); Tarantool by a Lua loop in the
   master (box.space.kv:replace, transactions of 1000).
2. Replication lag at half the maximum SET rate: with the replica attached, a loader process
   (raw sockets, 4 connections x 256 pipelined SETs over 100k keys) measures the pair's maximum
   SET rate for --max-rate-duration seconds; then it paces SETs at half that rate (batches per
   10 ms tick) for --duration seconds while a probe thread, every 2 ms, writes a unique key to the
   primary and polls the replica (sluice GET_REPLICA, Redis GET, Tarantool select) every 0.2 ms
   until it appears. Lag: from the write's reply to the first reply that shows it. Polling stops
   2 s after the write (the probe then counts as 2 s, a lower bound); a replica too busy to answer
   a poll for longer gives a lag above 2 s. The achieved rate is what the loader got acked.
3. Majority writes: --clients threads, one write in flight each, raw sockets: sluice SET on a
   bucket with durability = "majority" (active + 1 replica); Redis SET then WAIT 1 1000 (a WAIT
   that returns 0 counts as an error); Tarantool 2.6 replace into an is_sync space with
   replication_synchro_quorum = 2. sluice also runs `sluice bench --get-ratio 0` (16 connections
   x pipeline 32) on the same pair.

Settings: sluice wal.mode = "write", 4 GiB bucket. Redis: --save "" --appendonly no,
repl-diskless-sync yes with repl-diskless-sync-delay 0 on the primary, repl-diskless-load
on-empty-db on the replica (the fastest full sync Redis 7.0 offers). Tarantool: memtx, a hash
primary index, wal_mode write (the default) on both. The machine is shared and noisy (2 cores
for primary, replica and load): figures are medians over --runs runs, every run kept in the JSON.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import string
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import sluice

try:
    import redis
except ImportError:  # the Redis peer is skipped
    redis = None
try:
    import msgpack
except ImportError:  # the Tarantool peer is skipped
    msgpack = None

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SYSTEMS = ("sluice", "redis", "tarantool")
LABELS = {"sluice": "sluice", "redis": "Redis", "tarantool": "Tarantool"}
KEY = b"key:%012d"
VALUE = hashlib.sha512(b"sluice replication bench").hexdigest()[:100].encode()
# Catch-up: replica state polled this often; a catch-up is abandoned after this long.
POLL_S = 0.01
CATCHUP_TIMEOUT_S = 600.0
# Loader: connections x pipeline depth when running flat out; requests go in prebuilt chunks.
LOADER_CONNECTIONS = 4
LOADER_DEPTH = 256
CHUNK = 16
BG_KEYS = 100_000
TICK_S = 0.01
# Probes for the lag test.
PROBE_INTERVAL_S = 0.002
PROBE_POLL_S = 0.0002
PROBE_TIMEOUT_S = 2.0
# Targets.
TARGET_CATCHUP = 1_000_000  # items/s
TARGET_CATCHUP_VS_REDIS = 2.0
TARGET_LAG_P99_MS = 5.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout: float, what: str, interval: float = POLL_S) -> float:
    """Calls pred() until it is true; returns the perf_counter time it was; raises after timeout."""
    deadline = time.perf_counter() + timeout
    while True:
        if pred():
            return time.perf_counter()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


def percentile(values: list[float], p: float) -> float:
    """Nearest rank."""
    s = sorted(values)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


# ---------------------------------------------------------------------------------------------
# Wire formats: requests as bytes, replies parsed off a bytearray.

MC_HEADER = struct.Struct(">BBHBBHIIQ")
MC_SET, MC_GET_REPLICA = 0x01, 0x83
IPROTO_SELECT, IPROTO_REPLACE, IPROTO_EVAL = 0x01, 0x03, 0x08
IPROTO_OK_PREFIX = b"\x83\x00\xce\x00\x00\x00\x00"  # header map {0: code 0 (uint32), ...}
RESP_OK = b"+OK\r\n"
RESP_WAIT_1 = b"*3\r\n$4\r\nWAIT\r\n$1\r\n1\r\n$4\r\n1000\r\n"


def mc_frame(opcode: int, key: bytes, extras: bytes = b"", value: bytes = b"") -> bytes:
    body = len(extras) + len(key) + len(value)
    return MC_HEADER.pack(0x80, opcode, len(key), len(extras), 0, 0, body, 0, 0) + extras + key + value


def resp(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def iproto(code: int, body: dict) -> bytes:
    payload = msgpack.packb({0: code, 1: 0}) + msgpack.packb(body)
    return b"\xce" + struct.pack(">I", len(payload)) + payload


def set_request(kind: str, key: bytes, space: int = 0) -> bytes:
    if kind == "sluice":
        return mc_frame(MC_SET, key, b"\0" * 8, VALUE)
    if kind == "redis":
        return resp(b"SET", key, VALUE)
    return iproto(IPROTO_REPLACE, {0x10: space, 0x21: [key.decode(), VALUE.decode()]})


def replica_get_request(kind: str, key: bytes, space: int = 0) -> bytes:
    if kind == "sluice":
        return mc_frame(MC_GET_REPLICA, key)
    if kind == "redis":
        return resp(b"GET", key)
    # space, index 0, limit 1, offset 0, iterator EQ, key
    return iproto(IPROTO_SELECT, {0x10: space, 0x11: 0, 0x12: 1, 0x13: 0, 0x14: 0, 0x20: [key.decode()]})


def iproto_decode(payload: bytes) -> tuple[dict, dict]:
    u = msgpack.Unpacker(raw=False, strict_map_key=False)
    u.feed(payload)
    header = next(u)
    try:
        body = next(u)
    except StopIteration:
        body = {}
    return header, body


def parse_one(kind: str, buf: bytearray) -> tuple[bool, object] | None:
    """One reply off the front of buf: (success, detail), or None if it is not all there.
    detail: sluice (status, value); Redis the bulk string, integer or status line (None for a nil);
    Tarantool the payload (header and body, msgpack)."""
    if kind == "sluice":
        if len(buf) < 24:
            return None
        _, _, keylen, extlen, _, status, body, _, _ = MC_HEADER.unpack_from(buf)
        if len(buf) < 24 + body:
            return None
        value = bytes(buf[24 + extlen + keylen : 24 + body])
        del buf[: 24 + body]
        return status == 0, (status, value)
    if kind == "redis":
        end = buf.find(b"\r\n")
        if end < 0:
            return None
        kind_byte, line = buf[0:1], bytes(buf[1:end])
        if kind_byte == b"$":
            n = int(line)
            if n < 0:
                del buf[: end + 2]
                return True, None
            if len(buf) < end + 2 + n + 2:
                return None
            value = bytes(buf[end + 2 : end + 2 + n])
            del buf[: end + 4 + n]
            return True, value
        del buf[: end + 2]
        if kind_byte == b":":
            return True, int(line)
        return kind_byte == b"+", line
    if len(buf) < 5:
        return None
    n = int.from_bytes(buf[1:5], "big")
    if len(buf) < 5 + n:
        return None
    payload = bytes(buf[5 : 5 + n])
    del buf[: 5 + n]
    if payload.startswith(IPROTO_OK_PREFIX):
        return True, payload
    header, _ = iproto_decode(payload)
    return header.get(0, 1) == 0, payload


def fast_sets(kind: str, buf: bytearray, want: int) -> int:
    """Consumes up to `want` successful SET replies at once when they are the plain kind (sluice:
    24-byte headers with status 0 and no body; Redis: +OK); returns how many. 0: parse one by one."""
    if kind == "sluice":
        n = min(want, len(buf) // 24)
        if n:
            seg = bytes(buf[: 24 * n])
            if all(seg[i::24].count(0) == n for i in (6, 7, 8, 9, 10, 11)):
                del buf[: 24 * n]
                return n
    elif kind == "redis":
        n = min(want, len(buf) // len(RESP_OK))
        if n and buf[: len(RESP_OK) * n] == RESP_OK * n:
            del buf[: len(RESP_OK) * n]
            return n
    return 0


class Conn:
    """A raw client connection to one system's server."""

    def __init__(self, kind: str, address: str, timeout: float = 30.0) -> None:
        host, _, port = address.rpartition(":")
        self.kind = kind
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        if kind == "tarantool":
            while len(self.buf) < 128:  # the greeting
                self._fill()
            del self.buf[:128]

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 17)
        if not chunk:
            raise ConnectionError(f"{self.kind} closed the connection")
        self.buf += chunk

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> tuple[bool, object]:
        while True:
            r = parse_one(self.kind, self.buf)
            if r is not None:
                return r
            self._fill()

    def sets_done(self, n: int) -> int:
        """Reads n SET replies; returns how many failed."""
        errors = 0
        while n:
            k = fast_sets(self.kind, self.buf, n)
            n -= k
            if not n:
                break
            r = parse_one(self.kind, self.buf)
            if r is None:
                self._fill()
                continue
            n -= 1
            errors += not r[0]
        return errors

    def set(self, key: bytes, space: int = 0) -> bool:
        self.send(set_request(self.kind, key, space))
        return self.reply()[0]

    def replica_has(self, key: bytes, space: int = 0) -> bool:
        self.send(replica_get_request(self.kind, key, space))
        ok, detail = self.reply()
        if self.kind == "sluice":
            return detail[0] == 0
        if self.kind == "redis":
            return ok and detail is not None
        return ok and bool(iproto_decode(detail)[1].get(0x30))

    def eval(self, expr: str, *args: object) -> list:
        """Tarantool: runs Lua, returns its results (raises on a Lua error)."""
        self.send(iproto(IPROTO_EVAL, {0x27: expr, 0x21: list(args)}))
        ok, payload = self.reply()
        _, body = iproto_decode(payload)
        if not ok:
            raise RuntimeError(f"tarantool eval {expr!r}: {body.get(0x31)}")
        return body.get(0x30, [])

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------------------------
# The loader: SETs as fast as acknowledged (rate 0) or paced at `rate` per second.


def run_load(
    kind: str,
    address: str,
    space: int,
    rate: float,
    seconds: float,
    max_ops: int,
    connections: int = LOADER_CONNECTIONS,
    depth: int = LOADER_DEPTH,
    key_space: int = BG_KEYS,
    sequential: bool = False,
    started=None,
) -> dict:
    """sequential: keys 0..max_ops-1 once each, built on the fly; otherwise prebuilt chunks of
    CHUNK requests cycling over key_space keys (counts are then multiples of CHUNK)."""
    conns = [Conn(kind, address) for _ in range(connections)]
    try:
        chunks: list[bytes] = []
        if not sequential:
            chunks = [
                b"".join(set_request(kind, KEY % j, space) for j in range(i, i + CHUNK))
                for i in range(0, key_space - key_space % CHUNK, CHUNK)
            ]
        pos = 0

        def batch(n: int) -> bytes:
            nonlocal pos
            if sequential:
                data = b"".join(set_request(kind, KEY % j, space) for j in range(pos, pos + n))
                pos += n
                return data
            data = b"".join(chunks[(pos + k) % len(chunks)] for k in range(n // CHUNK))
            pos += n // CHUNK
            return data

        unit = 1 if sequential else CHUNK
        sent = errors = 0
        if started is not None:
            started.set()
        t0 = time.perf_counter()
        end = t0 + seconds
        while sent < max_ops and time.perf_counter() < end:
            if rate > 0:
                now = time.perf_counter()
                due = int(rate * (now - t0)) - sent
                due = min(due, int(rate * TICK_S * 5), max_ops - sent) // unit * unit
                if due < unit:
                    next_tick = t0 + (math.floor((now - t0) / TICK_S) + 1) * TICK_S
                    time.sleep(max(0.0, min(next_tick, end) - now))
                    continue
                units = due // unit
                shares = [units // len(conns) + (i < units % len(conns)) for i in range(len(conns))]
            else:
                units = max(0, min(depth * len(conns), max_ops - sent)) // unit
                shares = [min(depth // unit, units - i * (depth // unit)) for i in range(len(conns))]
            busy = []
            for c, share in zip(conns, shares, strict=True):
                if share > 0:
                    c.send(batch(share * unit))
                    busy.append((c, share * unit))
            if not busy:
                break
            for c, n in busy:
                errors += c.sets_done(n)
                sent += n
        elapsed = time.perf_counter() - t0
    finally:
        for c in conns:
            c.close()
    return {
        "ops": sent,
        "errors": errors,
        "seconds": elapsed,
        "ops_per_s": sent / elapsed if elapsed > 0 else 0.0,
        "target_rate": rate,
    }


def _loader_entry(out, started, args: dict) -> None:
    try:
        out.put(run_load(started=started, **args))
    except BaseException as e:  # reported to the parent
        out.put({"error": f"{type(e).__name__}: {e}"})
        started.set()


class LoaderProcess:
    """run_load in its own process (spawned), so the probe thread does not share its GIL."""

    def __init__(self, **args: object) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.out = ctx.Queue()
        self.started = ctx.Event()
        self.seconds = float(args["seconds"])
        self.proc = ctx.Process(target=_loader_entry, args=(self.out, self.started, args), daemon=True)
        self.proc.start()
        if not self.started.wait(120):
            self.stop()
            raise TimeoutError("loader process did not start")

    def result(self) -> dict:
        try:
            r = self.out.get(timeout=self.seconds + 120)
        finally:
            self.stop()
        if "error" in r:
            raise RuntimeError(f"loader: {r['error']}")
        return r

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# ---------------------------------------------------------------------------------------------
# Processes.


class Proc:
    """A server process in its own process group, output to a log file."""

    def __init__(self, cmd: list[str], logfile: Path, cwd: Path | None = None) -> None:
        self.cmd = cmd
        self.logfile = logfile
        self.out = open(logfile, "ab")
        self.proc = subprocess.Popen(
            cmd, stdout=self.out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.cmd[0]} exited ({self.proc.returncode}): {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        try:
            return self.logfile.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        kill_group(self.proc)
        self.out.close()


def kill_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=timeout)


class SluiceNode:
    """`python -m sluice serve` on free ports; stderr read on a thread (as tests/helpers.Node)."""

    def __init__(self, data_dir: Path, config: Path, replica_of: str | None = None) -> None:
        cmd = [sys.executable, "-m", "sluice", "serve", "--config", str(config), "--data-dir", str(data_dir)]
        cmd += ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]
        if replica_of:
            cmd += ["--replica-of", replica_of]
        self.lines: collections.deque[str] = collections.deque(maxlen=300)
        self.ready = threading.Event()
        self.ready_line = ""
        self.ready_at = 0.0
        self.spawned = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 60
        while not self.ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"sluice serve not ready (exit {self.proc.poll()}): {''.join(self.lines)[-3000:]}"
                )
        self.address = self.ready_line.split("listening on ")[1].split(" ")[0]
        self.admin = self.ready_line.split("(admin ")[1].split(")")[0]

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if not self.ready.is_set() and "sluice ready" in line:
                self.ready_at = time.perf_counter()
                self.ready_line = line
                self.ready.set()

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://{self.admin}/status", timeout=10) as r:
            return json.loads(r.read())

    def seqnos(self, state: str) -> tuple[int, int]:
        """(sum of high seqnos, sum of items) over the vbuckets in `state`."""
        seq = items = 0
        for b in self.status()["buckets"]:
            for v in b["vbuckets"]:
                if v["state"] == state:
                    seq += v["high_seqno"]
                    items += v["items"]
        return seq, items

    def stop(self) -> None:
        kill_group(self.proc)


# ---------------------------------------------------------------------------------------------
# The three systems, behind one interface.


class System:
    kind = ""
    space = 0  # Tarantool: the space writes go to
    primary_addr = ""
    replica_addr = ""

    def __init__(self, work: Path, stack: ExitStack, items: int, majority: bool = False) -> None:
        self.work = work
        self.stack = stack
        self.items = items
        self.majority = majority

    def start_primary(self) -> None:
        raise NotImplementedError

    def start_replica(self) -> float:
        """Spawns the replica; returns its spawn time (perf_counter)."""
        raise NotImplementedError

    def load(self, n: int) -> None:
        raise NotImplementedError

    def caught_up(self, n: int) -> bool:
        raise NotImplementedError

    def wait_following(self, timeout: float = 120.0) -> None:
        """Waits until the replica follows the primary (connected and streaming)."""

    def settle(self, timeout: float = 120.0) -> None:
        """Waits until the replica has every write so far (the primary is idle): a probe written
        now is visible on the replica (Redis and Tarantool replicate one ordered stream)."""
        self.wait_following(timeout)
        key = b"settle:%09d" % (time.monotonic_ns() % 10**9)
        w, r = Conn(self.kind, self.primary_addr), Conn(self.kind, self.replica_addr)
        try:
            if not w.set(key, self.space):
                raise RuntimeError(f"{self.kind}: settle write failed")
            wait_until(lambda: r.replica_has(key, self.space), timeout, f"{self.kind} settle", 0.005)
        finally:
            w.close()
            r.close()

    def durable_write(self, conn: Conn, key: bytes) -> bool:
        """One write acknowledged by the replica too."""
        return conn.set(key, self.space)

    def extra(self) -> dict:
        return {}


class Sluice(System):
    kind = "sluice"

    def config(self) -> Path:
        path = self.work / ("majority.toml" if self.majority else "sluice.toml")
        text = '[wal]\nmode = "write"\n\n[buckets.default]\nmemory_quota = "4GiB"\n'
        if self.majority:
            text += 'durability = "majority"\nreplicas = 1\n'
        path.write_text(text)
        return path

    def start_primary(self) -> None:
        self.active = SluiceNode(self.work / "active", self.config())
        self.stack.callback(self.active.stop)
        self.primary_addr = self.active.address

    def start_replica(self) -> float:
        self.replica = SluiceNode(self.work / "replica", self.config(), replica_of=self.active.address)
        self.stack.callback(self.replica.stop)
        self.replica_addr = self.replica.address
        return self.replica.spawned

    def load(self, n: int) -> None:
        r = run_load("sluice", self.primary_addr, 0, 0, 3600, n, depth=512, sequential=True)
        if r["errors"] or r["ops"] != n:
            raise RuntimeError(f"sluice load: {r}")
        log(f"  sluice: loaded {n:,} items in {r['seconds']:.1f} s")
        self.target = self.active.seqnos("active")[0]

    def caught_up(self, n: int) -> bool:
        if self.replica.proc.poll() is not None:
            raise RuntimeError(f"sluice replica exited: {''.join(self.replica.lines)[-3000:]}")
        seq, items = self.replica.seqnos("replica")
        return seq == self.target and items >= n

    def settle(self, timeout: float = 120.0) -> None:
        super().settle(timeout)  # the replica follows
        target = self.active.seqnos("active")[0]
        wait_until(lambda: self.replica.seqnos("replica")[0] >= target, timeout, "sluice settle")

    def durable_write(self, conn: Conn, key: bytes) -> bool:
        return conn.set(key)

    def extra(self) -> dict:
        return {"replica_ready_after_spawn_s": self.replica.ready_at - self.replica.spawned}


class Redis(System):
    kind = "redis"

    def _server(self, name: str, extra: list[str]) -> tuple[Proc, int]:
        port = free_port()
        d = self.work / name
        d.mkdir()
        cmd = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", str(d)]
        cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", ""]
        cmd += ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        p = Proc(cmd + extra, d / "redis.log")
        self.stack.callback(p.stop)
        return p, port

    def _client(self, port: int) -> redis.Redis:
        c = redis.Redis(host="127.0.0.1", port=port, socket_timeout=30, socket_connect_timeout=5)
        self.stack.callback(c.close)
        return c

    @staticmethod
    def _ping(c: redis.Redis) -> bool:
        try:
            return bool(c.ping())
        except redis.exceptions.RedisError:
            return False

    def start_primary(self) -> None:
        self.pproc, port = self._server("primary", [])
        self.primary_addr = f"127.0.0.1:{port}"
        self.pcli = self._client(port)
        wait_until(lambda: self.pproc.check() or self._ping(self.pcli), 30, "redis primary")

    def start_replica(self) -> float:
        port = free_port()
        t = time.perf_counter()
        d = self.work / "replica"
        d.mkdir()
        cmd = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", str(d)]
        cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", ""]
        cmd += [
            "--repl-diskless-load",
            "on-empty-db",
            "--replicaof",
            "127.0.0.1",
            self.primary_addr.split(":")[1],
        ]
        self.rproc = Proc(cmd, d / "redis.log")
        self.stack.callback(self.rproc.stop)
        self.replica_addr = f"127.0.0.1:{port}"
        self.rcli = self._client(port)
        return t

    def load(self, n: int) -> None:
        t = time.perf_counter()
        for start in range(0, n, 10_000):
            pipe = self.pcli.pipeline(transaction=False)
            for i in range(start, min(start + 10_000, n)):
                pipe.set(KEY % i, VALUE)
            pipe.execute()
        if self.pcli.dbsize() != n:
            raise RuntimeError(f"redis load: dbsize {self.pcli.dbsize()} != {n}")
        log(f"  redis: loaded {n:,} items in {time.perf_counter() - t:.1f} s")

    def caught_up(self, n: int) -> bool:
        self.rproc.check()
        try:
            info = self.rcli.info("replication")
            return info.get("master_link_status") == "up" and self.rcli.dbsize() == n
        except redis.exceptions.RedisError:  # not listening yet, or LOADING
            return False

    def wait_following(self, timeout: float = 120.0) -> None:
        wait_until(lambda: self.rproc.check() or self.link_up(), timeout, "redis replica link", 0.02)

    def link_up(self) -> bool:
        try:
            return self.rcli.info("replication").get("master_link_status") == "up"
        except redis.exceptions.RedisError:
            return False

    def durable_write(self, conn: Conn, key: bytes) -> bool:
        conn.send(set_request("redis", key) + RESP_WAIT_1)
        ok, _ = conn.reply()
        acked, n = conn.reply()
        return ok and acked and isinstance(n, int) and n >= 1


TARANTOOL_MASTER = string.Template(
    """
box.cfg{
    listen = '127.0.0.1:$port',
    work_dir = '$dir',
    memtx_memory = $memtx,
    log = '$dir/tarantool.log',
    replication_synchro_quorum = 2,
    replication_synchro_timeout = 5,
}
box.once('bench', function()
    box.schema.user.grant('guest', 'read,write,execute,create,drop', 'universe')
    box.schema.user.grant('guest', 'replication')
    box.schema.space.create('kv'):create_index('pk', {type = 'hash', parts = {1, 'string'}})
    box.schema.space.create('kvsync', {is_sync = true}):create_index(
        'pk', {type = 'hash', parts = {1, 'string'}})
end)
function bench_load(n, value)
    local s = box.space.kv
    for i = 0, n - 1, 1000 do
        box.begin()
        for j = i, math.min(i + 999, n - 1) do
            s:replace{string.format('key:%012d', j), value}
        end
        box.commit()
    end
    return s:len()
end
"""
)
TARANTOOL_REPLICA = string.Template(
    """
box.cfg{
    listen = '127.0.0.1:$port',
    work_dir = '$dir',
    memtx_memory = $memtx,
    log = '$dir/tarantool.log',
    replication = {'$master'},
    replication_connect_timeout = 60,
    read_only = true,
}
"""
)


class Tarantool(System):
    kind = "tarantool"

    def _start(self, name: str, template: string.Template, **kw: object) -> tuple[Proc, str]:
        port = free_port()
        d = self.work / name
        d.mkdir()
        memtx = max(1 << 30, self.items * 512)
        script = d / "init.lua"
        script.write_text(template.substitute(port=port, dir=str(d), memtx=memtx, **kw))
        p = Proc(["tarantool", str(script)], d / "stdout.log", cwd=d)
        self.stack.callback(p.stop)
        return p, f"127.0.0.1:{port}"

    def _eval(self, address: str, expr: str, *args: object, timeout: float = 30) -> list | None:
        """Lua on a server; None while it cannot answer (starting, bootstrapping)."""
        try:
            c = Conn("tarantool", address, timeout=timeout)
        except OSError:
            return None
        try:
            return c.eval(expr, *args)
        except (OSError, RuntimeError):
            return None
        finally:
            c.close()

    def start_primary(self) -> None:
        self.mproc, self.primary_addr = self._start("master", TARANTOOL_MASTER)

        def ready() -> bool:
            self.mproc.check()
            return self._eval(self.primary_addr, "return box.space.kvsync ~= nil") == [True]

        wait_until(ready, 30, "tarantool master")
        ids = self._eval(self.primary_addr, "return box.space.kv.id, box.space.kvsync.id")
        assert ids is not None
        self.space = ids[1] if self.majority else ids[0]

    def start_replica(self) -> float:
        t = time.perf_counter()
        self.rproc, self.replica_addr = self._start("replica", TARANTOOL_REPLICA, master=self.primary_addr)
        return t

    def load(self, n: int) -> None:
        t = time.perf_counter()
        got = self._eval(self.primary_addr, "return bench_load(...)", n, VALUE.decode(), timeout=600)
        if got != [n]:
            raise RuntimeError(f"tarantool load: {got}")
        log(f"  tarantool: loaded {n:,} items in {time.perf_counter() - t:.1f} s")

    def caught_up(self, n: int) -> bool:
        self.rproc.check()
        got = self._eval(self.replica_addr, "return box.space.kv and box.space.kv:len() or -1", timeout=10)
        return got == [n]

    def wait_following(self, timeout: float = 120.0) -> None:
        """The replica has bootstrapped and the master streams to it. With 2.6.0, a replica that
        joins while a sync write waits for its quorum aborts its bootstrap (ER_SYNC_ROLLBACK on
        the timed-out write) and never follows, so no durable write may come before this."""
        expr = (
            "for _, r in pairs(box.info.replication) do "
            "if r.downstream and r.downstream.status == 'follow' then return true end end "
            "return false"
        )

        def following() -> bool:
            self.rproc.check()
            running = self._eval(self.replica_addr, "return box.info.status", timeout=10) == ["running"]
            return running and self._eval(self.primary_addr, expr, timeout=10) == [True]

        wait_until(following, timeout, "tarantool replica following", 0.02)


SYSTEM_CLASSES = {"sluice": Sluice, "redis": Redis, "tarantool": Tarantool}


def peer_problem(kind: str) -> str | None:
    """Why a peer cannot run here, or None."""
    if kind == "redis":
        if shutil.which("redis-server") is None:
            return "redis-server is not installed (apt-get install redis-server)"
        if redis is None:
            return "the redis Python package is missing (pip install redis)"
    if kind == "tarantool":
        if shutil.which("tarantool") is None:
            return "tarantool is not installed (apt-get install tarantool)"
        if msgpack is None:
            return "the msgpack Python package is missing (pip install msgpack)"
    return None


# ---------------------------------------------------------------------------------------------
# The three measurements.


def measure_catchup(kind: str, items: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"repl-{kind}-") as d, ExitStack() as stack:
        s = SYSTEM_CLASSES[kind](Path(d), stack, items)
        s.start_primary()
        s.load(items)
        spawned = s.start_replica()
        done = wait_until(lambda: s.caught_up(items), CATCHUP_TIMEOUT_S, f"{kind} catch-up")
        seconds = done - spawned
        r = {"items": items, "seconds": seconds, "items_per_s": items / seconds, **s.extra()}
    log(f"  {kind}: catch-up of {items:,} items in {seconds:.2f} s = {r['items_per_s']:,.0f} items/s")
    return r


def sluice_bench(address: str, seconds: float, connections: int = 16, pipeline: int = 32) -> dict:
    cmd = [sys.executable, "-m", "sluice", "bench", "--server", address, "--connections", str(connections)]
    cmd += ["--pipeline", str(pipeline), "--duration", str(seconds), "--keys", str(BG_KEYS)]
    cmd += ["--value-size", str(len(VALUE)), "--get-ratio", "0", "--threads", "2", "--no-prefill", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise RuntimeError(f"sluice bench exited {p.returncode}: {p.stderr[-2000:]}") from e


def probe_lags(s: System, seconds: float) -> dict:
    """Writes a fresh key to the primary every PROBE_INTERVAL_S and polls the replica for it."""
    w, r = Conn(s.kind, s.primary_addr, 10), Conn(s.kind, s.replica_addr, 10)
    lags: list[float] = []
    timeouts = write_errors = 0
    try:
        t_end = time.perf_counter() + seconds
        next_at = time.perf_counter()
        for i in range(int(seconds / PROBE_INTERVAL_S) + 1):
            now = time.perf_counter()
            if now >= t_end:
                break
            if next_at > now:
                time.sleep(next_at - now)
            next_at += PROBE_INTERVAL_S
            key = b"probe:%010d" % i
            if not w.set(key, s.space):
                write_errors += 1
                continue
            acked = time.perf_counter()
            while True:
                if r.replica_has(key, s.space):
                    lags.append((time.perf_counter() - acked) * 1e3)
                    break
                if time.perf_counter() - acked > PROBE_TIMEOUT_S:
                    timeouts += 1
                    break
                time.sleep(PROBE_POLL_S)
    finally:
        w.close()
        r.close()
    counted = lags + [PROBE_TIMEOUT_S * 1e3] * timeouts
    return {
        "probes": len(counted),
        "timeouts": timeouts,
        "write_errors": write_errors,
        "lag_ms_p50": percentile(counted, 50),
        "lag_ms_p90": percentile(counted, 90),
        "lag_ms_p99": percentile(counted, 99),
        "lag_ms_max": max(counted) if counted else float("nan"),
    }


def measure_lag(kind: str, duration: float, max_rate_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"repl-{kind}-") as d, ExitStack() as stack:
        s = SYSTEM_CLASSES[kind](Path(d), stack, BG_KEYS)
        s.start_primary()
        s.start_replica()
        s.settle()
        load = {"kind": kind, "address": s.primary_addr, "space": s.space}
        mx = LoaderProcess(**load, rate=0, seconds=max_rate_s, max_ops=10**9).result()
        if mx["errors"]:
            raise RuntimeError(f"{kind} max-rate load: {mx['errors']} errors")
        out = {"max_set_rate": mx["ops_per_s"], "max_run": mx}
        log(f"  {kind}: max SET rate {mx['ops_per_s']:,.0f}/s (loader, {mx['seconds']:.1f} s)")
        if kind == "sluice":
            nb = sluice_bench(s.primary_addr, max_rate_s)
            out["sluice_bench_max"] = nb
            log(f"  sluice: max SET rate {nb['ops_per_s']:,.0f}/s (sluice bench 16 x 32)")
        s.settle()
        rate = mx["ops_per_s"] / 2
        bg = LoaderProcess(**load, rate=rate, seconds=duration, max_ops=int(rate * duration) + CHUNK)
        probes = probe_lags(s, max(0.5, duration - 0.3))
        bgr = bg.result()
        out.update(probes)
        out.update(
            {
                "target_rate": rate,
                "background_rate": bgr["ops_per_s"],
                "background_errors": bgr["errors"],
                "background_run": bgr,
            }
        )
    log(
        f"  {kind}: background {bgr['ops_per_s']:,.0f}/s (target {rate:,.0f}), lag p50 "
        f"{out['lag_ms_p50']:.2f} ms p99 {out['lag_ms_p99']:.2f} ms over {out['probes']} probes "
        f"({out['timeouts']} timeouts)"
    )
    return out


def durable_clients(s: System, seconds: float, clients: int) -> dict:
    lats: list[list[float]] = [[] for _ in range(clients)]
    errs = [0] * clients
    conns = [Conn(s.kind, s.primary_addr, 30) for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)
    failures: list[str] = []

    def client(i: int) -> None:
        try:
            barrier.wait(30)
            end = time.perf_counter() + seconds
            n = 0
            while n < 5_000_000:
                t = time.perf_counter()
                if t >= end:
                    break
                if s.durable_write(conns[i], b"m%02d-%012d" % (i, n)):
                    lats[i].append((time.perf_counter() - t) * 1e6)
                else:
                    errs[i] += 1
                n += 1
        except Exception as e:  # reported below
            failures.append(f"client {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    try:
        for t in threads:
            t.start()
        barrier.wait(30)
        t0 = time.perf_counter()
        for t in threads:
            t.join(seconds + 60)
        elapsed = time.perf_counter() - t0
    finally:
        for c in conns:
            c.close()
    if failures:
        raise RuntimeError("; ".join(failures[:3]))
    all_lat = [x for per in lats for x in per]
    return {
        "clients": clients,
        "ops": len(all_lat),
        "errors": sum(errs),
        "seconds": elapsed,
        "ops_per_s": len(all_lat) / elapsed,
        "latency_us_p50": percentile(all_lat, 50),
        "latency_us_p99": percentile(all_lat, 99),
        "latency_us_max": max(all_lat) if all_lat else float("nan"),
    }


def measure_majority(kind: str, duration: float, clients: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"repl-{kind}-") as d, ExitStack() as stack:
        s = SYSTEM_CLASSES[kind](Path(d), stack, BG_KEYS, majority=True)
        s.start_primary()
        s.start_replica()
        s.wait_following()
        # Until the replica follows, a durable write fails (sluice: durability impossible; Redis:
        # WAIT returns 0; Tarantool: quorum timeout after 5 s).
        c = Conn(kind, s.primary_addr, 30)
        try:
            wait_until(lambda: s.durable_write(c, b"warm-up"), 120, f"{kind} first durable write", 0.05)
        finally:
            c.close()
        out = durable_clients(s, duration, clients)
        log(
            f"  {kind}: durable writes, {clients} clients: {out['ops_per_s']:,.0f}/s, p50 "
            f"{out['latency_us_p50']:,.0f} us p99 {out['latency_us_p99']:,.0f} us, errors {out['errors']}"
        )
        if kind == "sluice":
            nb = sluice_bench(s.primary_addr, duration)
            out["sluice_bench"] = nb
            log(
                f"  sluice: sluice bench 16 x 32 majority: {nb['ops_per_s']:,.0f}/s, p50 "
                f"{nb['latency_us']['p50']:,} us p99 {nb['latency_us']['p99']:,} us, errors {nb['errors']}"
            )
    return out


# ---------------------------------------------------------------------------------------------
# Output.


def med(runs: list[dict], *path: str) -> float | None:
    vals = []
    for r in runs:
        if "error" in r:
            continue
        for p in path:
            r = r.get(p) if isinstance(r, dict) else None
        if isinstance(r, (int, float)) and not math.isnan(r):
            vals.append(r)
    return statistics.median(vals) if vals else None


def summarize(res: dict) -> dict:
    summary = {}
    for kind, per in res["systems"].items():
        c, lag, maj = per["catchup"], per["lag"], per["majority"]
        summary[kind] = {
            "catchup_items_per_s": med(c, "items_per_s"),
            "catchup_seconds": med(c, "seconds"),
            "replica_ready_after_spawn_s": med(c, "replica_ready_after_spawn_s"),
            "max_set_rate": med(lag, "max_set_rate"),
            "sluice_bench_max": med(lag, "sluice_bench_max", "ops_per_s"),
            "background_rate": med(lag, "background_rate"),
            "target_rate": med(lag, "target_rate"),
            "lag_ms_p50": med(lag, "lag_ms_p50"),
            "lag_ms_p99": med(lag, "lag_ms_p99"),
            "probes": med(lag, "probes"),
            "timeouts": med(lag, "timeouts"),
            "majority_ops_per_s": med(maj, "ops_per_s"),
            "majority_p50_us": med(maj, "latency_us_p50"),
            "majority_p99_us": med(maj, "latency_us_p99"),
            "majority_errors": med(maj, "errors"),
            "bench_majority_ops_per_s": med(maj, "sluice_bench", "ops_per_s"),
            "bench_majority_p50_us": med(maj, "sluice_bench", "latency_us", "p50"),
            "bench_majority_p99_us": med(maj, "sluice_bench", "latency_us", "p99"),
            "failed_runs": {
                t: sum("error" in r for r in per[t]) for t in ("catchup", "lag", "majority") if per[t]
            },
        }
    return summary


def fmt(v: float | None, spec: str = ",.0f", unit: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{unit}"


def write_outputs(res: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    res["summary"] = sm = summarize(res)
    (RESULTS / "replication.json").write_text(json.dumps(res, indent=2) + "\n")

    def cell(kind: str, key: str, spec: str = ",.0f", unit: str = "") -> str:
        if kind in res["skipped"]:
            return "skipped"
        return fmt(sm.get(kind, {}).get(key), spec, unit)

    def cells(key: str, spec: str = ",.0f", unit: str = "") -> list[str]:
        return [cell(k, key, spec, unit) for k in SYSTEMS]

    def sluice_only(text: str) -> list[str]:
        return [text] + ["skipped" if k in res["skipped"] else "n/a" for k in SYSTEMS[1:]]

    def line(metric: str, values: list[str], target: str = "", met: str = "") -> str:
        return f"| {metric} | {' | '.join(values)} | {target} | {met} |"

    def yes(ok: bool | None) -> str:
        return "—" if ok is None else ("yes" if ok else "no")

    def share(k: str) -> str:
        if k in res["skipped"]:
            return "skipped"
        got, top = sm.get(k, {}).get("background_rate"), sm.get(k, {}).get("max_set_rate")
        return fmt(got / top * 100 if got and top else None, ".0f", "%")

    s = sm.get("sluice", {})
    cu, cr = s.get("catchup_items_per_s"), sm.get("redis", {}).get("catchup_items_per_s")
    ratio = cu / cr if cu and cr else None
    p99 = s.get("lag_ms_p99")
    items = res["items"]
    bench_lat = f"{fmt(s.get('bench_majority_p50_us'))} / {fmt(s.get('bench_majority_p99_us'))}"
    rows = [
        "| metric | sluice | Redis | Tarantool | target | met? |",
        "|---|---|---|---|---|---|",
        line(
            f"catch-up from empty, {items:,} items (items/s)",
            cells("catchup_items_per_s"),
            f"≥ {TARGET_CATCHUP:,} items/s",
            yes(None if cu is None else cu >= TARGET_CATCHUP),
        ),
        line(
            "catch-up, sluice / Redis",
            sluice_only(fmt(ratio, ".2f", "x")),
            f"≥ {TARGET_CATCHUP_VS_REDIS:.0f}x Redis",
            yes(None if ratio is None else ratio >= TARGET_CATCHUP_VS_REDIS),
        ),
        line("catch-up time (s, replica spawn → all items)", cells("catchup_seconds", ".2f")),
        line("max SET rate with the replica attached (loader, SET/s)", cells("max_set_rate")),
        line("background SET rate achieved (SET/s)", cells("background_rate")),
        line("background rate / max SET rate", [share(k) for k in SYSTEMS], "50%"),
        line("replication lag p50 (ms)", cells("lag_ms_p50", ".2f")),
        line(
            "replication lag p99 (ms)",
            cells("lag_ms_p99", ".2f"),
            f"≤ {TARGET_LAG_P99_MS:.0f} ms (sluice)",
            yes(None if p99 is None else p99 <= TARGET_LAG_P99_MS),
        ),
        line("lag probes", cells("probes")),
        line(f"lag probes not seen within {PROBE_TIMEOUT_S:.0f} s", cells("timeouts")),
        line(f"majority writes, {res['clients']} clients x 1 in flight (ops/s)", cells("majority_ops_per_s")),
        line("majority write latency p50 (µs)", cells("majority_p50_us")),
        line("majority write latency p99 (µs)", cells("majority_p99_us")),
        line("majority writes not acknowledged by the replica", cells("majority_errors")),
        line(
            "sluice bench, majority SETs, 16 conns x pipeline 32 (ops/s)",
            sluice_only(fmt(s.get("bench_majority_ops_per_s"))),
        ),
        line("sluice bench, majority SET latency p50 / p99 (µs)", sluice_only(bench_lat)),
        line(
            "sluice bench, max SET rate with the replica, 16 x 32 (ops/s)",
            sluice_only(fmt(s.get("sluice_bench_max"))),
        ),
    ]
    failed = [
        f"{LABELS[k]} {t}: {n} failed run(s)"
        for k, v in sm.items()
        for t, n in v.get("failed_runs", {}).items()
        if n
    ]
    skipped = [f"{LABELS[k]} skipped: {why}" for k, why in res["skipped"].items()]
    ready = s.get("replica_ready_after_spawn_s")
    notes = [
        f"Catch-up is timed from the replica's spawn; the sluice replica's Python process takes "
        f"{fmt(ready, '.2f')} s of that to get ready."
        if ready is not None
        else "",
        "Lag: probes every 2 ms, replica polled every 0.2 ms; polling stops 2 s after the write "
        "(an unseen probe counts as 2 s, a lower bound), a single slow poll can report more. "
        "Background SETs paced per 10 ms tick by one loader process (4 connections); max SET "
        "rate from the same loader at 4 x 256 in flight, replica attached.",
        f"Majority writes: {res['clients']} Python threads on raw sockets, one write in flight "
        'each: sluice SET on a durability = "majority" bucket, Redis SET + WAIT 1 1000, '
        "Tarantool replace into an is_sync space (replication_synchro_quorum 2).",
        *skipped,
        *failed,
    ]
    md = (
        f"# Replication: sluice against Redis and Tarantool\n\n`{res['command']}` on {res['machine']}, "
        f"{res['date']}; {res['versions']}. Medians of {res['runs']} run(s), every run in "
        "replication.json; primary, replica and load share the machine.\n\n"
        + "\n".join(rows)
        + "\n\n"
        + "\n".join(f"- {n}" for n in notes if n)
        + "\n"
    )
    (RESULTS / "replication.md").write_text(md)
    print(md)
    plot(res, sm)


def plot(res: dict, sm: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no plot", file=sys.stderr)
        return
    kinds = [k for k in SYSTEMS if k in sm]
    colors = {"sluice": "#4C72B0", "redis": "#DD8452", "tarantool": "#55A868"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))

    def val(k: str, key: str, scale: float = 1) -> float:
        v = sm[k].get(key)
        return 0.0 if v is None else v / scale

    def bars(ax, xs: list[float], vals: list[float], **kw: object) -> None:
        drawn = ax.bar(xs, [v if v > 0 else float("nan") for v in vals], **kw)
        ax.bar_label(drawn, labels=[f"{v:,.3g}" if v > 0 else "" for v in vals], fontsize=7)

    ticks = (range(len(kinds)), [LABELS[k] for k in kinds])
    ax = axes[0]
    bars(
        ax,
        list(ticks[0]),
        [val(k, "catchup_items_per_s", 1e6) for k in kinds],
        color=[colors[k] for k in kinds],
    )
    ax.axhline(TARGET_CATCHUP / 1e6, color="red", linestyle="--", linewidth=1)
    ax.set_xticks(*ticks)
    ax.set_ylabel("million items/s (median)")
    ax.set_title(f"catch-up from empty, {res['items']:,} items", fontsize=10)

    ax = axes[1]
    for j, key in enumerate(("lag_ms_p50", "lag_ms_p99")):
        bars(
            ax,
            [i - 0.2 + 0.4 * j for i in ticks[0]],
            [val(k, key) for k in kinds],
            width=0.4,
            color=[colors[k] for k in kinds],
            alpha=0.55 if j == 0 else 1.0,
        )
    ax.axhline(TARGET_LAG_P99_MS, color="red", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(*ticks)
    ax.set_ylabel("ms, log scale (light: p50, dark: p99)")
    ax.set_title("replication lag at 50% of max SET rate", fontsize=10)

    ax = axes[2]
    bars(
        ax,
        list(ticks[0]),
        [val(k, "majority_ops_per_s", 1e3) for k in kinds],
        color=[colors[k] for k in kinds],
    )
    ax.set_xticks(*ticks)
    ax.set_ylabel("thousand writes/s (median)")
    ax.set_title(f"majority writes, {res['clients']} clients x 1 in flight", fontsize=10)
    fig.suptitle("sluice, Redis and Tarantool replication on one machine (red: sluice target)", fontsize=11)
    fig.tight_layout()
    fig.savefig(RESULTS / "replication.png", dpi=110)
    print(f"wrote {RESULTS / 'replication.png'}", file=sys.stderr)


def versions(kinds: list[str]) -> str:
    out = [f"sluice {getattr(sluice, '__version__', '?')}"]
    for k, cmd in (("redis", ["redis-server", "--version"]), ("tarantool", ["tarantool", "--version"])):
        if k in kinds:
            line = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
            out.append(line.split(" sha=")[0].replace("Redis server v=", "Redis "))
    return ", ".join(out)


def main() -> int:
    global RESULTS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=1_000_000, help="items for the catch-up test")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--duration", type=float, default=10.0, help="seconds of paced load and of majority writes"
    )
    ap.add_argument(
        "--max-rate-duration", type=float, default=3.0, help="seconds to measure the max SET rate"
    )
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients for majority writes")
    ap.add_argument("--skip-peers", action="store_true", help="run sluice only")
    ap.add_argument(
        "--only",
        action="append",
        choices=["catchup", "lag", "majority"],
        help="run only this test (repeatable)",
    )
    ap.add_argument("--results", type=Path, default=RESULTS, help="where replication.{json,md,png} go")
    args = ap.parse_args()
    RESULTS = args.results

    skipped: dict[str, str] = {}
    kinds = ["sluice"]
    for peer in ("redis", "tarantool"):
        why = "--skip-peers" if args.skip_peers else peer_problem(peer)
        if why:
            skipped[peer] = why
            log(f"skipping {LABELS[peer]}: {why}")
        else:
            kinds.append(peer)
    res: dict = {
        "command": " ".join(["python bench/replication_bench.py", *sys.argv[1:]]),
        "items": args.items,
        "runs": args.runs,
        "duration": args.duration,
        "max_rate_duration": args.max_rate_duration,
        "clients": args.clients,
        "key_size": len(KEY % 0),
        "value_size": len(VALUE),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}",
        "versions": versions(kinds),
        "settings": {
            "sluice": 'wal.mode = "write", memory_quota = "4GiB"; majority test: durability = "majority", '
            "replicas = 1; catch-up load: raw pipelined SETs, 4 connections x 512",
            "redis": '--save "" --appendonly no, repl-diskless-sync yes, repl-diskless-sync-delay 0; '
            "replica: repl-diskless-load on-empty-db; load: redis-py pipelines of 10k",
            "tarantool": "memtx, hash primary index, wal_mode write, memtx_memory max(1 GiB, 512 B/item); "
            "majority: is_sync space, replication_synchro_quorum 2, replication_synchro_timeout 5; "
            "load: Lua loop in the master, transactions of 1000",
        },
        "skipped": skipped,
        "systems": {k: {"catchup": [], "lag": [], "majority": []} for k in kinds},
    }
    failures = 0
    tests = (
        ("catchup", lambda k: measure_catchup(k, args.items)),
        ("lag", lambda k: measure_lag(k, args.duration, args.max_rate_duration)),
        ("majority", lambda k: measure_majority(k, args.duration, args.clients)),
    )
    tests = tuple(t for t in tests if not args.only or t[0] in args.only)
    for run in range(args.runs):
        order = kinds if run % 2 == 0 else kinds[::-1]
        for test, fn in tests:
            for kind in order:
                log(f"run {run + 1}/{args.runs}: {test} | {LABELS[kind]}")
                try:
                    r = fn(kind)
                except Exception as e:  # recorded, the other systems still run
                    failures += 1
                    r = {"error": f"{type(e).__name__}: {e}"}
                    log(f"  {kind} {test} FAILED: {r['error'][:2000]}")
                res["systems"][kind][test].append(r)
    write_outputs(res)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
