"""The `sluice` Spark data source against Spark's own Parquet reader, in one Spark session on
the same machine. Writes bench/results/spark.{json,md,png}.

    pip install '.[spark,bench]'
    python bench/spark_bench.py [--items 1000000] [--runs 3] [--latency-writes 200]

A sluice active and its replica (`sluice serve` processes, 127.0.0.1) are loaded with --items
items (16-byte keys, 100-byte values, pipelined SETs) and the replica caught up. Spark runs
local[2] in this process. Each run, in alternating order:

- sluice -> count(): `spark.read.format("sluice")` from the replica, `.count()`.
- sluice -> noop: the same rows materialised whole (`write.format("noop")`).
- sluice -> Parquet: the same rows written to a Parquet directory.
- Parquet -> count(), Parquet -> noop, Parquet -> Parquet: the same rows, read from the local
  Parquet copy that the first sluice -> Parquet run wrote. (Parquet's count() reads only the
  files' footers; the noop and Parquet-write pairs read every column of every row.)

- Python source -> noop, Python source -> Parquet: Spark's floor for any Python data source, in
  the same session: a source (defined here) that reads nothing and yields the same number of
  rows, prebuilt Arrow batches of the same columns and sizes (8,192 rows, as the sluice source
  yields), from as many partitions. What sluice adds is the difference from this floor.

Streaming latency: a query from the replica (startingOffsets latest, default trigger: a new
micro-batch as soon as the previous one ends) into Spark's memory sink, once with the default
reader and once with readOnDriver; --latency-writes keys are SET on the active, one every 50 ms.
A row's arrival is when the micro-batch that holds it finished writing to the sink, from the
query's own progress (the micro-batch's start plus its duration, less its commit to the
checkpoint); latency runs from the SET's reply. The floor again: the same query on a Python
source that reads nothing, whose offsets advance every 50 ms and whose rows carry that time.
The machine is shared and noisy: figures are medians over --runs runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from statistics import median

from _common import RESULTS, log, percentile, pyplot, write_json
from _load import Conn
from _systems import Sluice

TARGET_RATIO = 1.5
MEASURES = [
    ("sluice_count", "sluice -> count()"),
    ("parquet_count", "Parquet -> count()"),
    ("sluice_noop", "sluice -> noop (every row)"),
    ("parquet_noop", "Parquet -> noop (every row)"),
    ("floor_noop", "Python source, no work -> noop"),
    ("sluice_parquet", "sluice -> Parquet write"),
    ("parquet_parquet", "Parquet -> Parquet write"),
    ("floor_parquet", "Python source, no work -> Parquet write"),
]
BATCH_ROWS = 8192  # what the sluice source yields per Arrow batch (Client.stream's batch_size)
LATENCY_MODES = [
    ("default", "sluice, default reader"),
    ("driver", "sluice, readOnDriver"),
    ("floor", "Python source, no work"),
]


def floor_source(items: int, partitions: int):
    """A Python data source that reads nothing: `items` rows of the sluice source's columns
    from `partitions` partitions, one prebuilt Arrow batch yielded again and again; streaming,
    an offset that advances every 50 ms, one row per step carrying its time."""
    import sluice.spark
    from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition

    class Part(InputPartition):
        def __init__(self, first: int, last: int) -> None:
            self.first, self.last = first, last

    class Reader(DataSourceReader):
        def partitions(self):
            return [Part(i, i) for i in range(partitions)]

        def read(self, part):
            import pyarrow as pa

            n = BATCH_ROWS
            ints, longs = pa.array(range(n), pa.int32()), pa.array(range(n), pa.int64())
            cols = [ints, longs, pa.array(["mutation"] * n), pa.array([f"key:{i:012d}" for i in range(n)])]
            cols += [pa.array([b"v" * 100] * n), ints, longs, longs, longs]
            batch = pa.RecordBatch.from_arrays(cols, schema=sluice.spark.arrow_schema())
            rows = items // partitions
            for _ in range(rows // n):
                yield batch
            if rows % n:
                yield batch.slice(0, rows % n)

    class StreamReader(DataSourceStreamReader):
        def __init__(self, origin: float) -> None:
            self.origin = origin

        def initialOffset(self):
            return self.latestOffset()

        def latestOffset(self):
            return {"step": int((time.time() - self.origin) / 0.05)}

        def partitions(self, start, end):
            return [Part(start["step"], end["step"])]

        def read(self, part):
            for step in range(part.first, part.last):
                t = self.origin + (step + 1) * 0.05
                yield (0, step + 1, "mutation", f"step:{t:.6f}", b"", 0, 0, 0, 0)

    origin = time.time()

    class Floor(DataSource):
        @classmethod
        def name(cls):
            return "sluice_bench_floor"

        def schema(self):
            return sluice.spark.SCHEMA

        def reader(self, schema):
            return Reader()

        def streamReader(self, schema):
            return StreamReader(origin)

    return Floor


def timed(action) -> float:
    t = time.perf_counter()
    action()
    return time.perf_counter() - t


def batch_runs(spark, replica: str, items: int, runs: int, work: Path) -> list[dict]:
    copy = work / "copy.parquet"

    def sluice_df():
        return spark.read.format("sluice").option("nodes", replica).load()

    def parquet_df():
        return spark.read.parquet(str(copy))

    def floor_df():
        return spark.read.format("sluice_bench_floor").load()

    n = sluice_df().count()  # warms the Python workers up, and checks the rows are all there
    if n < items:
        raise RuntimeError(f"the replica gave {n:,} rows, fewer than the {items:,} loaded")
    sluice_df().write.mode("overwrite").parquet(str(copy))
    floor_df().write.format("noop").mode("overwrite").save()  # its workers warmed up too
    out = []
    for run in range(runs):
        target = work / f"out{run}"
        jobs = {
            "sluice_count": lambda: sluice_df().count(),
            "sluice_noop": lambda: sluice_df().write.format("noop").mode("overwrite").save(),
            "sluice_parquet": lambda t=target: sluice_df().write.mode("overwrite").parquet(str(t / "s")),
            "parquet_count": lambda: parquet_df().count(),
            "parquet_noop": lambda: parquet_df().write.format("noop").mode("overwrite").save(),
            "parquet_parquet": lambda t=target: parquet_df().write.mode("overwrite").parquet(str(t / "p")),
            "floor_noop": lambda: floor_df().write.format("noop").mode("overwrite").save(),
            "floor_parquet": lambda t=target: floor_df().write.mode("overwrite").parquet(str(t / "f")),
        }
        order = list(jobs) if run % 2 == 0 else list(reversed(jobs))
        r = {name: timed(jobs[name]) for name in order}
        shutil.rmtree(target, ignore_errors=True)
        log(f"  run {run + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.items()))
        out.append(r)
    return out


def arrivals(progress: list[dict]) -> list[tuple[float, dict]]:
    """(when the micro-batch's rows were in the sink, its end offset) for each micro-batch that
    read something, from the query's progress: its start plus its duration less its commit."""
    out = []
    for p in progress:
        src = p["sources"][0] if p["sources"] else {}
        if not p["numInputRows"] or not src.get("endOffset"):
            continue
        start = datetime.strptime(p["timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
        d = p["durationMs"]
        done = start.timestamp() + (d["triggerExecution"] - d.get("commitOffsets", 0)) / 1000
        out.append((done, json.loads(src["endOffset"])))
    return out


def streaming_latency(spark, active: str, replica: str, writes: int, mode: str) -> dict:
    """Write-to-row latency into a memory sink: mode "default" or "driver" (readOnDriver) reads
    the probes SET on the active from the replica; "floor" reads the no-work source."""
    name = f"latency_{mode}"
    reader = spark.readStream
    if mode == "floor":
        reader = reader.format("sluice_bench_floor")
    else:
        reader = reader.format("sluice").option("nodes", replica).option("startingOffsets", "latest")
        reader = reader.option("readOnDriver", str(mode == "driver").lower())
    q = reader.load().writeStream.format("memory").queryName(name).start()
    sent: dict[str, float] = {}
    try:
        time.sleep(5)  # the first micro-batches (planning, workers) are behind us
        if mode == "floor":
            begin = time.time()
            time.sleep(writes * 0.05)
        else:
            conn = Conn("sluice", active)
            try:
                for i in range(writes):
                    key = f"lat:{i:06d}"
                    if not conn.set(key.encode()):
                        raise RuntimeError("a latency probe SET failed")
                    sent[key] = time.time()
                    time.sleep(0.05)
            finally:
                conn.close()
        window_end = time.time()
        table = spark.table(name)
        deadline = time.monotonic() + 60
        while True:
            rows = table.select("key", "vbucket", "seqno").collect()
            if mode == "floor":
                probes = {r.key: r for r in rows if begin < float(r.key[5:]) <= window_end}
                sent = {k: float(k[5:]) for k in probes}
                done = any(float(r.key[5:]) > window_end for r in rows)
            else:
                probes = {r.key: r for r in rows if r.key in sent}
                done = len(probes) == len(sent)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        progress = q.recentProgress
    finally:
        q.stop()
    batches = arrivals(progress)
    lat = []
    for key, row in probes.items():
        done_at = next((t for t, end in batches if _covers(end, row.vbucket, row.seqno, mode)), None)
        if done_at is not None:
            lat.append((done_at - sent[key]) * 1000)
    micro = [p["durationMs"]["triggerExecution"] for p in progress if p["numInputRows"]]
    return {
        "writes": len(sent),
        "arrived": len(lat),
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat) if lat else None,
        "micro_batch_p50_ms": percentile(micro, 50),
    }


def _covers(end: dict, vbucket: int, seqno: int, mode: str) -> bool:
    if mode == "floor":
        return end["step"] >= seqno
    pos = end["vbuckets"].get(str(vbucket))
    return pos is not None and pos["seqno"] >= seqno


def summarize(runs: list[dict], latency: dict[str, list[dict]]) -> dict:
    med = {name: median(r[name] for r in runs) for name, _ in MEASURES}
    lat = {
        mode: {k: median(r[k] for r in rs) for k in ("p50_ms", "p99_ms", "micro_batch_p50_ms")}
        for mode, rs in latency.items()
    }
    return {
        "median_s": med,
        "ratio_noop": med["sluice_noop"] / med["parquet_noop"],
        "ratio_parquet_write": med["sluice_parquet"] / med["parquet_parquet"],
        "ratio_count": med["sluice_count"] / med["parquet_count"],
        "floor_ratio_noop": med["floor_noop"] / med["parquet_noop"],
        "floor_ratio_parquet_write": med["floor_parquet"] / med["parquet_parquet"],
        "latency": lat,
    }


def write_outputs(res: dict) -> None:
    write_json(RESULTS / "spark.json", res)
    sm, items = res["summary"], res["items"]
    lines = [
        f"# sluice Spark data source vs Spark's Parquet reader ({items:,} items)",
        "",
        f"`{res['command']}` on {res['machine']}; Spark {res['spark']} local[2]; "
        f"medians of {res['runs']} runs.",
        "",
        "| measure | seconds | rows/s |",
        "|---|---|---|",
    ]
    for name, label in MEASURES:
        s = sm["median_s"][name]
        lines.append(f"| {label} | {s:.2f} | {items / s:,.0f} |")
    met = "met" if sm["ratio_noop"] <= TARGET_RATIO else "not met"
    lines += [
        "",
        f"sluice / Parquet, every row read (noop): **{sm['ratio_noop']:.2f}x**, Parquet write: "
        f"**{sm['ratio_parquet_write']:.2f}x**, count(): {sm['ratio_count']:.2f}x "
        f"(Parquet counts from footers). Target at most {TARGET_RATIO}x: **{met}**. "
        f"Spark's floor for a Python source that reads nothing, same run: "
        f"{sm['floor_ratio_noop']:.2f}x (noop), {sm['floor_ratio_parquet_write']:.2f}x (Parquet write).",
        "",
        "| streaming, write to row in a memory sink | p50 | p99 | micro-batch p50 |",
        "|---|---|---|---|",
    ]
    for mode, label in LATENCY_MODES:
        lat = sm["latency"][mode]
        p50, p99, micro = lat["p50_ms"], lat["p99_ms"], lat["micro_batch_p50_ms"]
        lines.append(f"| {label} | {p50:.0f} ms | {p99:.0f} ms | {micro:.0f} ms |")
    (RESULTS / "spark.md").write_text("\n".join(lines) + "\n")
    plot(res)


def plot(res: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    med = res["summary"]["median_s"]
    fig, (ax, lx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    groups = [
        ("count()", "sluice_count", "parquet_count", None),
        ("every row (noop)", "sluice_noop", "parquet_noop", "floor_noop"),
        ("Parquet write", "sluice_parquet", "parquet_parquet", "floor_parquet"),
    ]
    bars = [
        ("sluice (replica)", 1, "#4C72B0"),
        ("local Parquet", 2, "#DD8452"),
        ("Python source, no work", 3, "#8C8C8C"),
    ]
    for i, (label, col, color) in enumerate(bars):
        xs = [x + (i - 1) * 0.27 for x, g in enumerate(groups) if g[col]]
        ax.bar(xs, [med[g[col]] for g in groups if g[col]], 0.27, label=label, color=color)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"Spark local[2], {res['items']:,} items")
    ax.legend()
    lat = res["summary"]["latency"]
    labels = [label for _, label in LATENCY_MODES]
    lx.bar(range(len(labels)), [lat[m]["p50_ms"] for m, _ in LATENCY_MODES], color="#4C72B0")
    lx.set_xticks(range(len(labels)), [label.replace(", ", "\n") for label in labels], fontsize=8)
    lx.set_ylabel("write to row, p50 (ms)")
    lx.set_title("streaming into a memory sink")
    fig.tight_layout()
    fig.savefig(RESULTS / "spark.png", dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--latency-writes", type=int, default=200)
    args = p.parse_args()

    import platform

    import pyspark
    import sluice.spark
    from pyspark.sql import SparkSession

    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="sluice-spark-bench-") as tmp:
        work = Path(tmp)
        system = Sluice(work, stack, args.items)
        system.start_primary()
        system.start_replica()
        system.load(args.items)
        system.settle()
        log(f"replica caught up: {args.items:,} items")
        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.memory", "4g")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.streaming.numRecentProgressUpdates", "1000")
            .getOrCreate()
        )
        stack.callback(spark.stop)
        spark.sparkContext.setLogLevel("ERROR")
        sluice.spark.register(spark)
        spark.dataSource.register(floor_source(args.items, spark.sparkContext.defaultParallelism))
        runs = batch_runs(spark, system.replica_addr, args.items, args.runs, work)
        latency: dict[str, list[dict]] = {mode: [] for mode, _ in LATENCY_MODES}
        for run in range(args.runs):
            modes = [m for m, _ in LATENCY_MODES]
            for mode in modes if run % 2 == 0 else reversed(modes):
                r = streaming_latency(
                    spark, system.primary_addr, system.replica_addr, args.latency_writes, mode
                )
                log(f"  streaming latency, {mode}, run {run + 1}: {r}")
                latency[mode].append(r)
        res = {
            "command": "python bench/spark_bench.py " + " ".join(sys.argv[1:]),
            "machine": f"{platform.machine()}, 2 cores shared",
            "spark": pyspark.__version__,
            "items": args.items,
            "runs": args.runs,
            "batch": runs,
            "latency": latency,
        }
        res["summary"] = summarize(runs, latency)
        write_outputs(res)
        print((RESULTS / "spark.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
