"""Streams a bucket's changes from a sluice replica into Parquet files, with a checkpoint.

    pip install 'sluice[spark]'
    python examples/replica_to_parquet.py --nodes 127.0.0.1:11210,127.0.0.1:11211 \
        --out changes/ --checkpoint changes-checkpoint/

Stop it (Ctrl-C) and start it again with the same --checkpoint: it goes on from the last
micro-batch written, with no change written twice and none missing. --available-now writes
what the nodes hold at the start and exits (Trigger.AvailableNow), for a scheduled job.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


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
    shown = -1
    try:
        while query.isActive and not stop.is_set():
            progress = query.lastProgress
            if progress and progress["batchId"] != shown:
                shown = progress["batchId"]
                print(f"batch {shown}: {progress['numInputRows']} changes", flush=True)
            query.awaitTermination(1)
        if stop.is_set():
            print("stopping", flush=True)
    finally:
        query.stop()
        spark.stop()
    if query.exception() is not None:
        print(f"the query failed: {query.exception()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
