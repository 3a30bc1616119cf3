"""sluice's memcached text protocol against memcached's (Debian package), under the same load
from memcaslap (libmemcached-tools) in its default text mode, in one run on this machine.
Writes bench/results/text.{json,md,png}.

    apt-get install memcached libmemcached-tools && python bench/text_bench.py [--duration 5] [--runs 3]

Each load runs --runs times alternating servers; the table gives medians of memcaslap's TPS
and the sluice/memcached ratio. Both servers are started as in server_bench.py (2 threads,
1 GiB); sluice writes its WAL (durability none: each reply waits for the WAL to write it).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import RESULTS, cpu_seconds, write_json, write_paired_bars
from server_bench import start

LOADS = [
    # name, memcaslap arguments (memcaslap's default mix: 90% get, 10% set)
    ("90% get, 100 B, 16 connections", ["-X", "100", "-c", "16"]),
    ("90% get, 1 KiB, 16 connections", ["-X", "1024", "-c", "16"]),
    ("90% get, 100 B, 4 connections", ["-X", "100", "-c", "4"]),
]


def memcaslap(port: int, duration: float, extra: list[str]) -> float:
    """memcaslap's TPS over the run; fails on a non-zero exit."""
    r = subprocess.run(
        ["memcaslap", "-s", f"127.0.0.1:{port}", "-t", f"{int(duration)}s", "-T", "2", *extra],
        capture_output=True,
        text=True,
        timeout=duration + 120,
    )
    out = r.stdout + r.stderr
    m = re.search(r"Run time: \S+ Ops: \d+ TPS: (\d+)", out)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"memcaslap failed ({r.returncode}): {out[-2000:]}")
    return float(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for tool in ("memcached", "memcaslap"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed: apt-get install memcached libmemcached-tools", file=sys.stderr)
            return 1
    kinds = ["sluice", "memcached"]
    results: dict = {"duration": args.duration, "runs": args.runs, "loads": {}, "cpu_us_per_op": {}}
    for name, extra in LOADS:
        per: dict[str, list[float]] = {k: [] for k in kinds}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        for run in range(args.runs):
            for kind in kinds if run % 2 == 0 else kinds[::-1]:
                with tempfile.TemporaryDirectory() as d:
                    p, port = start(kind, Path(d))
                    try:
                        before = cpu_seconds(p.pid)
                        tps = memcaslap(port, args.duration, extra)
                        used = cpu_seconds(p.pid) - before
                    finally:
                        p.terminate()
                        p.wait(timeout=60)
                per[kind].append(tps)
                cpu[kind].append(used / (tps * args.duration) * 1e6)
                print(
                    f"{name} | {kind} run {run + 1}: {tps:,.0f} ops/s, {cpu[kind][-1]:.2f} us CPU/op",
                    file=sys.stderr,
                )
        results["loads"][name] = per
        results["cpu_us_per_op"][name] = cpu
    write(results)
    return 0


def write(results: dict) -> None:
    write_json(RESULTS / "text.json", results)
    rows = [
        "| load | sluice ops/s | memcached ops/s | ratio | sluice CPU/op | memcached CPU/op | CPU ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    names, medians = [], []
    for name, per in results["loads"].items():
        s, m = statistics.median(per["sluice"]), statistics.median(per["memcached"])
        cs, cm = (statistics.median(results["cpu_us_per_op"][name][k]) for k in ("sluice", "memcached"))
        rows.append(
            f"| {name} | {s:,.0f} | {m:,.0f} | {s / m:.2f} | {cs:.2f} µs | {cm:.2f} µs | {cm / cs:.2f} |"
        )
        names.append(name)
        medians.append((s, m))
    md = (
        "# sluice's text protocol against memcached's\n\n"
        f"`python bench/text_bench.py --duration {results['duration']:g} --runs {results['runs']}`: "
        "memcaslap in text mode (2 threads), medians of the runs, both servers on 2 threads on "
        "this 2-core machine (the load generator shares it). CPU/op: the server process's user "
        "and system time over the run per operation served; CPU ratio above 1: sluice spends "
        "less per operation.\n\n" + "\n".join(rows) + "\n"
    )
    (RESULTS / "text.md").write_text(md)
    print(md)
    write_paired_bars(
        RESULTS / "text.png",
        names,
        medians,
        ("sluice", "memcached"),
        "memcached text protocol (memcaslap): sluice against memcached, same load",
    )


if __name__ == "__main__":
    sys.exit(main())
