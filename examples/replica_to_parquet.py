"""Streams a bucket's changes from a sluice replica into Parquet files, with a checkpoint.

    pip install 'sluice-kv[spark]'
    python examples/replica_to_parquet.py --nodes 127.0.0.1:11210,127.0.0.1:11211 \
        --out changes/ --checkpoint changes-checkpoint/

Stop it (Ctrl-C) and start it again with the same --checkpoint: it goes on from the last
micro-batch written, with no change written twice and none missing. --available-now writes
what the nodes hold at the start and exits (Trigger.AvailableNow), for a scheduled job.

Each micro-batch the Parquet sink commits is printed with the rows it wrote, counted from the
sink's own log (out/_spark_metadata) and the Parquet files it lists. Spark's Python workers run
this interpreter (PYSPARK_PYTHON, unless set otherwise), the one sluice is installed in.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path


class SinkLog:
    """The micro-batches a file sink committed, from its log: out/_spark_metadata/N lists the
    files batch N added (N.compact every file so far), and each Parquet file's footer holds its
    row count. Batches already in the log when it is created are not reported."""

    def __init__(self, out: str) -> None:
        self.dir = Path(out) / "_spark_metadata"
        self.counted: set[str] = set()
        self.last = -1
        for batch, log in self._batches():
            self._new_files(log)
            self.last = batch

    def _batches(self) -> list[tuple[int, Path]]:
        if not self.dir.is_dir():
            return []
        found = [(int(p.name.split(".")[0]), p) for p in self.dir.iterdir() if p.name.split(".")[0].isdigit()]
        return sorted(found)

    def _new_files(self, log: Path) -> list[str]:
        lines = log.read_text().splitlines()[1:]  # after the version line, one JSON file entry each
        paths = [e["path"] for e in map(json.loads, lines) if e.get("action") == "add"]
        new = [p for p in paths if p not in self.counted]
        self.counted.update(new)
        return new

    def new_batches(self) -> list[tuple[int, int]]:
        """(batch id, rows written) of each batch committed since the last call."""
        import pyarrow.parquet as pq
        from pyarrow import fs

        out = []
        for batch, log in self._batches():
            if batch <= self.last:
                continue
            rows = 0
            for uri in self._new_files(log):
                filesystem, path = fs.FileSystem.from_uri(uri)
                rows += pq.ParquetFile(path, filesystem=filesystem).metadata.num_rows
            out.append((batch, rows))
            self.last = batch
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="127.0.0.1:11210", help="HOST:PORT[,HOST:PORT...] of sluice nodes")
    p.add_argument("--bucket", default="default")
    p.add_argument("--out", required=True, help="directory of the Parquet files")
    p.add_argument("--checkpoint", required=True, help="the query's checkpoint directory")
    p.add_argument("--max-records-per-batch", type=int, default=100_000)
    p.add_argument("--interval", default="1 second", help="micro-batch trigger interval")
    p.add_argument("--available-now", action="store_true", help="write what is there, then exit")
    args = p.parse_args()

    import sluice.spark
    from pyspark.sql import SparkSession

    # Before the session starts: Spark reads PYSPARK_PYTHON once, when its JVM launches.
    sluice.spark.use_this_python()
    spark = (
        SparkSession.builder.appName("sluice-replica-to-parquet")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    sluice.spark.register(spark)
    changes = (
        spark.readStream.format("sluice")
        .option("nodes", args.nodes)
        .option("bucket", args.bucket)
        .option("startingOffsets", "earliest")
        .option("maxRecordsPerBatch", str(args.max_records_per_batch))
        .load()
    )
    writer = (
        changes.writeStream.format("parquet")
        .option("path", args.out)
        .option("checkpointLocation", args.checkpoint)
    )
    if args.available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=args.interval)
    sink = SinkLog(args.out)  # before the query starts: its first batch is reported too
    query = writer.start()

    # SIGTERM (systemd, kill) and Ctrl-C only ask the loop below to stop. Raising from the
    # handler instead would cut a py4j call short and leave the JVM gateway unusable for the
    # query.stop() that follows. A micro-batch cut short by the stop is not committed to the
    # checkpoint, and the next start writes it again in full; the file sink's log keeps
    # readers from seeing the partial one.
    stop = threading.Event()

    def request_stop(*_: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    def show_committed() -> None:
        for batch, rows in sink.new_batches():
            print(f"batch {batch}: {rows} changes written", flush=True)

    try:
        while query.isActive and not stop.is_set():
            show_committed()
            query.awaitTermination(1)
        if stop.is_set():
            print("stopping", flush=True)
    finally:
        query.stop()
        spark.stop()
        # What was committed since the last look (all of it, with --available-now), read once
        # Spark has stopped: a micro-batch interrupted by query.stop() may still commit to the
        # sink's log while the stop goes on, and the next run would not report it.
        show_committed()
    if query.exception() is not None:
        print(f"the query failed: {query.exception()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
