"""Reads and writes over the memcached binary protocol, for :class:`sluice.Client`: one blocking
connection per client, opened on first use, logged in with SASL PLAIN when the client has a
user, on the client's bucket (SELECT_BUCKET).

Durable writes carry the durability frame info (magic 0x08): the reply comes once the level is
met (docs/replication.md); a level that cannot be met is
:class:`sluice.DurabilityImpossibleError`, one not met in time
:class:`sluice.SyncWriteAmbiguousError`.
"""

from __future__ import annotations

import json
import struct
import threading
from typing import NamedTuple

from sluice._native import (
    DurabilityImpossibleError,
    ExistsError,
    InvalidKeyError,
    NoSuchBucketError,
    NotFoundError,
    NotMyVbucketError,
    NotStoredError,
    SluiceError,
    SyncWriteAmbiguousError,
    TempFailError,
    TooBigError,
)
from sluice.tls import connect

# Request magics: plain, and with framing extras (alt request).
REQUEST, ALT_REQUEST = 0x80, 0x08
RESPONSE = 0x81
HEADER = struct.Struct(">BBHBBHIIQ")  # magic opcode keylen extlen datatype vbucket|status bodylen opaque cas
GET, SET, ADD, DELETE, STAT, HELLO, SASL_AUTH, SELECT_BUCKET = 0x00, 0x01, 0x02, 0x04, 0x10, 0x1F, 0x21, 0x89
FEATURE_XERROR, FEATURE_SELECT_BUCKET, FEATURE_MUTATION_SEQNO = 0x07, 0x08, 0x04
FRAME_DURABILITY = 0x01

#: Durability levels a request can ask for (the bucket's `durability` applies otherwise).
DURABILITY_LEVELS = {"majority": 1, "majority_and_persist_active": 2, "persist_to_majority": 3}

_ERRORS: dict[int, type[SluiceError]] = {
    0x01: NotFoundError,
    0x02: ExistsError,
    0x03: TooBigError,
    0x04: InvalidKeyError,
    0x05: NotStoredError,
    0x07: NotMyVbucketError,
    0x08: NoSuchBucketError,
    0x86: TempFailError,
    0xA1: DurabilityImpossibleError,
    0xA3: SyncWriteAmbiguousError,
}


class Stored(NamedTuple):
    """What a write returns: the item's new CAS, and where the change sits in its vbucket's
    history (the seqno and the uuid of the vbucket's history branch)."""

    cas: int
    seqno: int
    vbucket_uuid: int


class Item(NamedTuple):
    value: bytes
    flags: int
    cas: int


class KvConnection:
    """One connection to a node's KV port; requests are sent one at a time (a lock). With
    ``bucket`` None no bucket is selected (STAT spaces needs none). With ``cafile`` it is a TLS
    connection (to the TLS port) whose certificate must chain to those CAs."""

    def __init__(
        self,
        address: str,
        bucket: str | None,
        username: str | None,
        password: str | None,
        timeout: float,
        cafile: str | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sock = connect(address, timeout, cafile)
        try:
            features = struct.pack(">HHH", FEATURE_XERROR, FEATURE_SELECT_BUCKET, FEATURE_MUTATION_SEQNO)
            self.request(HELLO, key=b"sluice-client", value=features)
            if username is not None:
                plain = b"\0" + username.encode() + b"\0" + (password or "").encode()
                self.request(SASL_AUTH, key=b"PLAIN", value=plain)
            if bucket is not None:
                self.request(SELECT_BUCKET, key=bucket.encode())
        except BaseException:
            self._sock.close()
            raise

    def close(self) -> None:
        self._sock.close()

    def request(
        self,
        opcode: int,
        *,
        key: bytes = b"",
        extras: bytes = b"",
        value: bytes = b"",
        cas: int = 0,
        durability: str | None = None,
        durability_timeout: float | None = None,
    ) -> tuple[bytes, bytes, int]:
        """Sends one request; returns the reply's extras, value and CAS, or raises the error
        the status stands for (with the server's message)."""
        frame = b""
        if durability is not None:
            if durability not in DURABILITY_LEVELS:
                raise ValueError(
                    f"durability must be one of {', '.join(DURABILITY_LEVELS)}, not {durability!r}"
                )
            info = bytes([DURABILITY_LEVELS[durability]])
            if durability_timeout is not None:
                info += struct.pack(">H", max(1, min(65535, round(durability_timeout * 1000))))
            frame = bytes([FRAME_DURABILITY << 4 | len(info)]) + info
        if len(key) > 250:
            raise InvalidKeyError(f"the key is {len(key)} bytes; at most 250")
        body = len(frame) + len(extras) + len(key) + len(value)
        if frame:
            head = struct.pack(
                ">BBBBBBHIIQ", ALT_REQUEST, opcode, len(frame), len(key), len(extras), 0, 0, body, 0, cas
            )
        else:
            head = HEADER.pack(REQUEST, opcode, len(key), len(extras), 0, 0, body, 0, cas)
        # A durable write's reply waits for the level (or its timeout: the bucket's
        # durability_timeout, 10 s by default, when the request gives none).
        wait = self.timeout + (durability_timeout if durability_timeout is not None else 60.0) * bool(frame)
        with self._lock:
            self._sock.settimeout(wait)
            self._sock.sendall(head + frame + extras + key + value)
            _, rextras, rvalue, rcas = self._reply()
        return rextras, rvalue, rcas

    def stats(self, group: str = "") -> dict[str, str]:
        """A STAT group as {name: value}: the node answers one reply per statistic and an
        empty one at the end."""
        key = group.encode()
        head = HEADER.pack(REQUEST, STAT, len(key), 0, 0, 0, len(key), 0, 0)
        out: dict[str, str] = {}
        with self._lock:
            self._sock.settimeout(self.timeout)
            self._sock.sendall(head + key)
            while True:
                name, _, value, _ = self._reply()
                if not name:
                    return out
                out[name.decode(errors="replace")] = value.decode(errors="replace")

    def _reply(self) -> tuple[bytes, bytes, bytes, int]:
        """Reads one reply (the caller holds the lock): its key, extras, value and CAS, or
        raises the error its status stands for (with the server's message)."""
        magic, _, keylen, extlen, _, status, bodylen, _, cas = HEADER.unpack(self._read(HEADER.size))
        if magic != RESPONSE:
            raise SluiceError(f"{self.address} answered with magic {magic:#x}: not a memcached binary server")
        payload = self._read(bodylen)
        value = payload[extlen + keylen :]
        if status:
            why = _message(value) or f"status {status:#x}"
            raise _ERRORS.get(status, SluiceError)(f"{self.address}: {why}")
        return payload[extlen : extlen + keylen], payload[:extlen], value, cas

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise SluiceError(f"{self.address} closed the connection")
            buf += chunk
        return bytes(buf)


def stored(extras: bytes, cas: int) -> Stored:
    """A write's reply: its CAS, and the (uuid, seqno) extras MUTATION_SEQNO adds."""
    uuid, seqno = struct.unpack(">QQ", extras) if len(extras) == 16 else (0, 0)
    return Stored(cas, seqno, uuid)


def _message(body: bytes) -> str:
    """An error reply's text: XERROR's {"error": {"context": ...}} or the plain text."""
    text = body.decode(errors="replace")
    try:
        return json.loads(text)["error"]["context"]
    except (ValueError, KeyError, TypeError):
        return text
