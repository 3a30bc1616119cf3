"""Reading an iproto space as typed columns (the ``space`` option): one column per field of the
space's format, named as the format names it, then the change's ``_op``, ``_vbucket``,
``_seqno`` and ``_cas``.

The driver asks the nodes for the space (``STAT spaces`` on their KV port: its bucket, format
and primary key); the executors decode the tuples into Arrow columns in the native module
(``sluice._native.tuple_columns``). A deletion's row holds the primary key's fields (from the
key) and nulls elsewhere.

Tarantool types become Spark types as follows: ``unsigned`` and ``integer`` BIGINT (an
unsigned value above 2^63 - 1 reads as null), ``number`` and ``double`` DOUBLE, ``boolean``
BOOLEAN, ``string`` STRING, ``uuid`` STRING in its text form, ``varbinary`` BINARY, and
``any``, ``scalar``, ``array`` and ``map`` STRING holding the value's JSON (bytes as
``{"base64": ...}``, a UUID or decimal as its text, as ``sluice tail --tuples`` prints them).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from sluice._native import RawBatch, SluiceError, tuple_columns
from sluice.spark.options import OptionError, Options

log = logging.getLogger("sluice.spark")

#: Per Tarantool field type: the native decoder's column kind and the Spark SQL type.
TYPES = {
    "unsigned": ("long", "BIGINT"),
    "integer": ("long", "BIGINT"),
    "number": ("double", "DOUBLE"),
    "double": ("double", "DOUBLE"),
    "boolean": ("boolean", "BOOLEAN"),
    "string": ("string", "STRING"),
    "uuid": ("string", "STRING"),
    "varbinary": ("binary", "BINARY"),
    "any": ("json", "STRING"),
    "scalar": ("json", "STRING"),
    "array": ("json", "STRING"),
    "map": ("json", "STRING"),
}

#: The change's columns after the fields.
CHANGE_COLUMNS = (("_op", "STRING"), ("_vbucket", "INT"), ("_seqno", "BIGINT"), ("_cas", "BIGINT"))


@dataclass(frozen=True)
class SpaceSchema:
    """A space as the node describes it."""

    name: str
    bucket: str
    fields: tuple[tuple[str, str], ...]  # (name, Tarantool type)
    primary_key: tuple[int, ...]  # field numbers, 0-based

    def columns(self) -> list[tuple[str, str]]:
        """(column name, Spark SQL type), fields first."""
        return [(name, TYPES[typ][1]) for name, typ in self.fields] + list(CHANGE_COLUMNS)


def describe(opts: Options) -> SpaceSchema:
    """The space ``opts.space`` as the first node that answers describes it."""
    from sluice.kv import KvConnection

    assert opts.space is not None
    errors = []
    for node in opts.current_nodes():
        try:
            conn = KvConnection(node, None, opts.user, opts.password, opts.timeout)
        except (OSError, SluiceError) as e:
            errors.append(f"{node}: {e}")
            log.warning("sluice node %s: %s", node, e)
            continue
        try:
            stats = conn.stats("spaces")
        finally:
            conn.close()
        text = stats.get(f"space:{opts.space}")
        if text is None:
            known = sorted(k.removeprefix("space:") for k in stats)
            raise OptionError(
                "space",
                f"{node} has no space {opts.space!r} that user {opts.user or '(none)'} may read "
                f"(spaces: {', '.join(known) or 'none'})",
            )
        return _schema(opts.space, json.loads(text))
    raise SluiceError("no sluice node answered: " + "; ".join(errors))


def _schema(name: str, doc: dict) -> SpaceSchema:
    fields = tuple((f["name"], f["type"]) for f in doc["format"])
    unknown = sorted({t for _, t in fields if t not in TYPES})
    if unknown:
        raise OptionError("space", f"space {name!r} has fields of types this reader does not know: {unknown}")
    taken = {c for c, _ in CHANGE_COLUMNS}.intersection(n for n, _ in fields)
    if taken:
        raise OptionError(
            "space", f"space {name!r} has fields named {sorted(taken)}, which the change's columns use"
        )
    return SpaceSchema(name, doc["bucket"], fields, tuple(doc["primary_key"]))


def spark_schema(space: SpaceSchema) -> Any:
    """The StructType of a space's rows (every column nullable: a deletion has only its key)."""
    from pyspark.sql.types import (
        BinaryType,
        BooleanType,
        DoubleType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    types = {
        "BIGINT": LongType(),
        "INT": IntegerType(),
        "DOUBLE": DoubleType(),
        "BOOLEAN": BooleanType(),
        "STRING": StringType(),
        "BINARY": BinaryType(),
    }
    return StructType([StructField(name, types[typ], True) for name, typ in space.columns()])


def record_batch(raw: RawBatch, space: SpaceSchema, include_deletes: bool) -> Any:
    """A native batch of the space's changes as a RecordBatch of its columns."""
    import pyarrow as pa

    arrow = {
        "BIGINT": pa.int64(),
        "INT": pa.int32(),
        "DOUBLE": pa.float64(),
        "BOOLEAN": pa.bool_(),
        "STRING": pa.string(),
        "BINARY": pa.binary(),
    }
    kinds = [TYPES[typ][0] for _, typ in space.fields]
    b = tuple_columns(raw, kinds, list(space.primary_key), include_deletes)
    n = b["num_rows"]
    columns = space.columns()
    arrays = [
        pa.Array.from_buffers(arrow[typ], n, [pa.py_buffer(x) for x in buffers])
        for (_, typ), buffers in zip(columns, b["fields"], strict=False)
    ]
    ops = [None, pa.py_buffer(b["op_offsets"]), pa.py_buffer(b["op_data"])]
    arrays += [
        pa.Array.from_buffers(pa.string(), n, ops),
        pa.Array.from_buffers(pa.int32(), n, [None, pa.py_buffer(b["vbucket"])]),
        pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(b["seqno"])]),
        pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(b["cas"])]),
    ]
    schema = pa.schema([(name, arrow[typ]) for name, typ in columns])
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
