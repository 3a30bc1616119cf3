"""The ``sluice`` PySpark data source: batch and Structured Streaming reads of a bucket's
changes, preferably from a replica.

    import sluice.spark
    from pyspark.sql import SparkSession

    sluice.spark.use_this_python()  # local sessions: workers run this interpreter
    spark = SparkSession.builder.getOrCreate()
    sluice.spark.register(spark)
    df = spark.read.format("sluice").option("nodes", "10.0.0.2:11210").load()

Rows have the fixed schema :data:`SCHEMA`, or with ``.option("space", NAME)`` one typed column
per field of an iproto space (:mod:`sluice.spark.space`), or with ``.option("topic", NAME)`` a
topic's messages in the columns of Spark's Kafka source (:mod:`sluice.spark.topic`). They
reach Spark as Arrow record batches whose columns the native module builds; each Spark task
opens its own DCP connection. The package and its native module must be installed (``pip
install 'sluice-kv[spark]'``) on the driver and on every executor, for the interpreter Spark's
Python workers run (``PYSPARK_PYTHON``). Options are documented in docs/spark.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pyspark.errors import PySparkNotImplementedError
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
    SimpleDataSourceStreamReader,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from sluice._native import RawBatch, SluiceError
from sluice.spark import planning, space, topic
from sluice.spark.options import OptionError, Options, parse
from sluice.spark.planning import DataLossError, Position, VbucketRange
from sluice.spark.space import SpaceSchema

__all__ = [
    "SCHEMA",
    "DataLossError",
    "OptionError",
    "SluiceDataSource",
    "check_worker_python",
    "register",
    "use_this_python",
]

log = logging.getLogger("sluice.spark")

#: The rows' schema. ``op`` is mutation, deletion or expiration; ``expiry`` is the expiry time
#: of a mutation and the delete time of a deletion; ``cas`` and ``flags`` keep their 64 and 32
#: bits (values past the signed range read as negative numbers); a key that is not UTF-8 has
#: U+FFFD in place of its bad bytes (``value`` is always exact).
SCHEMA = (
    "vbucket INT, seqno BIGINT, op STRING, key STRING, value BINARY, flags INT, expiry BIGINT, "
    "cas BIGINT, rev_seqno BIGINT"
)


#: The column the ``xattrs`` option adds: a document's extended attributes as one JSON
#: object (``{}`` for none); ``value`` is then its body alone.
SCHEMA_XATTRS = SCHEMA + ", xattrs STRING"


def arrow_schema(xattrs: bool = False) -> Any:
    """The Arrow schema Spark expects for :data:`SCHEMA` (every field nullable), or with
    ``xattrs`` for :data:`SCHEMA_XATTRS`."""
    import pyarrow as pa

    extra = [("xattrs", pa.string())] if xattrs else []
    return pa.schema(
        [
            ("vbucket", pa.int32()),
            ("seqno", pa.int64()),
            ("op", pa.string()),
            ("key", pa.string()),
            ("value", pa.binary()),
            ("flags", pa.int32()),
            ("expiry", pa.int64()),
            ("cas", pa.int64()),
            ("rev_seqno", pa.int64()),
            *extra,
        ]
    )


def record_batch(raw: RawBatch, include_deletes: bool, xattrs: bool = False) -> Any:
    """A native batch as a RecordBatch of :data:`SCHEMA` (:data:`SCHEMA_XATTRS` with
    ``xattrs``), from the columns the core built."""
    import pyarrow as pa

    b = raw.spark_buffers(include_deletes, xattrs)
    n = b["num_rows"]

    def fixed(name: str, typ: Any) -> Any:
        return pa.Array.from_buffers(typ, n, [None, pa.py_buffer(b[name])])

    def variable(name: str, typ: Any) -> Any:
        bufs = [None, pa.py_buffer(b[f"{name}_offsets"]), pa.py_buffer(b[f"{name}_data"])]
        return pa.Array.from_buffers(typ, n, bufs)

    return pa.RecordBatch.from_arrays(
        [
            fixed("vbucket", pa.int32()),
            fixed("seqno", pa.int64()),
            variable("op", pa.string()),
            variable("key", pa.string()),
            variable("value", pa.binary()),
            fixed("flags", pa.int32()),
            fixed("expiry", pa.int64()),
            fixed("cas", pa.int64()),
            fixed("rev_seqno", pa.int64()),
            *([variable("xattrs", pa.string())] if xattrs else []),
        ],
        schema=arrow_schema(xattrs),
    )


_END_REASONS = {
    1: "closed by the node",
    2: "the vbucket changed state on the node",
    3: "the connection was dropped",
    4: "the reader was too slow",
    5: "the node failed to read its data",
    6: "the vbucket is rolling back",
    8: "the user lost its privileges",
}


@dataclass(frozen=True)
class SluicePartition(InputPartition):
    """Ranges of vbuckets read from one node over one connection."""

    node: str
    ranges: tuple[VbucketRange, ...]


def read_partition(opts: Options, part: SluicePartition, tuples: SpaceSchema | None) -> Iterator[Any]:
    """Streams the partition's ranges on a connection of its own, as Arrow record batches (of
    the space's columns when ``tuples`` is given)."""
    from sluice.client import Client

    if opts.topic is not None:
        convert = lambda raw: topic.record_batch(raw, opts.topic)  # noqa: E731
    elif tuples is None:
        convert = lambda raw: record_batch(raw, opts.include_deletes, opts.xattrs)  # noqa: E731
    else:
        convert = lambda raw: space.record_batch(raw, tuples, opts.include_deletes)  # noqa: E731

    ranges = [r for r in part.ranges if r.end > r.start]
    if not ranges:
        return
    state = {
        "version": 1,
        "vbuckets": {
            str(r.vbucket): {
                "failover_log": [[r.uuid, 0]] if r.start > 0 else [],
                "seqno": r.start,
                "snapshot": [r.start, r.start],
            }
            for r in ranges
        },
    }

    def rollback(vbucket: int, seqno: int) -> None:
        why = f"the node asked this read to roll back to seqno {seqno}: its history changed"
        if opts.fail_on_data_loss:
            raise DataLossError(vbucket, why)
        log.warning("vbucket %d: %s; going on from there", vbucket, why)

    client = Client(
        part.node,
        bucket=opts.bucket,
        username=opts.user,
        password=opts.password,
        # Unique per task attempt: a retried task must not share its connection's name.
        name=f"spark:{os.getpid()}:{time.time_ns()}:{ranges[0].vbucket}",
    )
    with client.stream(
        [r.vbucket for r in ranges],
        state=state,
        end={r.vbucket: r.end for r in ranges},
        rollback=rollback,
        format=convert,
        setup_timeout=opts.timeout,
        topic=opts.topic,
        xattrs=opts.xattrs,
        # The plan names the node (a replica, often) each range is read from.
        follow_moves=False,
    ) as stream:
        for batch in stream:
            if batch.num_rows:
                yield batch
        for r in ranges:
            reason = stream.ended.get(r.vbucket)
            if reason not in (None, 0):
                why = _END_REASONS.get(reason, f"reason {reason}")
                raise SluiceError(
                    f"vbucket {r.vbucket}'s stream from {part.node} ended before seqno {r.end}: {why}"
                )


def _partitions(
    opts: Options,
    sources: dict[int, planning.VbucketSource],
    start: dict[int, Position],
    end: dict[int, Position],
) -> list[SluicePartition]:
    todo = [vb for vb, s in sorted(start.items()) if vb in end and end[vb].seqno > s.seqno]
    unserved = [vb for vb in todo if vb not in sources]
    if unserved:
        raise SluiceError(f"no node serves vbucket(s) {unserved[:10]} any more")
    ranges = [
        (sources[vb].node, VbucketRange(vb, start[vb].uuid, start[vb].seqno, end[vb].seqno)) for vb in todo
    ]
    n = opts.num_partitions or planning.partitions_for(ranges)
    return [SluicePartition(node, tuple(rs)) for node, rs in planning.group(ranges, n)]


class SluiceBatchReader(DataSourceReader):
    """One snapshot per vbucket: its changes from startingOffsets up to its high seqno at
    planning time (or endingOffsets); a key overwritten after planning shows only later."""

    def __init__(self, opts: Options, tuples: SpaceSchema | None) -> None:
        self.opts = opts
        self.tuples = tuples

    def partitions(self) -> list[SluicePartition]:
        sources = planning.locate(self.opts)
        start = planning.resolve(self.opts.starting_offsets, sources, "earliest")
        start = planning.check_history(start, sources, self.opts.fail_on_data_loss)
        assert self.opts.ending_offsets is not None
        end = planning.resolve(self.opts.ending_offsets, sources, "latest")
        for vb, e in end.items():
            if e.seqno > sources[vb].high_seqno:
                raise OptionError(
                    "endingOffsets",
                    f"vbucket {vb} ends at {e.seqno}, past its high seqno {sources[vb].high_seqno}",
                )
        return _partitions(self.opts, sources, start, end)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        if not isinstance(partition, SluicePartition):
            # Planning found nothing to read (no vbucket holds a change): Spark still runs one
            # partition of its own, which yields no rows.
            return iter(())
        return read_partition(self.opts, partition, self.tuples)


class SluiceStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of changes between offsets that hold (uuid, seqno) per vbucket."""

    def __init__(self, opts: Options, tuples: SpaceSchema | None) -> None:
        self.opts = opts
        self.tuples = tuples
        # Planning state on the driver's long-lived planner process.
        self._target: dict[int, int] | None = None  # Trigger.AvailableNow: stop here
        self._sources: dict[int, planning.VbucketSource] = {}

    def _locate(self) -> dict[int, planning.VbucketSource]:
        self._sources = planning.locate(self.opts)
        return self._sources

    def initialOffset(self) -> dict:
        sources = self._locate()
        return planning.offset_json(planning.resolve(self.opts.starting_offsets, sources, "latest"))

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_records_per_batch
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {vb: s.high_seqno for vb, s in self._locate().items()}

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        sources = self._locate()
        begin = planning.parse_offset(start)
        checked = planning.check_history(begin, sources, self.opts.fail_on_data_loss)
        ends: dict[int, Position] = {}
        backlog: dict[int, int] = {}
        for vb, src in sources.items():
            pos = checked.get(vb, Position(0, src.uuid))  # a vbucket new to the query
            high = src.high_seqno
            if self._target is not None:
                high = min(high, self._target.get(vb, high))
            ends[vb] = pos
            if high > pos.seqno:
                backlog[vb] = high - pos.seqno
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        for vb, n in _share(backlog, budget).items():
            seqno = ends[vb].seqno + n
            ends[vb] = Position(seqno, planning.uuid_at(sources[vb].failover, seqno))
        # Vbuckets the nodes no longer serve keep their offset.
        for vb, pos in begin.items():
            ends.setdefault(vb, pos)
        out = planning.offset_json(ends)
        return start if out == start else out

    def reportLatestOffset(self) -> dict | None:
        """Every vbucket at its high seqno as last looked up (by ``latestOffset``, no request of
        its own): the query's progress shows it as the source's latest offset, how far behind
        the micro-batches run."""
        if not self._sources:
            return None
        return planning.offset_json({vb: Position(s.high_seqno, s.uuid) for vb, s in self._sources.items()})

    def partitions(self, start: dict, end: dict) -> list[SluicePartition]:
        begin = planning.parse_offset(start)
        until = planning.parse_offset(end)
        sources = self._sources or self._locate()
        # Where latestOffset moved a vbucket off a changed history, the range starts where
        # the histories agree (checked again: this batch may be replayed after a restart).
        begin = planning.check_history(begin, sources, self.opts.fail_on_data_loss)
        return _partitions(self.opts, sources, begin, until)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        if not isinstance(partition, SluicePartition):
            return iter(())  # as in a batch: nothing was planned
        return read_partition(self.opts, partition, self.tuples)

    def commit(self, end: dict) -> None:
        """Nothing to release: the node keeps no state for the query."""


class SluiceDriverStreamReader(SimpleDataSourceStreamReader, SupportsTriggerAvailableNow):
    """``readOnDriver``: each micro-batch's changes are read by the driver's planner process
    when Spark asks where the stream stands, and handed to Spark with the plan. A micro-batch
    then runs no Python task: on small micro-batches that is most of their cost (a Python
    worker per task, the read plan shipped to it, the Arrow hand-over back). Every change
    passes through the driver, so a micro-batch is capped at ``maxRecordsPerBatch`` seqnos
    (:data:`DRIVER_BATCH_SEQNOS` if unset); Spark's own read limits and the latest offset in
    the query's progress are not offered to this kind of reader. A batch replayed after a
    restart is read again by one task."""

    def __init__(self, opts: Options, tuples: SpaceSchema | None) -> None:
        self.planner = SluiceStreamReader(opts, tuples)
        self.limit = ReadMaxRows(opts.max_records_per_batch or DRIVER_BATCH_SEQNOS)

    def initialOffset(self) -> dict:
        return self.planner.initialOffset()

    def prepareForTriggerAvailableNow(self) -> None:
        self.planner.prepareForTriggerAvailableNow()

    def read(self, start: dict) -> tuple[Iterator[Any], dict]:
        end = self.planner.latestOffset(start, self.limit)
        if end == start:  # nothing new: Spark asks again after its polling delay
            return iter(()), start
        # A list, not a generator: Spark copies the iterator it keeps for the micro-batch.
        return iter(list(self.readBetweenOffsets(start, end))), end

    def readBetweenOffsets(self, start: dict, end: dict) -> Iterator[Any]:
        for part in self.planner.partitions(start, end):
            yield from self.planner.read(part)

    def commit(self, end: dict) -> None:
        """Nothing to release: the node keeps no state for the query."""


#: The most seqnos a ``readOnDriver`` micro-batch covers when ``maxRecordsPerBatch`` is unset.
DRIVER_BATCH_SEQNOS = 100_000


def _share(backlog: dict[int, int], budget: int | None) -> dict[int, int]:
    """How many seqnos each vbucket advances: all of its backlog, or a share of ``budget`` in
    proportion to it (at least one each while the budget lasts, as Kafka's source splits
    maxOffsetsPerTrigger)."""
    total = sum(backlog.values())
    if budget is None or total <= budget:
        return dict(backlog)
    out: dict[int, int] = {}
    left = budget
    for vb, n in sorted(backlog.items(), key=lambda kv: (-kv[1], kv[0])):
        if left <= 0:
            break
        take = min(n, left, max(1, budget * n // total))
        out[vb] = take
        left -= take
    return out


class SluiceDataSource(DataSource):
    """``spark.read.format("sluice")`` and ``spark.readStream.format("sluice")``."""

    @classmethod
    def name(cls) -> str:
        return "sluice"

    def _space(self) -> SpaceSchema | None:
        """The space the ``space`` option names, asked of the nodes once."""
        if not hasattr(self, "_described"):
            # The options a batch or a stream alone takes are checked by reader() and
            # streamReader(); the space needs only the nodes and the login.
            common = {k: v for k, v in self.options.items() if k.lower() not in _MODE_OPTIONS}
            opts = parse(common, streaming=False)
            self._described = space.describe(opts) if opts.space is not None else None
        return self._described

    def _options(self, streaming: bool) -> tuple[Options, SpaceSchema | None]:
        opts = parse(self.options, streaming=streaming)
        tuples = self._space()
        if tuples is not None:
            opts = dataclasses.replace(opts, bucket=tuples.bucket)
        return opts, tuples

    def _topic(self) -> bool:
        return any(k.lower() == "topic" for k in self.options)

    def schema(self) -> StructType:
        if self._topic():
            return topic.spark_schema()
        tuples = self._space()
        if tuples is not None:
            return space.spark_schema(tuples)
        # As the reader parses it ("true", "1", ...), so that the schema and the rows agree.
        xattrs = {k: v for k, v in self.options.items() if k.lower() == "xattrs"}
        return spark_schema(parse(xattrs, streaming=False).xattrs)

    def reader(self, schema: StructType) -> DataSourceReader:
        self._check_schema(schema)
        return SluiceBatchReader(*self._options(streaming=False))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        self._check_schema(schema)
        opts, tuples = self._options(streaming=True)
        if opts.read_on_driver:
            # Spark then asks simpleStreamReader (its documented way to choose that reader).
            raise PySparkNotImplementedError(
                errorClass="NOT_IMPLEMENTED", messageParameters={"feature": "streamReader"}
            )
        return SluiceStreamReader(opts, tuples)

    def simpleStreamReader(self, schema: StructType) -> SimpleDataSourceStreamReader:
        self._check_schema(schema)
        return SluiceDriverStreamReader(*self._options(streaming=True))

    def _check_schema(self, schema: StructType) -> None:
        if schema == self.schema():
            return
        if self._topic():
            raise OptionError("schema", f"a topic reads with the fixed schema {topic.SCHEMA}")
        if self._space() is None:
            raise OptionError(
                "schema", f"the sluice source has the fixed schema {SCHEMA} ({SCHEMA_XATTRS} with xattrs)"
            )
        raise OptionError(
            "schema", "a space's columns are its format's fields, then _op, _vbucket, _seqno, _cas"
        )


_MODE_OPTIONS = ("endingoffsets", "maxrecordsperbatch", "readondriver")


def spark_schema(xattrs: bool = False) -> StructType:
    """:data:`SCHEMA` (:data:`SCHEMA_XATTRS` with ``xattrs``) as a StructType (built without a
    SparkSession: readers run without one)."""
    from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructField

    types = {"INT": IntegerType(), "BIGINT": LongType(), "STRING": StringType(), "BINARY": BinaryType()}
    fields = [f.split() for f in (SCHEMA_XATTRS if xattrs else SCHEMA).split(",")]
    return StructType([StructField(name, types[typ], True) for name, typ in fields])


def use_this_python() -> None:
    """Makes Spark's Python workers run this interpreter, unless ``PYSPARK_PYTHON`` names one
    already. Spark's default is ``python3`` from the PATH, which in a virtualenv that is not
    activated (or a system Python) has no sluice: the worker fails with ``No module named
    'sluice'``. Call it before the SparkSession starts: Spark reads the variable once, when it
    launches its JVM. For local sessions; a cluster's executors need sluice-kv installed for
    the interpreter they run."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def check_worker_python(python: str) -> None:
    """Raises SluiceError, naming PYSPARK_PYTHON, when ``python`` (the interpreter Spark starts
    its Python workers with) cannot import sluice's native module."""
    try:
        r = subprocess.run(
            [python, "-c", "import sluice._native"], capture_output=True, text=True, timeout=120
        )
        why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1] if r.returncode else None
    except OSError as e:
        why = e.strerror or str(e)
    if why is None:
        return
    setting = os.environ.get("PYSPARK_PYTHON")
    source = f"PYSPARK_PYTHON={setting}" if setting else "PYSPARK_PYTHON is not set, so Spark's default"
    raise SluiceError(
        f"Spark's Python workers run {python} ({source}), which cannot import sluice: {why}. Set "
        f"PYSPARK_PYTHON={sys.executable} (this interpreter) before the SparkSession starts "
        "(sluice.spark.use_this_python() does), or install sluice-kv for that interpreter."
    )


def register(spark: Any) -> None:
    """Registers the data source with a SparkSession under the name ``sluice``. On a local
    master it first checks that Spark's Python workers can import sluice (see
    :func:`use_this_python`): a worker that cannot fails later inside an error that does not
    say why."""
    try:
        context = spark.sparkContext
    except NotImplementedError:  # a Spark Connect session: its workers are the server's
        context = None
    if context is not None and context.master.startswith("local"):
        check_worker_python(context.pythonExec)
    spark.dataSource.register(SluiceDataSource)
