"""Reading a topic (the ``topic`` option): its messages in the columns of Spark's Kafka source,
``key``, ``value``, ``topic``, ``partition``, ``offset`` (the message's sequence number) and
``timestamp`` (the producer's, in milliseconds). A message without a key has a null ``key``.

The partitions stream over DCP like vbuckets (``Client.stream(topic=...)``), so planning,
offsets (per partition, under ``"vbuckets"``) and streaming reads are the bucket's. Retention may
drop messages a stopped query had not read: it goes on from the oldest kept.
"""

from __future__ import annotations

from typing import Any

from sluice._native import RawBatch

SCHEMA = "key BINARY, value BINARY, topic STRING, partition INT, offset BIGINT, timestamp TIMESTAMP"

# DCP flags of a message that has a key of its own (`dcp::topic_stream::KEYED`).
KEYED = 1


def arrow_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("key", pa.binary()),
            ("value", pa.binary()),
            ("topic", pa.string()),
            ("partition", pa.int32()),
            ("offset", pa.int64()),
            ("timestamp", pa.timestamp("us", tz="UTC")),
        ]
    )


def record_batch(raw: RawBatch, topic: str) -> Any:
    """A native batch of a topic's messages as a RecordBatch of :data:`SCHEMA`, from the
    columns the core built, keys and values byte for byte (the DCP key of a message without
    one is left out as null)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = raw.num_rows
    b = raw.buffers()

    def fixed(name: str, typ: Any) -> Any:
        return pa.Array.from_buffers(typ, n, [None, pa.py_buffer(b[name])])

    keys = pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(b["key_offsets"]), pa.py_buffer(b["keys"])]
    )
    values = pa.Array.from_buffers(
        pa.large_binary(), n, [None, pa.py_buffer(b["value_offsets"]), pa.py_buffer(b["values"])]
    ).cast(pa.binary())
    keyed = pc.not_equal(pc.bit_wise_and(fixed("flags", pa.uint32()), KEYED), 0)
    names = pa.repeat(pa.scalar(topic, pa.string()), n)
    micros = pc.divide(fixed("cas", pa.uint64()), 1000).cast(pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    return pa.RecordBatch.from_arrays(
        [
            pc.if_else(keyed, keys, pa.scalar(None, pa.binary())),
            values,
            names,
            fixed("vbucket", pa.uint16()).cast(pa.int32()),
            fixed("seqno", pa.uint64()).cast(pa.int64()),
            micros,
        ],
        schema=arrow_schema(),
    )


def spark_schema() -> Any:
    from pyspark.sql.types import (
        BinaryType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    types = {
        "BINARY": BinaryType(),
        "STRING": StringType(),
        "INT": IntegerType(),
        "BIGINT": LongType(),
        "TIMESTAMP": TimestampType(),
    }
    fields = [f.split() for f in SCHEMA.split(",")]
    return StructType([StructField(name, types[typ], True) for name, typ in fields])
