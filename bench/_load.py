"""Raw client connections to sluice (memcached binary), Redis (RESP) and Tarantool (iproto),
and the loader that sends SETs over them as fast as acknowledged or paced at a rate."""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import socket
import struct
import time

from _common import MC_HEADER

try:
    import msgpack
except ImportError:  # the Tarantool peer is skipped
    msgpack = None

KEY = b"key:%012d"
VALUE = hashlib.sha512(b"sluice replication bench").hexdigest()[:100].encode()
# Loader: connections x pipeline depth when running flat out; requests go in prebuilt chunks.
LOADER_CONNECTIONS = 4
LOADER_DEPTH = 256
CHUNK = 16
BG_KEYS = 100_000
TICK_S = 0.01


# ---------------------------------------------------------------------------------------------
# Wire formats: requests as bytes, replies parsed off a bytearray.

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
