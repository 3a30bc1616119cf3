"""A client for Python: ``sluice.Client(...).stream(...)`` follows a bucket's change stream
from a sluice (or Couchbase) server through the native consumer, and yields batches as pyarrow
RecordBatches or as lists of :class:`Change`; ``set``, ``add``, ``get`` and ``delete`` read and
write items over the memcached binary protocol (:mod:`sluice.kv`), durable writes included.

The session state (per vbucket: failover log, last seqno, snapshot range) is the state after
the last batch yielded; save it with :meth:`Stream.save_state` and pass it back as ``state=`` to
continue with no duplicates and no gaps.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from sluice._native import DcpConsumer, NotFoundError, RawBatch, SluiceError
from sluice.kv import ADD, DELETE, GET, SET, Item, KvConnection, Stored, stored


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Replaces the file at `path` by `text` whole or not at all (temporary file, fsync,
    rename): a stream position a crash cannot leave half written."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


OPS = ("mutation", "deletion", "expiration")

RollbackPolicy = str | Callable[[int, int], object]


class Change(NamedTuple):
    vbucket: int
    seqno: int
    op: str  # "mutation", "deletion" or "expiration"
    key: bytes
    value: bytes
    cas: int
    rev_seqno: int
    flags: int
    expiry: int  # mutations: expiry time; deletions and expirations: delete time
    datatype: int


#: A change's datatype bit when its value starts with extended attributes (a stream opened
#: with ``xattrs=True``).
DATATYPE_XATTR = 0x04


def split_xattrs(value: bytes, datatype: int) -> tuple[dict[str, Any], bytes]:
    """A value's extended attributes (each parsed from its JSON) and its body: a big-endian
    u32 of the attributes' length, then per attribute a big-endian u32 length, the key, a
    NUL, the value and a NUL (Couchbase's layout). A value without the XATTR bit has none."""
    if not datatype & DATATYPE_XATTR:
        return {}, value
    if len(value) < 4 or 4 + int.from_bytes(value[:4], "big") > len(value):
        raise ValueError("the extended attributes run past the value")
    end = 4 + int.from_bytes(value[:4], "big")
    attrs: dict[str, Any] = {}
    at = 4
    while at < end:
        n = int.from_bytes(value[at : at + 4], "big")
        pair = value[at + 4 : at + 4 + n]
        if at + 4 + n > end or pair.count(b"\0") < 2 or not pair.endswith(b"\0"):
            raise ValueError("an extended attribute does not read")
        key, _, rest = pair.partition(b"\0")
        attrs[key.decode()] = json.loads(rest[:-1])
        at += 4 + n
    return attrs, value[end:]


class RollbackError(SluiceError):
    """The producer's history diverged from this consumer's: roll your data back to ``seqno`` for
    ``vbucket`` (remove what you hold above it), then resume from the stream's state."""

    def __init__(self, vbucket: int, seqno: int) -> None:
        super().__init__(f"vbucket {vbucket} must roll back to seqno {seqno}")
        self.vbucket = vbucket
        self.seqno = seqno


def arrow_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("vbucket", pa.uint16()),
            ("seqno", pa.uint64()),
            ("op", pa.dictionary(pa.int8(), pa.string())),
            ("key", pa.binary()),
            ("value", pa.large_binary()),
            ("cas", pa.uint64()),
            ("rev_seqno", pa.uint64()),
            ("flags", pa.uint32()),
            ("expiry", pa.uint32()),
            ("datatype", pa.uint8()),
        ]
    )


def to_record_batch(raw: RawBatch) -> Any:
    """The batch's column buffers as a pyarrow RecordBatch, without a Python step per row."""
    import pyarrow as pa

    n = raw.num_rows
    b = raw.buffers()

    def fixed(name: str, typ: Any) -> Any:
        return pa.Array.from_buffers(typ, n, [None, pa.py_buffer(b[name])])

    ops = pa.Array.from_buffers(pa.int8(), n, [None, pa.py_buffer(b["op"])])
    columns = [
        fixed("vbucket", pa.uint16()),
        fixed("seqno", pa.uint64()),
        pa.DictionaryArray.from_arrays(ops, pa.array(OPS, pa.string())),
        pa.Array.from_buffers(
            pa.binary(), n, [None, pa.py_buffer(b["key_offsets"]), pa.py_buffer(b["keys"])]
        ),
        pa.Array.from_buffers(
            pa.large_binary(), n, [None, pa.py_buffer(b["value_offsets"]), pa.py_buffer(b["values"])]
        ),
        fixed("cas", pa.uint64()),
        fixed("rev_seqno", pa.uint64()),
        fixed("flags", pa.uint32()),
        fixed("expiry", pa.uint32()),
        fixed("datatype", pa.uint8()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=arrow_schema())


class Stream:
    """An iterator of batches from DCP streams (a connection per node streamed from). Close it
    (or use ``with``) when done."""

    def __init__(
        self,
        consumer: DcpConsumer,
        convert: Callable[[RawBatch], Any],
        rollback: RollbackPolicy,
        skip_empty: bool,
    ) -> None:
        self._consumer = consumer
        self._convert = convert
        self._rollback = rollback
        self._skip_empty = skip_empty
        self.ended: dict[int, int] = {}
        self.rollbacks: list[tuple[int, int]] = []
        self._done = False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while not self._done:
            batch = self._take(1.0)
            if batch is not None:
                return batch
        raise StopIteration

    def poll(self, timeout: float) -> Any | None:
        """Like ``next()``, but returns None if no batch arrives within ``timeout`` seconds (or
        the stream has finished)."""
        deadline = time.monotonic() + timeout
        while not self._done:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            batch = self._take(min(left, 1.0))
            if batch is not None:
                return batch
        return None

    def _take(self, timeout: float) -> Any | None:
        """One event: a converted batch, or None (timeout, a handled rollback, the end)."""
        event = self._consumer.next_event(timeout)
        if event is None:
            return None
        kind = event[0]
        if kind == "finished":
            self._done = True
            return None
        if kind == "rollback":
            _, vbucket, seqno = event
            self.rollbacks.append((vbucket, seqno))
            if not callable(self._rollback):
                raise RollbackError(vbucket, seqno)
            self._rollback(vbucket, seqno)
            self._consumer.resume(vbucket)
            return None
        raw = event[1]
        self.ended.update(raw.ended)
        self.rollbacks.extend(raw.rollbacks)
        if raw.num_rows == 0 and self._skip_empty:
            return None
        return self.convert(raw)

    def convert(self, raw: RawBatch) -> Any:
        return self._convert(raw)

    @property
    def finished(self) -> bool:
        return self._done

    def state(self) -> dict:
        """The session state after the last batch returned (JSON-ready)."""
        return json.loads(self._consumer.state_json())

    def state_json(self) -> str:
        return self._consumer.state_json()

    def save_state(self, path: str | os.PathLike) -> None:
        """Writes the state atomically (temporary file, fsync, rename)."""
        write_atomically(path, self._consumer.state_json())

    def positions(self) -> dict[int, tuple[int, int, int, bool]]:
        """Per vbucket: (seqno, snapshot start, snapshot end, snapshot is a backfill)."""
        return {vb: (s, a, b, disk) for vb, s, a, b, disk in self._consumer.positions()}

    def close(self) -> None:
        self._done = True
        self._consumer.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """A server's address, bucket and credentials: streams from it (:meth:`stream`, a
    connection each) and reads and writes items (one connection, opened on first use; close it
    with :meth:`close` or ``with``)."""

    def __init__(
        self,
        address: str = "127.0.0.1:11210",
        *,
        bucket: str = "default",
        username: str | None = None,
        password: str | None = None,
        name: str | None = None,
        timeout: float = 10.0,
        cafile: str | None = None,
    ) -> None:
        self.address = address
        self.bucket = bucket
        self.username = username
        self.password = password
        self.name = name or f"sluice-client:{os.getpid()}:{time.time_ns()}"
        self.timeout = timeout
        #: The CAs (PEM) a TLS port's certificate must chain to: set, every connection (items
        #: and streams) is TLS, and ``address`` is the TLS port (``tls_listen``).
        self.cafile = cafile
        self._kv: KvConnection | None = None

    def _connection(self) -> KvConnection:
        if self._kv is None:
            self._kv = KvConnection(
                self.address, self.bucket, self.username, self.password, self.timeout, self.cafile
            )
        return self._kv

    def _store(
        self,
        opcode: int,
        key: bytes,
        value: bytes,
        flags: int,
        expiry: int,
        cas: int,
        durability: str | None,
        durability_timeout: float | None,
    ) -> Stored:
        extras, _, new_cas = self._connection().request(
            opcode,
            key=key,
            extras=struct.pack(">II", flags, expiry),
            value=value,
            cas=cas,
            durability=durability,
            durability_timeout=durability_timeout,
        )
        return stored(extras, new_cas)

    def set(
        self,
        key: bytes,
        value: bytes,
        *,
        flags: int = 0,
        expiry: int = 0,
        cas: int = 0,
        durability: str | None = None,
        durability_timeout: float | None = None,
    ) -> Stored:
        """Stores the item (only over CAS ``cas`` when it is not 0: else ExistsError).

        durability: None (the bucket's `durability`), "majority", "majority_and_persist_active"
            or "persist_to_majority": the reply waits until the level is met;
            DurabilityImpossibleError when too few replicas follow the vbucket,
            SyncWriteAmbiguousError when it is not met within ``durability_timeout`` seconds
            (default: the bucket's `durability_timeout`).
        """
        return self._store(SET, key, value, flags, expiry, cas, durability, durability_timeout)

    def add(
        self,
        key: bytes,
        value: bytes,
        *,
        flags: int = 0,
        expiry: int = 0,
        durability: str | None = None,
        durability_timeout: float | None = None,
    ) -> Stored:
        """Stores the item only if the key holds none (else ExistsError); durability as in set."""
        return self._store(ADD, key, value, flags, expiry, 0, durability, durability_timeout)

    def get(self, key: bytes) -> Item | None:
        """The item's value, flags and CAS; None if the key holds none."""
        try:
            extras, value, cas = self._connection().request(GET, key=key)
        except NotFoundError:
            return None
        (flags,) = struct.unpack(">I", extras) if len(extras) == 4 else (0,)
        return Item(value, flags, cas)

    def delete(
        self,
        key: bytes,
        *,
        cas: int = 0,
        durability: str | None = None,
        durability_timeout: float | None = None,
    ) -> Stored:
        """Deletes the item (NotFoundError if there is none); cas and durability as in set."""
        extras, _, new_cas = self._connection().request(
            DELETE, key=key, cas=cas, durability=durability, durability_timeout=durability_timeout
        )
        return stored(extras, new_cas)

    def close(self) -> None:
        """Closes the read/write connection (streams are closed on their own)."""
        if self._kv is not None:
            self._kv.close()
            self._kv = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(
        self,
        vbuckets: list[int] | None = None,
        *,
        start: str = "beginning",
        end: str | dict[int, int] | None = None,
        state: dict | str | os.PathLike | None = None,
        rollback: RollbackPolicy = "raise",
        format: str | Callable[[RawBatch], Any] = "arrow",
        batch_size: int = 8192,
        buffer_size: int = 16 << 20,
        noop_interval: int = 20,
        values: bool = True,
        xattrs: bool = False,
        cursor_dropping: bool = False,
        skip_empty: bool = True,
        setup_timeout: float | None = None,
        topic: str | None = None,
        follow_moves: bool = True,
        move_timeout: float = 60.0,
    ) -> Stream:
        """Opens streams for ``vbuckets`` (default: every active vbucket).

        topic: stream that topic's partitions instead (``vbuckets`` then names partitions;
            default: every one): each message is a mutation whose seqno is its sequence
            number, value its content and CAS its timestamp in nanoseconds; its key is the
            message's with flags 1, or (a message without one) its sequence number in decimal
            with flags 0. The login needs the stream permission on the client's bucket.

        start: "beginning" or "now", for vbuckets the state does not cover.
        end: None to follow forever, "now" to stop at the high seqnos of the moment, or per
            vbucket the seqno to stop at (the other vbuckets follow forever).
        state: a state from :meth:`Stream.state` (a dict, JSON text, or a file path).
        rollback: "raise" (RollbackError), "resume" (roll back and go on), or a callable
            ``(vbucket, seqno)`` run before the stream resumes from the rollback point.
        format: "arrow" (pyarrow.RecordBatch), "python" (list of Change), or a callable that
            turns each RawBatch into what the stream yields.
        setup_timeout: seconds for connecting and for each setup answer (default: twice the
            NOOP interval, 5 to 30 s).
        xattrs: ask for documents' extended attributes too: a value then starts with them,
            its datatype's XATTR bit (4) set (``sluice.spark``'s ``xattrs`` option splits them
            off into a column).
        follow_moves: follow the cluster map. In a cluster (the map puts actives on several
            nodes) each vbucket streams from its active, ``vbuckets`` defaulting to all of the
            bucket's, and a vbucket that moves (rebalance, failover, ``sluice move-vbucket``)
            is streamed on from its new active where the reader left it; without a cluster
            the streams start on this node as asked and only moves are followed. False: this
            node alone (a replica's copy, say), as the Spark source reads.
        move_timeout: seconds a moved vbucket may go without a node to stream from (a failover
            takes the lease's 2 s plus the auto-failover timeout) before the stream fails.
        """
        if start not in ("beginning", "now"):
            raise ValueError(f"start must be 'beginning' or 'now', not {start!r}")
        if not (end in (None, "now") or isinstance(end, dict)):
            raise ValueError(f"end must be None, 'now' or a dict of seqnos, not {end!r}")
        converters: dict[str, Callable[[RawBatch], Any]] = {
            "arrow": to_record_batch,
            "python": lambda raw: raw.rows(Change),
        }
        if callable(format):
            convert = format
        elif format in converters:
            convert = converters[format]
        else:
            raise ValueError(f"format must be 'arrow', 'python' or a callable, not {format!r}")
        if format == "arrow":
            try:
                import pyarrow  # noqa: F401
            except ImportError as e:
                raise ImportError("format='arrow' needs pyarrow: pip install 'sluice-kv[arrow]'") from e
        if not (rollback in ("raise", "resume") or callable(rollback)):
            raise ValueError("rollback must be 'raise', 'resume' or a callable (vbucket, seqno)")
        state_text = _state_text(state)
        consumer = DcpConsumer(
            self.address,
            bucket=self.bucket,
            username=self.username,
            password=self.password,
            name=self.name,
            vbuckets=vbuckets,
            from_now=start == "now",
            to_latest=end == "now",
            end_seqnos=end if isinstance(end, dict) else None,
            state=state_text,
            rollback="resume" if rollback == "resume" else "ask",
            batch_size=batch_size,
            buffer_size=buffer_size,
            noop_interval=noop_interval,
            include_values=values,
            include_xattrs=xattrs,
            cursor_dropping=cursor_dropping,
            setup_timeout=setup_timeout,
            topic=topic,
            follow_moves=follow_moves,
            move_timeout=move_timeout,
            cafile=self.cafile,
        )
        return Stream(consumer, convert, rollback, skip_empty)


def _state_text(state: dict | str | os.PathLike | None) -> str | None:
    if state is None:
        return None
    if isinstance(state, dict):
        return json.dumps(state)
    if isinstance(state, str) and state.lstrip().startswith("{"):
        return state
    path = Path(state)
    if not path.exists():
        return None
    return path.read_text()
