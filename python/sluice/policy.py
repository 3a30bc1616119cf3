"""Policy plugins: Python classes that take some of the daemon's decisions.

Subclass one of the base classes below and name it in the configuration by import path::

    [policy]
    ack = "mycompany.sluice_policies:AdaptiveAck"
    filter = "mycompany.sluice_policies:NoSessionKeys"
    timeout = "50ms"

How they are called:

* Per round trip or per batch, never per item: an AckPolicy once per ACK a TAP client sends
  (or per buffer acknowledgement a replica's DCP connection sends), a StreamFilter once per
  batch of up to 1 MiB (TAP) or 256 KiB (DCP) of changes, a SlowConsumerPolicy once per
  checkpoint-memory check that finds the quota exceeded.
* On a Python thread of their own (one per plugin), never on the daemon's I/O threads. The
  I/O side waits at most ``policy.timeout`` for an answer, then uses the native default.
* An exception is logged and counted (``sluice_policy_errors_total``), never fatal: that call
  gets the native default and the plugin is asked again next time.
* Returning ``None`` means "the native default" in every method.
* SIGHUP reloads the configuration: plugin modules are re-imported and new instances replace
  the old; a plugin removed from the configuration hands its decisions back to the native
  default.

Without a plugin, nothing here runs: the defaults are native.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("sluice.policy")

# StreamFilter actions.
KEEP, DROP, STRIP_VALUE = 0, 1, 2


class PluginError(Exception):
    """A plugin cannot be loaded: bad import path, missing module, wrong base class."""


@dataclasses.dataclass(frozen=True)
class AckStats:
    """What a connection measured up to its latest acknowledgement.

    On ``protocol == "tap"`` (a TAP producer, after an ACK) counts are messages and ``rtt`` is
    the seconds between sending the acknowledged message and its ACK. On ``"dcp"`` (a
    replica's DCP consumer, after it sent a buffer acknowledgement) counts are bytes:
    ``interval`` is the bytes received between acknowledgements, ``window`` the connection
    buffer the producer may fill, and ``rtt`` the seconds the acknowledged bytes took to come.
    """

    connection: str
    rtt: float
    #: Still unacknowledged.
    unacked: int
    acked_total: int
    #: Sent (TAP) or received (DCP) in all.
    sent_total: int
    #: The interval and window in force.
    interval: int
    window: int
    protocol: str = "tap"


class AckPolicy:
    """Flow control, per connection.

    TAP (``stats.protocol == "tap"``): how often a connection with SUPPORT_ACK asks for an
    ACK (``interval``: every N messages) and how many messages may be unacknowledged before
    sending pauses (``window``). Called once per ACK received. The native default keeps the
    configured ``tap.ack_interval`` and ``tap.ack_window``.

    DCP (``"dcp"``): a replica's connection to its active node. ``interval`` is how many
    received bytes are acknowledged at once, ``window`` the connection buffer size in bytes
    (at least 64 KiB; a change is sent to the producer as ``connection_buffer_size``). Called
    once per buffer acknowledgement. The native default is a 32 MiB buffer acknowledged a
    fifth at a time.

    Return ``(interval, window)`` to change them for that connection, or ``None`` to keep them.
    """

    def on_ack(self, stats: AckStats) -> tuple[int, int] | None:
        return None


class RetransmitPolicy:
    """What happens to unacknowledged TAP messages.

    ``on_disconnect``: a named session with SUPPORT_ACK lost its connection with ``unacked``
    messages outstanding. Return ``(grace_seconds, resend)``: how long the session waits for
    its client to reconnect under the same name, and whether the reconnect gets the
    unacknowledged messages again. Native default: ``(tap.grace_period, True)``.

    ``on_temp_failure``: the client answered TMPFAIL (0x86) or BUSY (0x85) to a message;
    ``attempt`` counts such answers in a row. Return the back-off in seconds before sending
    again (the message goes first). Native default: ``tap.backoff``.
    """

    def on_disconnect(self, connection: str, unacked: int) -> tuple[float, bool] | None:
        return None

    def on_temp_failure(self, connection: str, status: int, attempt: int) -> float | None:
        return None


@dataclasses.dataclass(frozen=True)
class CursorInfo:
    """A stream's cursor into a vbucket's checkpoints (DCP streams, TAP sessions, replicas)."""

    id: int
    #: "dcp:<connection>:<vbucket>" or "dcp:tap:<name>:<vbucket>".
    name: str
    bucket: int
    vbucket: int
    #: The last seqno the cursor has read.
    seqno: int
    #: Bytes of checkpoint memory only this cursor keeps alive.
    pinned_bytes: int


class SlowConsumerPolicy:
    """Which cursors to drop when a bucket's checkpoint memory is over its quota. A dropped
    stream carries on from disk (backfill), or ends with "too slow" if its DCP consumer asked
    for cursor dropping.

    Return the ids of the cursors to drop, or ``None`` for the native choice (those pinning the
    most memory, until the excess is covered). The persistence cursor is never offered.
    """

    def choose(self, over_by: int, cursors: Sequence[CursorInfo]) -> list[int] | None:
        return None


class FilterBatch:
    """One batch of changes a TAP or DCP stream is about to send, as its filter sees it. ``keys``
    and ``vbuckets`` are read on first use, and only during the ``filter`` call: a filter that
    returns a `Prefixes` rule never pays for them."""

    __slots__ = ("connection", "value_bytes", "_docs", "_load", "_blob", "_ends", "_vbuckets", "_keys")

    def __init__(self, q: dict[str, Any], load: Callable[[], tuple[bytes, bytes, bytes]]) -> None:
        """``q`` holds ``connection``, ``docs`` and ``value_bytes``; ``load`` returns the keys in
        one bytes object, their ends as packed u32s and the vbuckets as packed u16s."""
        self.connection: str = q["connection"]
        self.value_bytes: int = q["value_bytes"]
        self._docs: int = q["docs"]
        self._load = load
        self._blob: bytes | None = None
        self._ends: memoryview | None = None
        self._vbuckets: memoryview | None = None
        self._keys: list[bytes] | None = None

    def __len__(self) -> int:
        return self._docs

    def _loaded(self) -> tuple[bytes, memoryview, memoryview]:
        if self._blob is None:
            blob, ends, vbuckets = self._load()
            self._blob = blob
            self._ends, self._vbuckets = memoryview(ends).cast("I"), memoryview(vbuckets).cast("H")
        assert self._ends is not None and self._vbuckets is not None
        return self._blob, self._ends, self._vbuckets

    @property
    def keys(self) -> list[bytes]:
        if self._keys is None:
            blob, ends, _ = self._loaded()
            start, keys = 0, []
            for end in ends:
                keys.append(blob[start:end])
                start = end
            self._keys = keys
        return self._keys

    @property
    def vbuckets(self) -> Sequence[int]:
        return self._loaded()[2]


@dataclasses.dataclass(frozen=True)
class Prefixes:
    """A filter decision the daemon applies natively to each key of the batch: keys starting
    with one of ``drop`` are not sent; keys starting with one of ``strip`` are sent without
    their value (flagged NO_VALUE)."""

    drop: tuple[bytes, ...] = ()
    strip: tuple[bytes, ...] = ()


class StreamFilter:
    """Judges each batch of a stream's changes before it is sent: every TAP stream, and DCP
    streams other than replication (a replica that named itself with ``consumer_name``, or a
    takeover), whose copies must stay whole. ``batch.connection`` is the TAP or DCP
    connection name. Dropped DCP changes leave gaps in the seqnos, as deduplication does.

    Return one of: ``None`` or ``KEEP`` (send everything), ``DROP`` or ``STRIP_VALUE`` for the
    whole batch, a ``bytes`` of one action per change (``len(batch)`` long), or a `Prefixes`
    rule.
    """

    def filter(self, batch: FilterBatch) -> int | bytes | Prefixes | None:
        return None


BASES: dict[str, type] = {
    "ack": AckPolicy,
    "retransmit": RetransmitPolicy,
    "slow_consumer": SlowConsumerPolicy,
    "filter": StreamFilter,
}


def load_plugin(kind: str, path: str, *, reload: bool = False) -> Any:
    """Imports ``package.module:Class`` (or ``package.module.Class``), checks its base class and
    returns an instance."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{path!r} is not an import path (package.module:Class)")
    try:
        module = importlib.import_module(module_name)
        if reload:
            module = importlib.reload(module)
    except ImportError as e:
        raise PluginError(f"cannot import module {module_name!r}: {e}") from None
    except Exception as e:
        raise PluginError(f"importing module {module_name!r} raised {type(e).__name__}: {e}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise PluginError(f"module {module_name!r} has no {attr!r}")
    base = BASES[kind]
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PluginError(f"{path} is not a subclass of sluice.policy.{base.__name__}")
    try:
        return cls()
    except Exception as e:
        raise PluginError(f"{path}() raised {type(e).__name__}: {e}") from None


def _answer(kind: str, plugin: Any, call: Any) -> Any:
    """Calls the plugin with the call's question and returns the answer in the native form."""
    q = call.question()
    if kind == "ack":
        fields = {f.name for f in dataclasses.fields(AckStats)}
        return plugin.on_ack(AckStats(**{k: v for k, v in q.items() if k in fields}))
    if kind == "retransmit":
        if q["event"] == "disconnected":
            return plugin.on_disconnect(q["connection"], q["unacked"])
        seconds = plugin.on_temp_failure(q["connection"], q["status"], q["attempt"])
        return None if seconds is None else (float(seconds), True)
    if kind == "slow_consumer":
        ids = plugin.choose(q["over_by"], [CursorInfo(**c) for c in q["candidates"]])
        return None if ids is None else [int(i) for i in ids]
    decision = plugin.filter(FilterBatch(q, call.filter_keys))
    if isinstance(decision, Prefixes):
        return ("prefixes", list(decision.drop), list(decision.strip))
    if isinstance(decision, (bytearray, memoryview)):
        return bytes(decision)
    return decision


class PluginRunner:
    """Runs the configured plugins for a server: one thread per plugin answering the server's
    questions. ``apply`` installs, replaces (SIGHUP) and removes plugins."""

    def __init__(self, server: Any) -> None:
        self._server = server
        self._plugins: dict[str, Any] = {}
        self._paths: dict[str, str] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._stop = threading.Event()
        self._last_error: dict[str, float] = {}

    def apply(self, paths: dict[str, str], *, reload: bool = False) -> None:
        """Loads every plugin in ``paths`` ({kind: import path}); kinds not named go back to the
        native default. Loading errors raise PluginError before anything changes."""
        loaded = {kind: load_plugin(kind, path, reload=reload) for kind, path in paths.items()}
        for kind in list(self._plugins):
            if kind not in loaded:
                self._server.policy_install(kind, False)
                del self._plugins[kind]
                log.info("policy %s: back to the native default", kind)
        for kind, plugin in loaded.items():
            self._plugins[kind] = plugin
            self._paths[kind] = paths[kind]
            if kind not in self._threads:
                t = threading.Thread(
                    target=self._serve, args=(kind,), name=f"sluice-policy-{kind}", daemon=True
                )
                self._threads[kind] = t
                t.start()
            self._server.policy_install(kind, True)
            log.info("policy %s: %s", kind, paths[kind])

    def stop(self) -> None:
        self._stop.set()
        for kind in list(self._plugins):
            self._server.policy_install(kind, False)
        for t in self._threads.values():
            t.join(timeout=2)

    def _serve(self, kind: str) -> None:
        server = self._server
        while not self._stop.is_set():
            call = server.policy_next(kind, 0.25)
            if call is None:
                continue
            plugin = self._plugins.get(kind)
            if plugin is None:
                call.answer(None)
                continue
            try:
                answer = _answer(kind, plugin, call)
                call.answer(answer)
            except Exception:
                call.fail()
                # One traceback per plugin every 10 s; every error is counted in /metrics.
                now = time.monotonic()
                if now - self._last_error.get(kind, -1e9) >= 10:
                    self._last_error[kind] = now
                    log.exception(
                        "policy %s (%s) raised; the native default was used", kind, self._paths[kind]
                    )
