"""DCP on the wire, written from the byte layouts of shared/reference/couchbase-kv/dcp/
(commands/*.md), not from sluice's encoder: requests a consumer sends, and parsers for what a
producer sends. Used by the DCP tests to talk to a real `sluice serve` over a socket."""

from __future__ import annotations

import socket
import struct
import time

from mcbp_wire import read_frame, request, sasl_plain

OPEN, ADD_STREAM, CLOSE_STREAM, STREAM_REQ, GET_FAILOVER_LOG, STREAM_END = 0x50, 0x51, 0x52, 0x53, 0x54, 0x55
SNAPSHOT_MARKER, MUTATION, DELETION, EXPIRATION = 0x56, 0x57, 0x58, 0x59
NOOP, BUFFER_ACK, CONTROL = 0x5C, 0x5D, 0x5E
SET_VBUCKET_STATE, SEQNO_ACKNOWLEDGED = 0x5B, 0x61

PRODUCER = 0x01
NO_VALUE = 0x08
INCLUDE_DELETE_TIMES = 0x20

FLAG_TAKEOVER = 0x01
FLAG_TO_LATEST = 0x04
FLAG_FROM_LATEST = 0x40

SNAP_MEMORY, SNAP_DISK, SNAP_CHECKPOINT = 0x01, 0x02, 0x04

END_OK, END_CLOSED, END_TOO_SLOW = 0x00, 0x01, 0x04

MAX_SEQNO = 0xFFFFFFFFFFFFFFFF


def frame(
    opcode: int,
    key: bytes = b"",
    value: bytes = b"",
    extras: bytes = b"",
    opaque: int = 0,
    vbucket: int = 0,
    magic: int = 0x80,
    status: int | None = None,
) -> bytes:
    """A request (or, with `status`, a response) of `opcode`."""
    word = vbucket if status is None else status
    return request(opcode, key, value, extras, opaque=opaque, vbucket=word, magic=magic)


def open_producer(name: bytes, flags: int = PRODUCER, opaque: int = 1) -> bytes:
    # open-connection.md: 8 bytes of extras, the first 4 reserved (seqno), then flags.
    return frame(OPEN, key=name, extras=struct.pack(">II", 0, flags), opaque=opaque)


def control(key: str, value: str, opaque: int = 2) -> bytes:
    return frame(CONTROL, key=key.encode(), value=value.encode(), opaque=opaque)


def stream_req(
    vbucket: int,
    start: int = 0,
    end: int = MAX_SEQNO,
    uuid: int = 0,
    snap_start: int | None = None,
    snap_end: int | None = None,
    flags: int = 0,
    opaque: int | None = None,
) -> bytes:
    # stream-request.md: flags, reserved, start, end, vbucket uuid, snapshot start, end (48 bytes).
    snap_start = start if snap_start is None else snap_start
    snap_end = start if snap_end is None else snap_end
    extras = struct.pack(">IIQQQQQ", flags, 0, start, end, uuid, snap_start, snap_end)
    return frame(
        STREAM_REQ, extras=extras, vbucket=vbucket, opaque=0x1000 + vbucket if opaque is None else opaque
    )


def buffer_ack(nbytes: int) -> bytes:
    return frame(BUFFER_ACK, extras=struct.pack(">I", nbytes))


def seqno_ack(vbucket: int, seqno: int, opaque: int = 0) -> bytes:
    # seqno-acknowledged.md: 8 bytes of extras (prepared seqno), no key, no value, no reply.
    return frame(SEQNO_ACKNOWLEDGED, extras=struct.pack(">Q", seqno), vbucket=vbucket, opaque=opaque)


def failover_log(value: bytes) -> list[tuple[int, int]]:
    """stream-request.md / failover-log.md: 16-byte (uuid, seqno) entries, newest first."""
    assert len(value) % 16 == 0 and value, value
    return [struct.unpack_from(">QQ", value, i) for i in range(0, len(value), 16)]


def parse_message(f: dict) -> dict:
    """A producer's message (a request frame) as a dict, extras split per the command pages."""
    assert f["magic"] == 0x80, f
    op, ex = f["opcode"], f["extras"]
    m = {"op": op, "vbucket": f["word"], "opaque": f["opaque"], "size": f["size"]}
    if op == SNAPSHOT_MARKER:
        assert len(ex) == 20, ex  # snapshot-marker.md v1: start, end, flags
        m["start"], m["end"], m["flags"] = struct.unpack(">QQI", ex)
    elif op == MUTATION:
        assert len(ex) == 31, ex  # mutation.md: by_seqno, rev_seqno, flags, expiration, lock, nmeta, nru
        by, rev, flags, exp, lock, nmeta, nru = struct.unpack(">QQIIIHB", ex)
        m.update(seqno=by, rev=rev, flags=flags, expiry=exp, key=f["key"], value=f["value"], cas=f["cas"])
        assert nmeta == 0
    elif op == DELETION:
        assert len(ex) in (18, 21), ex  # deletion.md: v1 nmeta, v2 delete time + 1 unused byte
        by, rev = struct.unpack_from(">QQ", ex)
        m.update(seqno=by, rev=rev, key=f["key"], value=f["value"], cas=f["cas"])
        if len(ex) == 21:
            m["delete_time"] = struct.unpack_from(">I", ex, 16)[0]
    elif op == EXPIRATION:
        assert len(ex) == 20, ex  # expiration.md: by_seqno, rev_seqno, delete time
        by, rev, dt = struct.unpack(">QQI", ex)
        m.update(seqno=by, rev=rev, delete_time=dt, key=f["key"], cas=f["cas"])
    elif op == SET_VBUCKET_STATE:
        assert len(ex) == 1, ex  # set-vbucket-state.md: one state byte
        m["state"] = ex[0]
    elif op == STREAM_END:
        assert len(ex) == 4, ex  # stream-end.md: flags (reason)
        m["reason"] = struct.unpack(">I", ex)[0]
    return m


class DcpConnection:
    """A hand-written consumer: one socket, requests answered in order, producer messages queued."""

    def __init__(
        self,
        host: str,
        port: int,
        name: bytes = b"test:consumer",
        flags: int = PRODUCER,
        login: tuple[str, str] | None = None,
    ):
        self.sock = socket.create_connection((host, port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending: list[dict] = []
        if login is not None:  # SASL PLAIN (0x21) first, on a node with users
            r = self.call(sasl_plain(*login))
            assert r["word"] == 0, r
        r = self.call(open_producer(name, flags))
        assert r["word"] == 0, r

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def call(self, data: bytes) -> dict:
        """Sends a request and returns its response, queueing producer messages read meanwhile."""
        self.send(data)
        opcode = data[1]
        while True:
            f = read_frame(self.sock)
            if f["magic"] == 0x81 and f["opcode"] == opcode:
                return f
            self.pending.append(f)

    def control(self, key: str, value: str) -> int:
        return self.call(control(key, value))["word"]

    def next_message(self, timeout: float = 30) -> dict:
        """The next producer message (NOOPs are answered and skipped)."""
        while True:
            if self.pending:
                f = self.pending.pop(0)
            else:
                self.sock.settimeout(timeout)
                f = read_frame(self.sock)
            if f["magic"] == 0x80 and f["opcode"] == NOOP:
                self.send(frame(NOOP, magic=0x81, opaque=f["opaque"], status=0))
                continue
            return parse_message(f)

    def collect(self, until, timeout: float = 60) -> list[dict]:
        """Messages until `until(messages)` is true."""
        out: list[dict] = []
        deadline = time.monotonic() + timeout
        while not until(out):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out after {len(out)} messages"
            out.append(self.next_message(timeout=left))
        return out

    def close(self) -> None:
        self.sock.close()
