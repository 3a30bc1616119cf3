"""TAP on the wire, written from seed 000 and memcached's protocol_binary.h, not from sluice's
encoder: TAP_CONNECT as a client sends it, and a reader for the messages a producer sends."""

from __future__ import annotations

import dataclasses
import socket
import struct

from mcbp_wire import HEADER, recv_exact

CONNECT, MUTATION, DELETE, FLUSH, OPAQUE, VBUCKET_SET, CHECKPOINT_START, CHECKPOINT_END = range(0x40, 0x48)
BACKFILL, DUMP, LIST_VBUCKETS, TAKEOVER_VBUCKETS = 0x01, 0x02, 0x04, 0x08
SUPPORT_ACK, KEYS_ONLY, CHECKPOINT, REGISTERED_CLIENT = 0x10, 0x20, 0x40, 0x80
FLAG_ACK, FLAG_NO_VALUE = 0x01, 0x02
INITIAL_VBUCKET_STREAM, CLOSE_TAP_STREAM, CLOSE_BACKFILL = 1, 7, 8
SUCCESS, EBUSY, ETMPFAIL = 0x00, 0x85, 0x86


def connect_frame(name: bytes, flags: int = 0, body: bytes = b"", extras_len: int = 4) -> bytes:
    extras = b"" if flags == 0 and extras_len == 4 else flags.to_bytes(extras_len, "big")
    total = len(extras) + len(name) + len(body)
    return HEADER.pack(0x80, CONNECT, len(name), len(extras), 0, 0, total, 0, 0) + extras + name + body


def vbucket_list(*vbs: int) -> bytes:
    return struct.pack(">H", len(vbs)) + b"".join(struct.pack(">H", v) for v in vbs)


@dataclasses.dataclass
class Message:
    opcode: int
    vbucket: int
    opaque: int
    cas: int
    tap_flags: int
    ttl: int
    engine_specific: bytes
    key: bytes
    value: bytes
    item_flags: int = 0
    expiry: int = 0

    @property
    def wants_ack(self) -> bool:
        return bool(self.tap_flags & FLAG_ACK)

    @property
    def code(self) -> int:
        return struct.unpack(">I", self.engine_specific[:4])[0]


def read_message(sock: socket.socket) -> Message:
    magic, op, keylen, extlen, _dt, vb, body, opaque, cas = HEADER.unpack(recv_exact(sock, 24))
    data = recv_exact(sock, body)
    assert magic == 0x80, f"a TAP message is a request, got magic {magic:#x} (opcode {op:#x}: {data!r})"
    es_len, tap_flags, ttl = struct.unpack(">HHB", data[:5])
    item_flags = expiry = 0
    if op == MUTATION:
        assert extlen == 16, extlen
        item_flags, expiry = struct.unpack(">II", data[8:16])
    else:
        assert extlen == 8, (op, extlen)
    es = data[extlen : extlen + es_len]
    key = data[extlen + es_len : extlen + es_len + keylen]
    value = data[extlen + es_len + keylen :]
    return Message(op, vb, opaque, cas, tap_flags, ttl, es, key, value, item_flags, expiry)


def ack(sock: socket.socket, m: Message, status: int = SUCCESS) -> None:
    sock.sendall(HEADER.pack(0x81, m.opcode, 0, 0, 0, status, 0, m.opaque, 0))


def as_command(m: Message) -> bytes:
    """The message forwarded to another node as a command (what a relay between two nodes sends)."""
    extras = struct.pack(">HHB3x", len(m.engine_specific), m.tap_flags, m.ttl)
    if m.opcode == MUTATION:
        extras += struct.pack(">II", m.item_flags, m.expiry)
    body = extras + m.engine_specific + m.key + m.value
    return (
        HEADER.pack(0x80, m.opcode, len(m.key), len(extras), 0, m.vbucket, len(body), m.opaque, m.cas) + body
    )


class TapClient:
    """A TAP client on a socket: reads messages, acknowledges those that ask (unless told not to)."""

    def __init__(
        self,
        address: tuple[str, int],
        name: bytes,
        flags: int = 0,
        body: bytes = b"",
        *,
        extras_len: int = 4,
        raw: bytes | None = None,
    ) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.sock.sendall(raw if raw is not None else connect_frame(name, flags, body, extras_len))

    def next(self, timeout: float = 10) -> Message:
        self.sock.settimeout(timeout)
        return read_message(self.sock)

    def take(self, n: int, *, auto_ack: bool = True, timeout: float = 10) -> list[Message]:
        out = []
        while len(out) < n:
            m = self.next(timeout)
            if auto_ack and m.wants_ack:
                ack(self.sock, m)
            out.append(m)
        return out

    def mutations_until(self, count: int, *, auto_ack: bool = True, timeout: float = 10) -> list[Message]:
        """Messages until `count` mutations or deletions arrived (others kept in order too)."""
        out, docs = [], 0
        while docs < count:
            m = self.next(timeout)
            if auto_ack and m.wants_ack:
                ack(self.sock, m)
            out.append(m)
            docs += m.opcode in (MUTATION, DELETE)
        return out

    def silent_for(self, seconds: float) -> bool:
        """True when nothing arrives for `seconds`."""
        self.sock.settimeout(seconds)
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            return True
        return False  # a message arrived, or the connection closed

    def drain(self, quiet: float = 0.5) -> list[Message]:
        """Every message until none comes for `quiet` seconds."""
        out = []
        while True:
            try:
                out.append(self.next(timeout=quiet))
            except TimeoutError:
                return out

    def close(self) -> None:
        self.sock.close()
