"""A client for Greenstack (docs/greenstack.md): :class:`AsyncClient` for asyncio, and
:class:`GreenstackClient`, the same methods blocking, with an event loop on a thread of its own.

One connection carries many requests at once: each has an opaque of its own, and one reader
task hands every reply to the request it answers, so replies may come back in any order (a GET
overtakes a durable write before it on its lane). Requests run on lanes (``lane=``); a fenced
one (``fence=True``) waits for its lane's earlier requests and holds back its later ones; a
quiet write (``quiet=True``) is answered only when it fails. The server's notices (back off,
shutting down, failed logins, the vbucket map changed) go to ``on_notice`` and to
:meth:`AsyncClient.notices`. A dropped connection fails the requests in flight
(:class:`ConnectionLostError`; :class:`AmbiguousWriteError` for writes, which the server may or
may not have applied) and, with ``reconnect=True``, the next request opens a new one. DCP over
Greenstack: :meth:`AsyncClient.stream`, an async iterator of :class:`sluice.Change`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import functools
import hashlib
import hmac
import inspect
import json
import logging
import secrets
import socket
import struct
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

if TYPE_CHECKING:
    from typing_extensions import Unpack

from sluice import _native
from sluice._native import (
    ClosedError,
    DurabilityImpossibleError,
    ExistsError,
    NoSuchBucketError,
    NotFoundError,
    NotMyVbucketError,
    NotStoredError,
    SluiceError,
    SyncWriteAmbiguousError,
    TempFailError,
    TooBigError,
    __version__,
)
from sluice.client import Change
from sluice.kv import Stored
from sluice.tls import client_context, server_name

log = logging.getLogger(__name__)

# Opcodes (docs/greenstack.md, "Opcodes").
HELLO, SASL_AUTH = 0x0001, 0x0002
SELECT_BUCKET, LIST_BUCKETS, MUTATION, GET = 0x0400, 0x0401, 0x0405, 0x0406
DELETE, TOUCH, GET_ALL_VB_SEQNOS, NOTICE = 0x0407, 0x0408, 0x0409, 0x0410
(
    DCP_OPEN,
    DCP_STREAM_REQUEST,
    DCP_SNAPSHOT_MARKER,
    DCP_MUTATION,
    DCP_DELETION,
    DCP_EXPIRATION,
    DCP_STREAM_END,
    DCP_CLOSE_STREAM,
    DCP_BUFFER_ACK,
) = range(0x0500, 0x0509)
STREAM_MESSAGES = range(DCP_SNAPSHOT_MARKER, DCP_STREAM_END + 1)

# The first flag byte's bits.
RESPONSE, FLEX, FENCE, MORE, QUIET = 0x01, 0x02, 0x04, 0x08, 0x10

# Flex header keys.
LANE_ID, PRIORITY, VBUCKET_ID, IGNORE_UNLESS_EXECUTED_BEFORE = 0x0000, 0x0005, 0x0007, 0x0009

# Statuses.
SUCCESS, INVALID_ARGUMENTS, AUTH_ERROR, NOT_INITIALIZED = 0x0000, 0x0001, 0x0003, 0x0005
INVALID_STATE, NO_ACCESS = 0x0006, 0x0007
NOT_FOUND, UNKNOWN_COMMAND, AUTH_CONTINUE = 0x0008, 0x0009, 0x000C
KEY_EXISTS, NOT_STORED, TOO_BIG, NOT_MY_VBUCKET, TEMPORARY_FAILURE = 0x0400, 0x0401, 0x0402, 0x0403, 0x0404
LOCKED, DURABILITY_IMPOSSIBLE, SYNC_WRITE_AMBIGUOUS = 0x0405, 0x0406, 0x0407
NOT_EXECUTED_IN_TIME, ROLLBACK = 0x0408, 0x0409

STATUS_NAMES = {
    0x0000: "success",
    0x0001: "invalid arguments",
    0x0002: "internal error",
    0x0003: "authentication error",
    0x0004: "authentication stale",
    0x0005: "not initialized",
    0x0006: "invalid state",
    0x0007: "no access",
    0x0008: "not found",
    0x0009: "unknown command",
    0x000A: "user agent blacklisted",
    0x000B: "not implemented",
    0x000C: "authentication continue",
    0x0400: "key exists",
    0x0401: "not stored",
    0x0402: "too big",
    0x0403: "not my vbucket",
    0x0404: "temporary failure",
    0x0405: "locked",
    0x0406: "durability impossible",
    0x0407: "sync write ambiguous",
    0x0408: "not executed in time",
    0x0409: "rollback",
}

# MUTATION's `type`.
ADD, SET, REPLACE, APPEND, PREPEND, PATCH = range(6)
DATATYPE_JSON = 0x01

#: Durability levels a write can ask for (None: the bucket's `durability`).
DURABILITY_LEVELS = ("none", "majority", "majority_and_persist_active", "persist_to_majority", "persist")

#: SASL mechanisms, strongest first.
SCRAM_HASHES = {"SCRAM-SHA512": "sha512", "SCRAM-SHA256": "sha256", "SCRAM-SHA1": "sha1"}
MECHANISMS = (*SCRAM_HASHES, "PLAIN")

# What a durable write may wait beyond the client's timeout: the server answers "sync write
# ambiguous" at the bucket's durability_timeout (10 s by default) on its own.
DURABLE_WRITE_WAIT = 60.0
# Delays before each attempt of a reconnect (the first at once): about 3 s in all.
RECONNECT_DELAYS = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
# The largest frame taken from the server: anything longer is a broken stream, not a value.
MAX_FRAME = 1 << 30
# Quiet writes whose failure may still come back (the oldest are forgotten past this).
MAX_QUIET_REMEMBERED = 65536
# Stream requests of one vbucket answered "rollback" in a row before the stream gives up.
MAX_ROLLBACKS = 8
# A server's SCRAM iteration count above this is refused rather than computed for minutes.
MAX_SCRAM_ITERATIONS = 10_000_000


class GreenstackError(SluiceError):
    """A request the server refused: ``.status`` (docs/greenstack.md, "Statuses") and
    ``.message``, the server's text."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class AuthenticationError(GreenstackError):
    """The login was refused, or the server could not prove (SCRAM's signature) that it knows
    the password's keys."""


class NoAccessError(GreenstackError):
    """The user lacks the permission the request needs on the bucket (read, write, stream)."""


class NotExecutedInTimeError(GreenstackError):
    """The request waited longer than its ``execute_within_ms`` to start, and was not run."""


class ConnectionLostError(ConnectionError):
    """The connection closed (or could not be opened again) before the request was answered."""


class AmbiguousWriteError(ConnectionLostError):
    """A write was in flight when the connection closed: the server may or may not have applied
    it. Read the key back (or write it again, when that is safe) to know."""


_NATIVE_ERRORS: dict[int, type[SluiceError]] = {
    NOT_FOUND: NotFoundError,
    KEY_EXISTS: ExistsError,
    NOT_STORED: NotStoredError,
    TOO_BIG: TooBigError,
    NOT_MY_VBUCKET: NotMyVbucketError,
    TEMPORARY_FAILURE: TempFailError,
    DURABILITY_IMPOSSIBLE: DurabilityImpossibleError,
    SYNC_WRITE_AMBIGUOUS: SyncWriteAmbiguousError,
}
_OWN_ERRORS: dict[int, type[GreenstackError]] = {
    AUTH_ERROR: AuthenticationError,
    NO_ACCESS: NoAccessError,
    NOT_EXECUTED_IN_TIME: NotExecutedInTimeError,
}


def error_for(status: int, message: str, opcode: int) -> SluiceError:
    """The exception a failed reply stands for, with ``.status`` and ``.message`` (the
    server's text) on it whatever its class."""
    name = STATUS_NAMES.get(status, f"status {status:#06x}")
    # The server's text often starts with the status's name already: not said twice.
    text = message if message.startswith(name) else f"{name}: {message}"
    if opcode == SELECT_BUCKET and status == NOT_FOUND:
        error: SluiceError = NoSuchBucketError(text)
    elif status in _NATIVE_ERRORS:
        error = _NATIVE_ERRORS[status](text)
    else:
        return _OWN_ERRORS.get(status, GreenstackError)(text, status)
    error.status = status  # type: ignore[attr-defined]
    error.message = message  # type: ignore[attr-defined]
    return error


class Item(NamedTuple):
    value: bytes
    flags: int
    cas: int
    datatype: int  # 1: JSON


class Notice(NamedTuple):
    """A notice from the server: its ``kind`` ("backoff", "shutdown", "failed_logins",
    "map_changed", or one this client does not know yet) and ``fields``, its whole payload."""

    kind: str
    fields: dict[str, Any]


class QuietFailure(NamedTuple):
    """A quiet write the server refused: the command, the key, and the error it stands for."""

    command: str
    key: str | bytes
    error: BaseException


class Frame(NamedTuple):
    """A frame from the server: a reply (``status`` set) or a request of its own."""

    opaque: int
    opcode: int
    flags: int
    status: int | None
    flex: dict[int, bytes]
    payload: dict[str, Any]
    size: int  # on the wire, the length field included


class ProtocolViolation(Exception):
    """The server sent something that is not a Greenstack frame: the connection is closed."""


def encode_frame(
    opaque: int,
    opcode: int,
    payload: dict[str, Any] | None = None,
    *,
    flags: int = 0,
    status: int | None = None,
    flex: tuple[tuple[int, bytes], ...] = (),
) -> bytes:
    """One frame: a request, or a reply when ``status`` is given (the server's own codec,
    `sluice._native.greenstack_frame`)."""
    return _native.greenstack_frame(opaque, opcode, payload, flags=flags, status=status, flex=list(flex))


def decode_frame(body: bytes) -> Frame:
    """A frame's body (what follows its length field), read by the server's own codec."""
    try:
        opaque, opcode, flags, status, flex, payload = _native.greenstack_decode(body)
    except ValueError as e:
        raise ProtocolViolation(str(e)) from None
    return Frame(opaque, opcode, flags, status, flex, payload, 4 + len(body))


class ScramClient:
    """The client's side of SCRAM (RFC 5802) with SHA-512, SHA-256 or SHA-1: the client-first
    message, the client-final one (with the proof) for the server-first one, and the check of
    the server's signature in the server-final one."""

    def __init__(self, mechanism: str, username: str, password: str, nonce: str | None = None) -> None:
        if mechanism not in SCRAM_HASHES:
            raise ValueError(f"mechanism must be one of {', '.join(SCRAM_HASHES)}, not {mechanism!r}")
        self.hash = SCRAM_HASHES[mechanism]
        self.password = password
        # Base64 holds no ',' : the nonce needs no escaping.
        self.nonce = nonce or base64.b64encode(secrets.token_bytes(24)).decode()
        name = username.replace("=", "=3D").replace(",", "=2C")
        self.first_bare = f"n={name},r={self.nonce}"
        self.server_signature = b""

    def first_message(self) -> bytes:
        return b"n,," + self.first_bare.encode()

    def final_message(self, server_first: bytes) -> bytes:
        attrs = _scram_attributes(server_first)
        if "m" in attrs:
            raise AuthenticationError("the server asks for a SCRAM extension this client lacks", AUTH_ERROR)
        try:
            combined, salt, iterations = attrs["r"], base64.b64decode(attrs["s"]), int(attrs["i"])
        except (KeyError, ValueError) as e:
            raise AuthenticationError(f"a malformed SCRAM server-first message: {e}", AUTH_ERROR) from e
        if not combined.startswith(self.nonce) or combined == self.nonce:
            raise AuthenticationError("the server's SCRAM nonce does not extend the client's", AUTH_ERROR)
        if not 1 <= iterations <= MAX_SCRAM_ITERATIONS:
            raise AuthenticationError(f"a SCRAM iteration count of {iterations}", AUTH_ERROR)
        salted = hashlib.pbkdf2_hmac(self.hash, self.password.encode(), salt, iterations)
        client_key = hmac.digest(salted, b"Client Key", self.hash)
        stored_key = hashlib.new(self.hash, client_key).digest()
        without_proof = f"c=biws,r={combined}"
        auth_message = f"{self.first_bare},{server_first.decode()},{without_proof}".encode()
        client_signature = hmac.digest(stored_key, auth_message, self.hash)
        proof = bytes(a ^ b for a, b in zip(client_key, client_signature, strict=True))
        server_key = hmac.digest(salted, b"Server Key", self.hash)
        self.server_signature = hmac.digest(server_key, auth_message, self.hash)
        return f"{without_proof},p={base64.b64encode(proof).decode()}".encode()

    def verify(self, server_final: bytes) -> None:
        """Raises AuthenticationError unless the server-final message carries the signature
        only a server holding the password's keys can compute."""
        attrs = _scram_attributes(server_final)
        if "e" in attrs:
            raise AuthenticationError(f"the server refused the login: {attrs['e']}", AUTH_ERROR)
        try:
            signature = base64.b64decode(attrs.get("v", ""), validate=True)
        except ValueError:
            signature = b""
        if not self.server_signature or not hmac.compare_digest(signature, self.server_signature):
            raise AuthenticationError(
                "the server's SCRAM signature does not verify: it does not hold this user's keys",
                AUTH_ERROR,
            )


def _scram_attributes(message: bytes) -> dict[str, str]:
    try:
        text = message.decode()
    except UnicodeDecodeError as e:
        raise AuthenticationError("a SCRAM message that is not UTF-8", AUTH_ERROR) from e
    return dict(part.split("=", 1) for part in text.split(",") if "=" in part)


def choose_mechanism(offered: list[str], asked: str | None) -> str:
    """The mechanism to log in with: ``asked`` when the server offers it, else the strongest
    SCRAM it offers. PLAIN (the password itself on the wire) only when asked for."""
    if asked is not None:
        if asked not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {', '.join(MECHANISMS)}, not {asked!r}")
        if asked not in offered:
            raise AuthenticationError(
                f"the server offers {', '.join(offered) or 'no mechanism'}, not {asked}", AUTH_ERROR
            )
        return asked
    for mechanism in SCRAM_HASHES:
        if mechanism in offered:
            return mechanism
    raise AuthenticationError(
        f"the server offers no SCRAM mechanism (it offers {', '.join(offered) or 'none'}): pass "
        "mechanism='PLAIN' to send the password itself",
        AUTH_ERROR,
    )


def request_flex(
    lane: bytes | str | None, priority: int | None, execute_within_ms: int | None
) -> tuple[tuple[int, bytes], ...]:
    """The flex header entries of a request's options."""
    entries = []
    if lane is not None:
        lane_id = lane.encode() if isinstance(lane, str) else bytes(lane)
        if len(lane_id) > 0xFFFF:
            raise ValueError(f"a lane id of {len(lane_id)} bytes; at most 65535")
        entries.append((LANE_ID, lane_id))
    if priority is not None:
        if not 0 <= priority <= 0xFF:
            raise ValueError(f"priority must be 0 to 255, not {priority}")
        entries.append((PRIORITY, bytes([priority])))
    if execute_within_ms is not None:
        if not 0 <= execute_within_ms <= 0xFFFFFFFF:
            raise ValueError(f"execute_within_ms must be 0 to 2**32-1, not {execute_within_ms}")
        entries.append((IGNORE_UNLESS_EXECUTED_BEFORE, struct.pack(">I", execute_within_ms)))
    return tuple(entries)


class _Pending(NamedTuple):
    future: asyncio.Future[Frame]
    opcode: int
    write: bool


class _Connection:
    """One TCP connection: the requests waiting for their replies by opaque, the DCP streams
    its stream requests opened, and the task that reads every frame the server sends."""

    def __init__(
        self,
        address: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_notice: Callable[[Notice], None] | None,
        on_quiet_failure: Callable[[QuietFailure], None],
        on_closed: Callable[[_Connection], None],
    ) -> None:
        self.address = address
        self._reader = reader
        self._writer = writer
        self._on_notice = on_notice
        self._on_quiet_failure = on_quiet_failure
        self._on_closed = on_closed
        self.pending: dict[int, _Pending] = {}
        self.quiet: collections.OrderedDict[int, tuple[int, str, str | bytes]] = collections.OrderedDict()
        self.streams: dict[int, _StreamSink] = {}
        self.going_away = False
        self.closed_because: str | None = None
        # Set by the "warmup_done" notice: the server, warming up when it was reached, runs.
        self.warm = asyncio.Event()
        self.closed = asyncio.Event()
        self._next_opaque = 1
        self._drain_lock = asyncio.Lock()
        self._reader_task = asyncio.get_running_loop().create_task(self._read_frames())

    @classmethod
    async def open(
        cls,
        address: str,
        timeout: float,
        on_notice: Callable[[Notice], None] | None,
        on_quiet_failure: Callable[[QuietFailure], None],
        on_closed: Callable[[_Connection], None],
        cafile: str | None = None,
    ) -> _Connection:
        host, _, port = address.rpartition(":")
        tls = {"ssl": client_context(cafile), "server_hostname": server_name(address)} if cafile else {}
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port), limit=1 << 20, **tls), timeout
        )
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(address, reader, writer, on_notice, on_quiet_failure, on_closed)

    @property
    def usable(self) -> bool:
        """Whether new requests may go on it: open, and the server has not said it stops."""
        return self.closed_because is None and not self.going_away

    def new_opaque(self) -> int:
        # Opaques in use are skipped (a stream's stays in use as long as it streams); there
        # are far fewer of them than the 2**32 values.
        for _ in range(len(self.pending) + len(self.streams) + 1):
            opaque = self._next_opaque
            self._next_opaque = self._next_opaque % 0xFFFFFFFF + 1
            if opaque not in self.pending and opaque not in self.streams:
                return opaque
        raise AssertionError("every opaque is in use")

    async def _send(self, frame: bytes, *, write: bool = False) -> None:
        if self.closed_because is not None:
            raise ConnectionLostError(f"{self.address}: {self.closed_because} (the request was not sent)")
        self._writer.write(frame)
        async with self._drain_lock:
            try:
                await self._writer.drain()
            except OSError as e:
                self._lost(f"writing failed: {e}")
                if write:
                    raise AmbiguousWriteError(
                        f"{self.address}: writing failed ({e}): the write may or may not have been applied"
                    ) from e
                raise ConnectionLostError(f"{self.address}: writing failed: {e}") from e

    async def request(
        self,
        opcode: int,
        payload: dict[str, Any] | None = None,
        *,
        wait: float,
        flags: int = 0,
        flex: tuple[tuple[int, bytes], ...] = (),
        write: bool = False,
        opaque: int | None = None,
        accept: tuple[int, ...] = (),
    ) -> Frame:
        """Sends a request and waits (at most ``wait`` seconds) for its reply; a failure
        status other than those in ``accept`` raises the error it stands for."""
        if opaque is None:
            opaque = self.new_opaque()
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self.pending[opaque] = _Pending(future, opcode, write)
        try:
            await self._send(encode_frame(opaque, opcode, payload, flags=flags, flex=flex), write=write)
            try:
                reply = await asyncio.wait_for(future, wait)
            except asyncio.TimeoutError:
                what = "the write may or may not have been applied" if write else "no reply"
                raise TimeoutError(
                    f"{self.address}: opcode {opcode:#06x} not answered within {wait:g} s ({what})"
                ) from None
        finally:
            self.pending.pop(opaque, None)
            # A connection lost while sending fails the future too: the error raised is the
            # sending's, and the future's is marked as seen.
            if future.done() and not future.cancelled():
                future.exception()
        if reply.status != SUCCESS and reply.status not in accept:
            raise error_for(reply.status or 0, str(reply.payload.get("message", "")), opcode)
        return reply

    async def send_quiet(
        self,
        opcode: int,
        payload: dict[str, Any],
        *,
        key: str | bytes = b"",
        flags: int = 0,
        flex: tuple[tuple[int, bytes], ...] = (),
    ) -> None:
        """Sends a quiet request: the server answers only a failure, which goes to the
        quiet-failure callback."""
        opaque = self.new_opaque()
        self.quiet[opaque] = (opcode, command_name(opcode, payload), key)
        if len(self.quiet) > MAX_QUIET_REMEMBERED:
            self.quiet.popitem(last=False)
        await self._send(encode_frame(opaque, opcode, payload, flags=flags | QUIET, flex=flex))

    async def _read_frames(self) -> None:
        why = "the server closed the connection"
        try:
            while True:
                (n,) = struct.unpack(">I", await self._reader.readexactly(4))
                if not 7 <= n <= MAX_FRAME:
                    raise ProtocolViolation(f"a frame length of {n}")
                self._take(decode_frame(await self._reader.readexactly(n)))
        except asyncio.IncompleteReadError:
            pass
        except asyncio.CancelledError:
            why = "the client closed the connection"
        except ProtocolViolation as e:
            why = f"the server sent a bad frame ({e})"
        except OSError as e:
            why = f"reading failed: {e}"
        self._lost(why)

    def _take(self, frame: Frame) -> None:
        if frame.status is not None:
            pending = self.pending.pop(frame.opaque, None)
            if pending is not None:
                if not pending.future.done():
                    pending.future.set_result(frame)
                return
            quiet = self.quiet.pop(frame.opaque, None)
            if quiet is not None and frame.status != SUCCESS:
                opcode, command, key = quiet
                error = error_for(frame.status, str(frame.payload.get("message", "")), opcode)
                self._on_quiet_failure(QuietFailure(command, key, error))
            # Otherwise: a reply to a request given up on (its wait ran out); nobody awaits it.
            return
        # A request of the server's own.
        if frame.opcode == NOTICE:
            notice = Notice(str(frame.payload.get("kind", "")), frame.payload)
            if notice.kind == "shutdown":
                self.going_away = True
            elif notice.kind == "warmup_done":
                self.warm.set()
            if self._on_notice is not None:
                self._on_notice(notice)
            return
        if frame.opcode in STREAM_MESSAGES:
            sink = self.streams.get(frame.opaque)
            if sink is not None:
                if not frame.flags & MORE:
                    del self.streams[frame.opaque]
                sink.message(frame)
            # A message of a stream this client no longer follows (it closed it): the server
            # wants no answer to stream messages.
            return
        self._writer.write(
            encode_frame(
                frame.opaque,
                frame.opcode,
                {"message": f"opcode {frame.opcode:#06x} is not one this client knows"},
                status=UNKNOWN_COMMAND,
                flex=tuple((k, v) for k, v in frame.flex.items() if k == LANE_ID),
            )
        )

    def _lost(self, why: str) -> None:
        if self.closed_because is not None:
            return
        self.closed_because = why
        self.closed.set()
        self._writer.close()
        for pending in self.pending.values():
            if pending.future.done():
                continue
            if pending.write:
                error: ConnectionLostError = AmbiguousWriteError(
                    f"{self.address}: {why} while a write was in flight: it may or may not have been applied"
                )
            else:
                error = ConnectionLostError(f"{self.address}: {why} before the reply")
            pending.future.set_exception(error)
        self.pending.clear()
        for sink in self.streams.values():
            sink.lost(ConnectionLostError(f"{self.address}: {why}"))
        self.streams.clear()
        self._on_closed(self)

    async def until_warm(self, timeout: float) -> None:
        """Waits for the "warmup_done" notice (TimeoutError past ``timeout`` seconds), or
        raises ConnectionLostError when the connection closes first."""
        waits = [asyncio.ensure_future(self.warm.wait()), asyncio.ensure_future(self.closed.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if self.warm.is_set():
            return
        if self.closed_because is not None:
            raise ConnectionLostError(f"{self.address}: {self.closed_because} waiting for warm-up to end")
        raise TimeoutError(f"{self.address}: still warming up after {timeout:g} s")

    async def close(self) -> None:
        self._lost("the client closed the connection")
        self._reader_task.cancel()
        try:
            await self._reader_task
        except asyncio.CancelledError:
            pass
        try:
            await self._writer.wait_closed()
        except OSError:
            pass


_MUTATION_NAMES = ("add", "set", "replace", "append", "prepend", "patch")
_COMMAND_NAMES = {DELETE: "delete", TOUCH: "touch", DCP_BUFFER_ACK: "buffer ack"}


def command_name(opcode: int, payload: dict[str, Any]) -> str:
    """What a request is called in messages: a mutation by its type."""
    if opcode == MUTATION:
        return _MUTATION_NAMES[payload["type"]]
    return _COMMAND_NAMES.get(opcode, f"opcode {opcode:#06x}")


def _value_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _key(key: str | bytes) -> str | bytes:
    if not isinstance(key, (str, bytes)):
        raise TypeError(f"a key is str or bytes, not {type(key).__name__}")
    return key


class RequestOptions(TypedDict, total=False):
    """How a request runs (docs/greenstack.md, "Execution"), given to any request method."""

    #: The lane (str or bytes): requests of other lanes never wait for this one's.
    lane: bytes | str | None
    #: Start once every earlier request of the lane completed; hold back the later ones.
    fence: bool
    #: 0-255, lower first among requests waiting to start (128 when absent).
    priority: int | None
    #: Not run, NotExecutedInTimeError instead, when it could not start within this many ms.
    execute_within_ms: int | None


class WriteOptions(RequestOptions, total=False):
    """A write's options besides RequestOptions'."""

    #: None (the bucket's), "none", "persist", "majority", "majority_and_persist_active" or
    #: "persist_to_majority": the reply comes once the level is met (DurabilityImpossibleError
    #: when too few replicas follow the vbucket, SyncWriteAmbiguousError when not met in time).
    durability: str | None
    #: Return None once the request is written; a failure comes back later, into
    #: ``quiet_failures`` (a fenced request on the same lane answers after it).
    quiet: bool


def options_flex(options: RequestOptions) -> tuple[tuple[int, bytes], ...]:
    """The flex header entries a request's options ask for."""
    return request_flex(options.get("lane"), options.get("priority"), options.get("execute_within_ms"))


class AsyncClient:
    """A Greenstack connection to one bucket of a sluice server. Open it with
    :meth:`connect`; close it with :meth:`close` or ``async with``."""

    def __init__(
        self,
        address: str,
        *,
        bucket: str | None,
        username: str | None,
        password: str | None,
        mechanism: str | None,
        timeout: float,
        reconnect: bool,
        on_notice: Callable[[Notice], Any] | None,
        notice_queue_size: int,
        cafile: str | None = None,
    ) -> None:
        if mechanism is not None and mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {', '.join(MECHANISMS)}, not {mechanism!r}")
        self.address = address
        self.bucket = bucket
        self.username = username
        self.password = password
        self.mechanism = mechanism
        self.timeout = timeout
        self.reconnect = reconnect
        self.on_notice = on_notice
        self.cafile = cafile
        #: The mechanism of the latest login (None: none made).
        self.logged_in_with: str | None = None
        #: What the server's HELLO said of itself.
        self.server: dict[str, Any] = {}
        #: Connections opened after the first one.
        self.reconnects = 0
        #: Notices dropped from the queue because nobody took them in time.
        self.notices_dropped = 0
        #: The latest quiet writes the server refused.
        self.quiet_failures: collections.deque[QuietFailure] = collections.deque(maxlen=1000)
        self._notices: collections.deque[Notice] = collections.deque()
        self._notice_queue_size = notice_queue_size
        self._notice_arrived = asyncio.Event()
        self._callbacks: set[asyncio.Task[Any]] = set()
        self._conn: _Connection | None = None
        self._retiring: set[_Connection] = set()
        self._reconnecting = asyncio.Lock()
        self._closed = False

    @classmethod
    async def connect(
        cls,
        address: str = "127.0.0.1:11220",
        *,
        bucket: str | None = "default",
        username: str | None = None,
        password: str | None = None,
        mechanism: str | None = None,
        timeout: float = 10.0,
        reconnect: bool = True,
        on_notice: Callable[[Notice], Any] | None = None,
        notice_queue_size: int = 1000,
        cafile: str | None = None,
    ) -> AsyncClient:
        """Connects: HELLO, a login when ``username`` is given, and SELECT BUCKET (none when
        ``bucket`` is None).

        mechanism: "SCRAM-SHA512", "SCRAM-SHA256", "SCRAM-SHA1" or "PLAIN"; by default the
            strongest SCRAM the server offers (PLAIN, which sends the password itself, only
            when asked for).
        timeout: seconds for connecting, logging in and each reply (a write with durability
            other than "none" may wait 60 s more, for the server's own durability timeout).
        reconnect: when the connection drops, the next request opens a new one (the requests
            in flight fail either way: :class:`ConnectionLostError`).
        on_notice: called (on the event loop) with each :class:`Notice`; a coroutine function
            is run as a task of its own.
        notice_queue_size: notices :meth:`notices` holds for a consumer that lags; past it the
            oldest are dropped (and counted in ``notices_dropped``).
        cafile: connect inside TLS (to ``greenstack_tls_listen``): the server's certificate must
            chain to the CAs in this PEM file and name the host connected to.
        """
        client = cls(
            address,
            bucket=bucket,
            username=username,
            password=password,
            mechanism=mechanism,
            timeout=timeout,
            reconnect=reconnect,
            on_notice=on_notice,
            notice_queue_size=notice_queue_size,
            cafile=cafile,
        )
        client._conn = await client._open_connection(main=True)
        return client

    # Connections.

    async def _open_connection(self, *, main: bool) -> _Connection:
        """A new connection, said HELLO to, logged in, on the client's bucket. Only the main
        one hands its notices and quiet failures to the client."""
        conn = await _Connection.open(
            self.address,
            self.timeout,
            self._notice if main else None,
            self._quiet_failure,
            self._connection_closed,
            self.cafile,
        )
        try:
            hello = await conn.request(
                HELLO, {"user_agent": "sluice-python", "user_agent_version": __version__}, wait=self.timeout
            )
            if main:
                self.server = hello.payload
            try:
                await self._login_and_select(conn, hello)
            except GreenstackError as e:
                # Reached while warming up, the server answers "not initialized" until it
                # runs, and then tells the connection so.
                if e.status != NOT_INITIALIZED:
                    raise
                await conn.until_warm(self.timeout)
                await self._login_and_select(conn, hello)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _login_and_select(self, conn: _Connection, hello: Frame) -> None:
        if self.username is not None:
            await self._login(conn, list(hello.payload.get("sasl_mechanisms", [])))
        if self.bucket is not None:
            await conn.request(SELECT_BUCKET, {"name": self.bucket}, wait=self.timeout)

    async def _login(self, conn: _Connection, offered: list[str]) -> None:
        mechanism = choose_mechanism(offered, self.mechanism)
        user, password = self.username or "", self.password or ""
        if mechanism == "PLAIN":
            challenge = b"\0" + user.encode() + b"\0" + password.encode()
            await conn.request(SASL_AUTH, {"mechanism": "PLAIN", "challenge": challenge}, wait=self.timeout)
        else:
            scram = ScramClient(mechanism, user, password)
            first = await conn.request(
                SASL_AUTH,
                {"mechanism": mechanism, "challenge": scram.first_message()},
                wait=self.timeout,
                accept=(AUTH_CONTINUE,),
            )
            # A node without users takes any login at the first step: there is no signature
            # to check, as there are no keys.
            if first.status == AUTH_CONTINUE:
                final = scram.final_message(bytes(first.payload.get("challenge", b"")))
                last = await conn.request(
                    SASL_AUTH, {"mechanism": mechanism, "challenge": final}, wait=self.timeout
                )
                scram.verify(bytes(last.payload.get("challenge", b"")))
        self.logged_in_with = mechanism

    def _connection_closed(self, conn: _Connection) -> None:
        self._retiring.discard(conn)

    async def _connection(self) -> _Connection:
        """The connection for a new request: the current one, or (``reconnect``) a new one,
        tried a few times over about 3 s."""
        if self._closed:
            raise ClosedError("the Greenstack client is closed")
        if self._conn is not None and self._conn.usable:
            return self._conn
        if not self.reconnect:
            why = self._conn.closed_because if self._conn is not None else None
            raise ConnectionLostError(
                f"{self.address}: {why or 'the server is stopping'} (and reconnect is off)"
            )
        async with self._reconnecting:
            if self._conn is not None and self._conn.usable:
                return self._conn
            if self._conn is not None and self._conn.closed_because is None:
                # Going away: its requests under way still get their replies.
                self._retiring.add(self._conn)
            failure: BaseException | None = None
            for delay in RECONNECT_DELAYS:
                await asyncio.sleep(delay)
                if self._closed:
                    raise ClosedError("the Greenstack client is closed")
                try:
                    self._conn = await self._open_connection(main=True)
                except (OSError, asyncio.TimeoutError) as e:
                    failure = e
                    continue
                self.reconnects += 1
                return self._conn
            raise ConnectionLostError(
                f"{self.address}: could not reconnect in {len(RECONNECT_DELAYS)} attempts: {failure}"
            ) from failure

    # Notices and quiet failures.

    def _notice(self, notice: Notice) -> None:
        if len(self._notices) >= self._notice_queue_size:
            self._notices.popleft()
            self.notices_dropped += 1
        self._notices.append(notice)
        self._notice_arrived.set()
        if self.on_notice is None:
            return
        try:
            outcome = self.on_notice(notice)
        except Exception:
            log.exception("on_notice failed on %s", notice)
            return
        if inspect.isawaitable(outcome):
            task = asyncio.ensure_future(outcome)
            self._callbacks.add(task)
            task.add_done_callback(self._callback_done)

    def _callback_done(self, task: asyncio.Task[Any]) -> None:
        self._callbacks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("on_notice failed", exc_info=task.exception())

    def _quiet_failure(self, failure: QuietFailure) -> None:
        log.warning("a quiet %s of %r failed: %s", failure.command, failure.key, failure.error)
        self.quiet_failures.append(failure)

    async def notices(self) -> AsyncIterator[Notice]:
        """The server's notices as they come (those that came since the client connected and
        nobody took first); ends when the client closes. Several consumers share them."""
        while True:
            while self._notices:
                yield self._notices.popleft()
            if self._closed:
                return
            self._notice_arrived.clear()
            await self._notice_arrived.wait()

    # Requests.

    async def _request(
        self,
        opcode: int,
        payload: dict[str, Any] | None = None,
        *,
        write: bool = False,
        wait: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> Frame:
        conn = await self._connection()
        return await conn.request(
            opcode,
            payload,
            wait=self.timeout if wait is None else wait,
            flags=FENCE if options.get("fence") else 0,
            flex=options_flex(options),
            write=write,
        )

    async def _write(
        self,
        opcode: int,
        payload: dict[str, Any],
        *,
        quiet: bool = False,
        durability: str | None = None,
        **options: Unpack[RequestOptions],
    ) -> Stored | None:
        if durability is not None:
            if durability not in DURABILITY_LEVELS:
                levels = ", ".join(DURABILITY_LEVELS)
                raise ValueError(f"durability must be one of {levels}, not {durability!r}")
            payload["durability"] = durability
        if quiet:
            conn = await self._connection()
            flags = FENCE if options.get("fence") else 0
            await conn.send_quiet(opcode, payload, key=payload["id"], flags=flags, flex=options_flex(options))
            return None
        # A write at the bucket's default durability may be a durable one.
        wait = self.timeout + (DURABLE_WRITE_WAIT if durability != "none" else 0.0)
        reply = await self._request(opcode, payload, write=True, wait=wait, **options)
        p = reply.payload
        return Stored(int(p.get("cas", 0)), int(p.get("seqno", 0)), int(p.get("vbucket_uuid", 0)))

    async def get(self, key: str | bytes, **options: Unpack[RequestOptions]) -> Item | None:
        """The document's value, flags, CAS and datatype; None when there is none."""
        try:
            reply = await self._request(GET, {"id": _key(key)}, **options)
        except NotFoundError:
            return None
        p = reply.payload
        return Item(bytes(p.get("value", b"")), p.get("flags", 0), p.get("cas", 0), p.get("datatype", 0))

    async def _mutation(
        self,
        kind: int,
        key: str | bytes,
        value: bytes | bytearray | memoryview | str,
        fields: dict[str, int],
        options: WriteOptions,
    ) -> Stored | None:
        payload: dict[str, Any] = {"type": kind, "id": _key(key), "value": _value_bytes(value)}
        payload.update((name, given) for name, given in fields.items() if given)
        return await self._write(MUTATION, payload, **options)

    async def set(
        self,
        key: str | bytes,
        value: bytes | bytearray | memoryview | str,
        *,
        flags: int = 0,
        expiration: int = 0,
        cas: int = 0,
        datatype: int = 0,
        **options: Unpack[WriteOptions],
    ) -> Stored | None:
        """Stores the document (only over CAS ``cas`` when it is not 0: else ExistsError).

        expiration: memcached's: seconds up to 30 days, else a Unix time; 0 never.
        datatype: 1 for a JSON value.
        options: as :class:`WriteOptions` (lane, fence, priority, execute_within_ms,
            durability, quiet).
        Returns the new CAS, the seqno and the vbucket's uuid (None when quiet).
        """
        fields = {"flags": flags, "expiration": expiration, "cas": cas, "datatype": datatype}
        return await self._mutation(SET, key, value, fields, options)

    async def add(
        self,
        key: str | bytes,
        value: bytes | bytearray | memoryview | str,
        *,
        flags: int = 0,
        expiration: int = 0,
        datatype: int = 0,
        **options: Unpack[WriteOptions],
    ) -> Stored | None:
        """Stores the document only when the key holds none (else ExistsError); as :meth:`set`."""
        fields = {"flags": flags, "expiration": expiration, "datatype": datatype}
        return await self._mutation(ADD, key, value, fields, options)

    async def replace(
        self,
        key: str | bytes,
        value: bytes | bytearray | memoryview | str,
        *,
        flags: int = 0,
        expiration: int = 0,
        cas: int = 0,
        datatype: int = 0,
        **options: Unpack[WriteOptions],
    ) -> Stored | None:
        """Stores the document only when the key holds one (else NotFoundError); as :meth:`set`."""
        fields = {"flags": flags, "expiration": expiration, "cas": cas, "datatype": datatype}
        return await self._mutation(REPLACE, key, value, fields, options)

    async def append(
        self,
        key: str | bytes,
        value: bytes | bytearray | memoryview | str,
        *,
        cas: int = 0,
        **options: Unpack[WriteOptions],
    ) -> Stored | None:
        """Adds ``value`` at the end of the stored one (NotStoredError when there is none)."""
        return await self._mutation(APPEND, key, value, {"cas": cas}, options)

    async def prepend(
        self,
        key: str | bytes,
        value: bytes | bytearray | memoryview | str,
        *,
        cas: int = 0,
        **options: Unpack[WriteOptions],
    ) -> Stored | None:
        """Adds ``value`` at the start of the stored one (NotStoredError when there is none)."""
        return await self._mutation(PREPEND, key, value, {"cas": cas}, options)

    async def patch(
        self,
        key: str | bytes,
        patch: bytes | str | dict[str, Any],
        *,
        cas: int = 0,
        **options: Unpack[WriteOptions],
    ) -> Stored | None:
        """Applies a JSON merge patch (RFC 7386: an object merges key by key, None removes a
        key, anything else replaces) to the stored JSON document, keeping its flags and
        expiration. NotFoundError when there is none; GreenstackError (invalid arguments)
        when the document or the patch is not JSON."""
        body = json.dumps(patch, separators=(",", ":")) if isinstance(patch, dict) else patch
        return await self._mutation(PATCH, key, body, {"cas": cas}, options)

    async def delete(
        self, key: str | bytes, *, cas: int = 0, **options: Unpack[WriteOptions]
    ) -> Stored | None:
        """Deletes the document (NotFoundError when there is none; ExistsError when ``cas`` is
        not 0 and not the document's)."""
        return await self._write(DELETE, {"id": _key(key), "cas": cas}, **options)

    async def touch(
        self, key: str | bytes, expiration: int, **options: Unpack[WriteOptions]
    ) -> Stored | None:
        """Sets the document's expiration (NotFoundError when there is none)."""
        return await self._write(TOUCH, {"id": _key(key), "expiration": expiration}, **options)

    async def all_vb_seqnos(self, state: str = "active", **options: Unpack[RequestOptions]) -> dict[int, int]:
        """The high seqno of each vbucket in ``state`` ("active", "replica", "pending",
        "dead")."""
        reply = await self._request(GET_ALL_VB_SEQNOS, {"state": state}, **options)
        return {int(vb): int(seqno) for vb, seqno in reply.payload.get("vbuckets", [])}

    async def list_buckets(self) -> list[str]:
        """The buckets the user may use."""
        reply = await self._request(LIST_BUCKETS)
        return [str(name) for name in reply.payload.get("buckets", [])]

    async def select_bucket(self, name: str) -> None:
        """Uses bucket ``name`` from now on (reconnects select it too); NoSuchBucketError for
        one that does not exist or the user may not use."""
        await self._request(SELECT_BUCKET, {"name": name})
        self.bucket = name

    def stream(
        self,
        vbuckets: list[int] | None = None,
        *,
        start: str = "beginning",
        end: str | None = None,
        state: dict[Any, dict[str, int]] | None = None,
        buffer_size: int = 16 << 20,
        name: str | None = None,
    ) -> GreenstackStream:
        """The changes of ``vbuckets`` (default: those of ``state``, else every active one) over
        DCP on a connection of the stream's own: ``async for change in client.stream(...)``.

        start: "beginning" or "now", for the vbuckets ``state`` does not cover.
        end: None to follow forever, or "now" to end at the high seqnos of the moment (the
            iteration finishes when every vbucket's stream has ended).
        state: a :meth:`GreenstackStream.state` to go on from, with no gap and no duplicate.
        buffer_size: bytes of stream messages the server sends ahead of what this client has
            taken (acknowledged as they are taken); 0: no flow control.
        name: the DCP cursor's name (default: one of its own).
        """
        return GreenstackStream(self, vbuckets, start, end, state, buffer_size, name)

    async def close(self) -> None:
        """Closes the connection (requests in flight fail with ConnectionLostError) and ends
        :meth:`notices`."""
        self._closed = True
        self._notice_arrived.set()
        for conn in [c for c in (self._conn, *self._retiring) if c is not None]:
            await conn.close()
        for task in list(self._callbacks):
            task.cancel()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _StreamSink:
    """Where a connection puts one vbucket's stream messages: the stream's queue."""

    def __init__(self, queue: asyncio.Queue[Any], vbucket: int) -> None:
        self.queue = queue
        self.vbucket = vbucket

    def message(self, frame: Frame) -> None:
        self.queue.put_nowait((self.vbucket, frame))

    def lost(self, error: BaseException) -> None:
        self.queue.put_nowait(error)


class _Position:
    """Where a vbucket's stream stands: its history branch (uuid), the last seqno taken, and the
    snapshot that seqno is in."""

    def __init__(self, vbucket_uuid: int = 0, seqno: int = 0, snap_start: int = 0, snap_end: int = 0) -> None:
        self.vbucket_uuid = vbucket_uuid
        self.seqno = seqno
        self.snap_start = snap_start
        self.snap_end = snap_end

    def as_dict(self) -> dict[str, int]:
        return {
            "vbucket_uuid": self.vbucket_uuid,
            "seqno": self.seqno,
            "snap_start": self.snap_start,
            "snap_end": self.snap_end,
        }


# STREAM END reasons (DCP's) after which the vbucket is asked for again, from where it stands.
STREAM_END_TOO_SLOW, STREAM_END_ROLLBACK = 4, 6


class GreenstackStream:
    """DCP over Greenstack: an async iterator of :class:`sluice.Change` on a connection of its
    own. ``state()`` is where each vbucket stands after the last change returned: pass it as
    ``state=`` to go on later. The connection closes when every vbucket's stream has ended (or
    it fails); close it (or ``async with``) to stop one that follows."""

    def __init__(
        self,
        client: AsyncClient,
        vbuckets: list[int] | None,
        start: str,
        end: str | None,
        state: dict[Any, dict[str, int]] | None,
        buffer_size: int,
        name: str | None,
    ) -> None:
        if start not in ("beginning", "now"):
            raise ValueError(f"start must be 'beginning' or 'now', not {start!r}")
        if end not in (None, "now"):
            raise ValueError(f"end must be None or 'now', not {end!r}")
        if buffer_size < 0:
            raise ValueError(f"buffer_size must be 0 or more, not {buffer_size}")
        self._client = client
        self._vbuckets = list(vbuckets) if vbuckets is not None else None
        self._start = start
        self._end = end
        self._given = {int(vb): dict(pos) for vb, pos in (state or {}).items()}
        self._buffer_size = buffer_size
        self.name = name or f"sluice-python:{secrets.token_hex(6)}"
        self._positions: dict[int, _Position] = {}
        #: vbucket -> the reason (DCP's) its stream ended with.
        self.ended: dict[int, int] = {}
        #: (vbucket, seqno) of each rollback the server asked for: changes past that seqno that
        #: were returned before it are no longer in the vbucket's history.
        self.rollbacks: list[tuple[int, int]] = []
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._conn: _Connection | None = None
        self._opening: asyncio.Task[None] | None = None
        self._unacked = 0
        self._failure: BaseException | None = None
        self._closed = False

    async def _open(self) -> None:
        conn = await self._client._open_connection(main=False)
        self._conn = conn
        wait = self._client.timeout
        if self._vbuckets is None:
            if self._given:
                self._vbuckets = sorted(self._given)
            else:
                reply = await conn.request(GET_ALL_VB_SEQNOS, {"state": "active"}, wait=wait)
                self._vbuckets = sorted(int(vb) for vb, _ in reply.payload.get("vbuckets", []))
        from_now = [vb for vb in self._vbuckets if vb not in self._given]
        highs: dict[int, int] = {}
        if self._start == "now" and from_now:
            reply = await conn.request(GET_ALL_VB_SEQNOS, {"state": "active"}, wait=wait)
            highs = {int(vb): int(seqno) for vb, seqno in reply.payload.get("vbuckets", [])}
        for vb in self._vbuckets:
            given = self._given.get(vb)
            if given is not None:
                self._positions[vb] = _Position(
                    int(given.get("vbucket_uuid", 0)),
                    int(given.get("seqno", 0)),
                    int(given.get("snap_start", given.get("seqno", 0))),
                    int(given.get("snap_end", given.get("seqno", 0))),
                )
            else:
                # From now: the position is the high seqno read just before the stream opens
                # (at worst a few changes below where the server starts it; never past).
                high = highs.get(vb, 0)
                self._positions[vb] = _Position(0, high, high, high)
        await conn.request(DCP_OPEN, {"name": self.name, "buffer_size": self._buffer_size}, wait=wait)
        await asyncio.gather(*(self._request_stream(vb, from_latest=vb in highs) for vb in self._vbuckets))

    async def _request_stream(self, vb: int, *, from_latest: bool = False) -> None:
        """Opens the vbucket's stream from its position; a rollback moves the position back
        and asks again."""
        conn = self._conn
        assert conn is not None
        pos = self._positions[vb]
        for _ in range(MAX_ROLLBACKS):
            if from_latest:
                # The server starts at its high seqno; nothing of the vbucket is known yet.
                payload: dict[str, Any] = {"vbucket": vb, "from_latest": True}
            else:
                payload = {
                    "vbucket": vb,
                    "start_seqno": pos.seqno,
                    "vbucket_uuid": pos.vbucket_uuid,
                    "snap_start_seqno": pos.snap_start,
                    "snap_end_seqno": pos.snap_end,
                }
            if self._end == "now":
                payload["to_latest"] = True
            opaque = conn.new_opaque()
            conn.streams[opaque] = _StreamSink(self._queue, vb)
            try:
                reply = await conn.request(
                    DCP_STREAM_REQUEST, payload, wait=self._client.timeout, opaque=opaque, accept=(ROLLBACK,)
                )
            except BaseException:
                conn.streams.pop(opaque, None)
                raise
            if reply.status == ROLLBACK:
                conn.streams.pop(opaque, None)
                to = int(reply.payload.get("rollback_seqno", 0))
                self.rollbacks.append((vb, to))
                pos.seqno = pos.snap_start = pos.snap_end = to
                if to == 0:
                    # From the start no history is needed; the uuid asked with may be one the
                    # server never had (which is what made it roll back to 0).
                    pos.vbucket_uuid = 0
                from_latest = False
                continue
            failover_log = reply.payload.get("failover_log") or []
            if failover_log:
                pos.vbucket_uuid = int(failover_log[0][0])
            self.ended.pop(vb, None)
            return
        raise GreenstackError(
            f"vbucket {vb}: the server asked for {MAX_ROLLBACKS} rollbacks in a row", ROLLBACK
        )

    async def open(self) -> None:
        """Opens the streams (``async with`` and the first change do it): what is written
        once it returns is streamed, with ``start="now"`` too."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        try:
            await asyncio.shield(self._opening)
        except Exception as e:
            await self._fail(e)
            raise

    def __aiter__(self) -> GreenstackStream:
        return self

    async def __anext__(self) -> Change:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise StopAsyncIteration
        await self.open()
        while True:
            if len(self.ended) == len(self._positions) and self._queue.empty():
                # Every stream has ended: the connection has nothing more to carry.
                await self.close()
                raise StopAsyncIteration
            item = await self._queue.get()
            if isinstance(item, BaseException):
                if self._closed:
                    raise StopAsyncIteration
                await self._fail(item)
                raise item
            vb, frame = item
            try:
                change = await self._take(vb, frame)
            except Exception as e:
                await self._fail(e)
                raise
            if change is not None:
                return change

    async def _fail(self, error: BaseException) -> None:
        """The stream cannot go on: every later call raises ``error``; the connection closes."""
        self._failure = error
        await self.close()

    async def _take(self, vb: int, frame: Frame) -> Change | None:
        """Applies one stream message to the vbucket's position: the change it carries, if any."""
        await self._acknowledge(frame.size)
        pos = self._positions[vb]
        p = frame.payload
        if frame.opcode == DCP_SNAPSHOT_MARKER:
            pos.snap_start, pos.snap_end = int(p.get("start", 0)), int(p.get("end", 0))
            return None
        if frame.opcode == DCP_STREAM_END:
            reason = int(p.get("reason", 0))
            if reason in (STREAM_END_TOO_SLOW, STREAM_END_ROLLBACK) and not self._closed:
                await self._request_stream(vb)
            else:
                self.ended[vb] = reason
            return None
        pos.seqno = int(p.get("seqno", 0))
        key = bytes(p.get("key", b""))
        if frame.opcode == DCP_MUTATION:
            return Change(
                vb,
                pos.seqno,
                "mutation",
                key,
                bytes(p.get("value", b"")),
                int(p.get("cas", 0)),
                int(p.get("rev_seqno", 0)),
                int(p.get("flags", 0)),
                int(p.get("expiration", 0)),
                int(p.get("datatype", 0)),
            )
        op = "deletion" if frame.opcode == DCP_DELETION else "expiration"
        return Change(
            vb,
            pos.seqno,
            op,
            key,
            b"",
            int(p.get("cas", 0)),
            int(p.get("rev_seqno", 0)),
            0,
            int(p.get("delete_time", 0)),
            int(p.get("datatype", 0)),
        )

    async def _acknowledge(self, size: int) -> None:
        """Counts a message taken; past half the buffer, tells the server (BUFFER ACK, quiet)."""
        if not self._buffer_size or self._conn is None:
            return
        self._unacked += size
        if self._unacked >= max(1, self._buffer_size // 2):
            taken, self._unacked = self._unacked, 0
            await self._conn.send_quiet(DCP_BUFFER_ACK, {"bytes": taken})

    def state(self) -> dict[int, dict[str, int]]:
        """Per vbucket, where it stands after the last change returned: ``vbucket_uuid``,
        ``seqno``, ``snap_start``, ``snap_end`` (JSON-ready once its keys are made str;
        :meth:`AsyncClient.stream` takes either)."""
        return {vb: pos.as_dict() for vb, pos in sorted(self._positions.items())}

    @property
    def finished(self) -> bool:
        return bool(self._positions) and len(self.ended) == len(self._positions) and self._queue.empty()

    async def close(self) -> None:
        """Closes the stream's connection; iterating afterwards ends at once."""
        self._closed = True
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        if self._conn is not None:
            await self._conn.close()

    async def __aenter__(self) -> GreenstackStream:
        try:
            await self.open()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _blocking(name: str) -> Callable[..., Any]:
    """GreenstackClient's method ``name``: AsyncClient's, run on the client's event loop."""
    method = getattr(AsyncClient, name)

    @functools.wraps(method)
    def call(self: GreenstackClient, *args: Any, **kwargs: Any) -> Any:
        return self._run(getattr(self._client, name)(*args, **kwargs))

    return call


class GreenstackClient:
    """:class:`AsyncClient`'s methods, blocking: an event loop runs on a daemon thread of the
    client's own, and every call waits for its coroutine there. Connects at once (arguments as
    :meth:`AsyncClient.connect`); close it with :meth:`close` or ``with``. ``on_notice`` runs on
    that thread."""

    def __init__(self, address: str = "127.0.0.1:11220", **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"greenstack {address}", daemon=True
        )
        self._thread.start()
        try:
            self._client = self._run(AsyncClient.connect(address, **options))
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _stop_loop(self) -> None:
        # Async generators begun on the loop (notices()) are finished there, not left to the
        # garbage collector of another thread.
        self._run(self._loop.shutdown_asyncgens())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    @property
    def client(self) -> AsyncClient:
        """The AsyncClient underneath (its attributes: ``reconnects``, ``quiet_failures``...)."""
        return self._client

    get = _blocking("get")
    set = _blocking("set")
    add = _blocking("add")
    replace = _blocking("replace")
    append = _blocking("append")
    prepend = _blocking("prepend")
    patch = _blocking("patch")
    delete = _blocking("delete")
    touch = _blocking("touch")
    all_vb_seqnos = _blocking("all_vb_seqnos")
    list_buckets = _blocking("list_buckets")
    select_bucket = _blocking("select_bucket")

    def notices(self) -> Iterator[Notice]:
        """The server's notices as they come, blocking; ends when the client closes."""
        notices = self._client.notices()

        async def next_notice() -> Notice:
            return await notices.__anext__()

        while True:
            try:
                yield self._run(next_notice())
            except StopAsyncIteration:
                return

    def stream(self, vbuckets: list[int] | None = None, **options: Any) -> BlockingStream:
        """:meth:`AsyncClient.stream`, as a blocking iterator."""
        return BlockingStream(self, self._client.stream(vbuckets, **options))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.close())
        finally:
            self._stop_loop()

    def __enter__(self) -> GreenstackClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockingStream:
    """A :class:`GreenstackStream` as a blocking iterator of :class:`sluice.Change`."""

    def __init__(self, client: GreenstackClient, stream: GreenstackStream) -> None:
        self._client = client
        self._stream = stream

    def __iter__(self) -> BlockingStream:
        return self

    def __next__(self) -> Change:
        try:
            return self._client._run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def state(self) -> dict[int, dict[str, int]]:
        return self._stream.state()

    @property
    def ended(self) -> dict[int, int]:
        return self._stream.ended

    @property
    def rollbacks(self) -> list[tuple[int, int]]:
        return self._stream.rollbacks

    def close(self) -> None:
        self._client._run(self._stream.close())

    def __enter__(self) -> BlockingStream:
        try:
            self._client._run(self._stream.open())
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
