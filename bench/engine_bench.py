"""Storage engine benchmarks (issue: foundation). Writes bench/results/engine.{json,md,png}.

    python bench/engine_bench.py [--items 1000000] [--runs 5]

- ingest: 1M items (16-byte keys, 100-byte values) through Engine::set_many in batches of
  10,000, natively (rust/sluice-core/examples/ingest.rs) and from Python (EmbeddedEngine.set_many),
  per wal.mode; items/s until the last change is durable.
- memory: resident bytes per item beyond key and value after the ingest (write mode, native).
- eviction: the native write-mode ingest into a bucket with `eviction = "lru"` and a quota of
  64 bytes per item (about a quarter of what the items take, so most are evicted), against the
  write-mode ingest above into the default 1 GiB quota, where nothing is evicted.
  `--eviction-only` runs just these two, alternating, and prints them.
- recovery: `sluice serve` on a data directory of 1M items (a snapshot of 700k, then 300k in
  the WAL), from process start to its ready line.

This machine is shared and noisy: every figure is the median of --runs runs, all runs kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, ROOT, pyplot, write_json

INGEST = ROOT / "target" / "release" / "examples" / "ingest"
TARGETS = {"ingest_write_items_per_s": 2_000_000, "recovery_ready_s": 1.0, "bytes_per_item": 80}


def build_native() -> None:
    print("building the native ingest example ...", file=sys.stderr)
    subprocess.run(
        [
            "cargo",
            "build",
            "--release",
            "-q",
            "-p",
            "sluice-core",
            "--example",
            "ingest",
            "--features",
            "mimalloc",
        ],
        cwd=ROOT,
        check=True,
    )


LRU_QUOTA_PER_ITEM = 64


def native_ingest(items: int, mode: str, lru_quota: int | None = None) -> dict:
    extra = [] if lru_quota is None else [str(lru_quota)]
    with tempfile.TemporaryDirectory(dir=ROOT / "target") as d:
        out = subprocess.run(
            [str(INGEST), d, str(items), mode, "10000", *extra],
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
    r = json.loads(out.stdout)
    r["bytes_per_item"] = (r["rss_after"] - r["rss_before"]) / items - 116
    return r


PY_INGEST = r"""
import json, sys, time, tempfile
import sluice
items, mode = int(sys.argv[1]), sys.argv[2]
with tempfile.TemporaryDirectory() as d:
    eng = sluice.open_engine(data_dir=d, wal__mode=mode, snapshot__interval=0)
    batches = [[(b"k%015d" % (i + j), b"v" * 100) for j in range(10000)] for i in range(0, items, 10000)]
    t = time.perf_counter()
    for b in batches:
        eng.set_many(b)
    if mode != "none":
        eng.set(b"last-write", b"x", durability="persist")
    dt = time.perf_counter() - t
    eng.close()
print(json.dumps({"items": items, "mode": mode, "items_per_s": items / dt}))
"""


def python_ingest(items: int, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PY_INGEST, str(items), mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout)


PREPARE = r"""
import sys, sluice
d, items = sys.argv[1], int(sys.argv[2])
eng = sluice.open_engine(data_dir=d, snapshot__interval=0)
first = int(items * 0.7)
for i in range(0, items, 10000):
    if i == first:
        eng.snapshot()
    eng.set_many([(b"k%015d" % (i + j), b"v" * 100) for j in range(min(10000, items - i))])
eng.close()
"""


def recovery(items: int, runs: int) -> dict:
    d = Path(tempfile.mkdtemp(dir=ROOT / "target"))
    try:
        subprocess.run([sys.executable, "-c", PREPARE, str(d), str(items)], check=True, timeout=600)
        wal_bytes = sum(f.stat().st_size for f in (d / "wal").iterdir())
        snap_bytes = sum(f.stat().st_size for f in (d / "snap").iterdir())
        ready, engine_s = [], []
        for _ in range(runs):
            t = time.perf_counter()
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sluice",
                    "serve",
                    "--data-dir",
                    str(d),
                    "--listen",
                    "127.0.0.1:0",
                    "--admin-listen",
                    "",
                ],
                stderr=subprocess.PIPE,
                text=True,
            )
            line = ""
            assert p.stderr is not None
            deadline = time.time() + 120
            while time.time() < deadline:
                line = p.stderr.readline()
                if "sluice ready" in line or not line:
                    break
            ready.append(time.perf_counter() - t)
            engine_s.append(float(line.split("recovered in ")[1].split(" s")[0]))
            p.terminate()
            p.wait(timeout=60)
        return {
            "items": items,
            "snapshot_bytes": snap_bytes,
            "wal_bytes": wal_bytes,
            "ready_s": ready,
            "engine_recovery_s": engine_s,
            "ready_s_median": statistics.median(ready),
            "engine_recovery_s_median": statistics.median(engine_s),
        }
    finally:
        shutil.rmtree(d, ignore_errors=True)


def eviction_ingest(items: int, runs: int) -> dict:
    quota = items * LRU_QUOTA_PER_ITEM
    out = []
    for i in range(runs):
        out.append(native_ingest(items, "write", lru_quota=quota))
        r = out[-1]
        print(
            f"native write, lru quota {quota:,} run {i + 1}: {r['items_per_s']:,.0f} items/s, "
            f"{r['evictions']:,} evicted, mem_used {r['mem_used']:,}",
            file=sys.stderr,
        )
    return {
        "quota": quota,
        "all": [r["items_per_s"] for r in out],
        "median": median_of(out, "items_per_s"),
        "evictions": median_of(out, "evictions"),
        "runs": out,
    }


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _verdict(value: float, target: float, *, at_least: bool) -> str:
    met = value >= target if at_least else value <= target
    return f"{'≥' if at_least else '≤'} {target:,} | {'yes' if met else 'no'} |"


def write_outputs(res: dict) -> None:
    write_json(RESULTS / "engine.json", res)
    ing = res["ingest"]
    n_items = f"{res['items']:,}"
    rows = [
        "| measure | median | runs | target | met |",
        "|---|---|---|---|---|",
    ]
    for mode in ("write", "fsync", "none"):
        n = ing["native"][mode]
        rows.append(
            f"| ingest {n_items}, wal.mode {mode}, native (items/s) | {n['median']:,.0f} | "
            f"{', '.join(f'{x:,.0f}' for x in n['all'])} | "
            + (
                _verdict(n["median"], TARGETS["ingest_write_items_per_s"], at_least=True)
                if mode == "write"
                else "– | – |"
            )
        )
    for mode in ("write", "fsync"):
        p = ing["python"][mode]
        rows.append(
            f"| ingest {n_items}, wal.mode {mode}, from Python set_many (items/s) | {p['median']:,.0f} | "
            f"{', '.join(f'{x:,.0f}' for x in p['all'])} | – | – |"
        )
    ev, base = res["eviction"], ing["native"]["write"]["median"]
    rows.append(
        f'| ingest {n_items}, wal.mode write, native, `eviction = "lru"` with a {ev["quota"] >> 20} MiB '
        f"quota ({ev['evictions']:,.0f} evicted; {ev['median'] / base:.2f}x the ingest above) (items/s) | "
        f"{ev['median']:,.0f} | {', '.join(f'{x:,.0f}' for x in ev['all'])} | – | – |"
    )
    m = res["memory"]
    rows.append(
        f"| resident bytes per item beyond key and value | {m['median']:.1f} | "
        f"{', '.join(f'{x:.1f}' for x in m['all'])} | ≤ {TARGETS['bytes_per_item']} | "
        f"{'yes' if m['median'] <= TARGETS['bytes_per_item'] else 'no'} |"
    )
    r = res["recovery"]
    rows.append(
        f"| recovery of {n_items} items (snapshot 70% + WAL 30%): `sluice serve` start to ready (s) | "
        f"{r['ready_s_median']:.3f} | {', '.join(f'{x:.3f}' for x in r['ready_s'])} | ≤ 1.0 | "
        f"{'yes' if r['ready_s_median'] <= 1.0 else 'no'} |"
    )
    rows.append(
        f"| … of which the engine's recovery (s) | {r['engine_recovery_s_median']:.3f} | "
        f"{', '.join(f'{x:.3f}' for x in r['engine_recovery_s'])} | – | – |"
    )
    md = (
        f"# Engine benchmarks\n\n`python bench/engine_bench.py --items {res['items']} --runs {res['runs']}` "
        f"on {res['machine']}, {res['date']}.\n\n" + "\n".join(rows) + "\n"
    )
    (RESULTS / "engine.md").write_text(md)
    print(md)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    labels, vals, errs = [], [], []
    for kind in ("native", "python"):
        for mode in ("write", "fsync", "none"):
            if mode in ing[kind]:
                a = ing[kind][mode]["all"]
                labels.append(f"{kind}\n{mode}")
                vals.append(statistics.median(a) / 1e6)
                errs.append(
                    [[statistics.median(a) / 1e6 - min(a) / 1e6], [max(a) / 1e6 - statistics.median(a) / 1e6]]
                )
    ax = axes[0]
    ax.bar(labels, vals, yerr=[[e[0][0] for e in errs], [e[1][0] for e in errs]], color="#4C72B0", capsize=3)
    ax.axhline(2.0, color="red", linestyle="--", label="target (write, native)")
    ax.set_ylabel("million items/s (median, min–max)")
    ax.set_title(f"ingest of {n_items} items")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar(["resident B/item\nbeyond key+value"], [m["median"]], color="#55A868")
    ax.axhline(80, color="red", linestyle="--", label="target")
    ax.set_title("memory per item")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.bar(
        ["start to ready", "engine recovery"],
        [r["ready_s_median"], r["engine_recovery_s_median"]],
        color="#C44E52",
    )
    ax.axhline(1.0, color="red", linestyle="--", label="target")
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"recovery of {n_items} items")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "engine.png", dpi=110)
    print(f"wrote {RESULTS / 'engine.png'}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--eviction-only",
        action="store_true",
        help="only the ingest with and without eviction, alternating; prints them, writes no results",
    )
    args = ap.parse_args()
    build_native()
    if args.eviction_only:
        plain, lru = [], []
        for _ in range(args.runs):
            plain.append(native_ingest(args.items, "write")["items_per_s"])
            lru.append(eviction_ingest(args.items, 1)["median"])
        p, e = statistics.median(plain), statistics.median(lru)
        print(json.dumps({"no_eviction": plain, "lru": lru, "median_ratio": e / p}))
        return 0
    res: dict = {
        "items": args.items,
        "runs": args.runs,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}",
        "ingest": {"native": {}, "python": {}},
    }
    for mode in ("write", "fsync", "none"):
        runs = []
        for i in range(args.runs):
            runs.append(native_ingest(args.items, mode))
            print(f"native {mode} run {i + 1}: {runs[-1]['items_per_s']:,.0f} items/s", file=sys.stderr)
        res["ingest"]["native"][mode] = {
            "all": [r["items_per_s"] for r in runs],
            "median": median_of(runs, "items_per_s"),
            "runs": runs,
        }
        if mode == "write":
            mem = [r["bytes_per_item"] for r in runs]
            res["memory"] = {"all": mem, "median": statistics.median(mem)}
    for mode in ("write", "fsync"):
        runs = [python_ingest(args.items, mode) for _ in range(args.runs)]
        print(f"python {mode}: {[int(r['items_per_s']) for r in runs]}", file=sys.stderr)
        res["ingest"]["python"][mode] = {
            "all": [r["items_per_s"] for r in runs],
            "median": median_of(runs, "items_per_s"),
        }
    res["eviction"] = eviction_ingest(args.items, args.runs)
    res["recovery"] = recovery(args.items, max(3, args.runs))
    write_outputs(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
