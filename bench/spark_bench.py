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

Streaming latency: a query from the replica (startingOffsets latest, default trigger: a new
micro-batch as soon as the previous one ends) into a memory sink (foreachBatch collecting the
rows into the driver's memory); --latency-writes keys are SET on the active, one every 50 ms,
each carrying its write time; latency is from the SET's reply to the micro-batch holding the row
reaching the sink. The machine is shared and noisy: figures are medians over --runs runs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
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
    ("sluice_parquet", "sluice -> Parquet write"),
    ("parquet_parquet", "Parquet -> Parquet write"),
]


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

    n = sluice_df().count()  # warms the Python workers up, and checks the rows are all there
    if n < items:
        raise RuntimeError(f"the replica gave {n:,} rows, fewer than the {items:,} loaded")
    sluice_df().write.mode("overwrite").parquet(str(copy))
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
        }
        order = list(jobs) if run % 2 == 0 else list(reversed(jobs))
        r = {name: timed(jobs[name]) for name in order}
        shutil.rmtree(target, ignore_errors=True)
        log(f"  run {run + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.items()))
        out.append(r)
    return out


def streaming_latency(spark, active: str, replica: str, writes: int) -> dict:
    arrived: dict[str, float] = {}
    sent: dict[str, float] = {}

    def sink(df, batch_id: int) -> None:
        keys = [r.key for r in df.filter(df.key.startswith("lat:")).select("key").collect()]
        now = time.perf_counter()
        for k in keys:
            arrived.setdefault(k, now)

    q = (
        spark.readStream.format("sluice")
        .option("nodes", replica)
        .option("startingOffsets", "latest")
        .load()
        .writeStream.foreachBatch(sink)
        .start()
    )
    try:
        time.sleep(5)  # the first micro-batches (planning, workers) are behind us
        conn = Conn("sluice", active)
        try:
            for i in range(writes):
                key = f"lat:{i:06d}"
                if not conn.set(key.encode()):
                    raise RuntimeError("a latency probe SET failed")
                sent[key] = time.perf_counter()
                time.sleep(0.05)
        finally:
            conn.close()
        deadline = time.monotonic() + 60
        while len(arrived) < writes and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        q.stop()
    lat = [(arrived[k] - sent[k]) * 1000 for k in sent if k in arrived]
    return {
        "writes": writes,
        "arrived": len(lat),
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat) if lat else None,
    }


def summarize(runs: list[dict]) -> dict:
    med = {name: median(r[name] for r in runs) for name, _ in MEASURES}
    return {
        "median_s": med,
        "ratio_noop": med["sluice_noop"] / med["parquet_noop"],
        "ratio_parquet_write": med["sluice_parquet"] / med["parquet_parquet"],
        "ratio_count": med["sluice_count"] / med["parquet_count"],
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
        f"(Parquet counts from footers). Target at most {TARGET_RATIO}x: **{met}**.",
        "",
        "| streaming latency, write to row in a memory sink | p50 | p99 | max |",
        "|---|---|---|---|",
    ]
    lat = res["latency"]
    lines.append(
        f"| {lat['arrived']} of {lat['writes']} writes | {lat['p50_ms']:.0f} ms | "
        f"{lat['p99_ms']:.0f} ms | {lat['max_ms']:.0f} ms |"
    )
    (RESULTS / "spark.md").write_text("\n".join(lines) + "\n")
    plot(res)


def plot(res: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    med = res["summary"]["median_s"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    pairs = [
        ("count()", "sluice_count", "parquet_count"),
        ("every row (noop)", "sluice_noop", "parquet_noop"),
        ("Parquet write", "sluice_parquet", "parquet_parquet"),
    ]
    xs = range(len(pairs))
    sluice_s = [med[s] for _, s, _ in pairs]
    parquet_s = [med[p] for _, _, p in pairs]
    ax.bar([x - 0.2 for x in xs], sluice_s, 0.4, label="sluice (replica)", color="#4C72B0")
    ax.bar([x + 0.2 for x in xs], parquet_s, 0.4, label="local Parquet", color="#DD8452")
    ax.set_xticks(list(xs), [label for label, _, _ in pairs])
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"Spark local[2], {res['items']:,} items")
    ax.legend()
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
            .getOrCreate()
        )
        stack.callback(spark.stop)
        spark.sparkContext.setLogLevel("ERROR")
        sluice.spark.register(spark)
        runs = batch_runs(spark, system.replica_addr, args.items, args.runs, work)
        log("streaming latency ...")
        latency = streaming_latency(spark, system.primary_addr, system.replica_addr, args.latency_writes)
        log(f"  {latency}")
        res = {
            "command": "python bench/spark_bench.py " + " ".join(sys.argv[1:]),
            "machine": f"{platform.machine()}, 2 cores shared",
            "spark": pyspark.__version__,
            "items": args.items,
            "runs": args.runs,
            "batch": runs,
            "latency": latency,
        }
        res["summary"] = summarize(runs)
        write_outputs(res)
        print((RESULTS / "spark.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
