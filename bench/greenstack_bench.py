"""Greenstack against the memcached binary protocol on the same sluice server, under the same
load from `sluice bench` (`--protocol greenstack` and `--protocol memcached`), in one run on
this machine. Writes bench/results/greenstack.{json,md,png}.

    python bench/greenstack_bench.py [--duration 5] [--runs 3]

Throughput: one server per run (WAL in `write` mode); each load runs over mcbp and over
Greenstack on it, alternating which goes first: GET/SET mixes, pipelined and not, 16
connections, 100 B values, every key written before measuring. The table gives medians and the
Greenstack/mcbp ratio (above 1: Greenstack is faster).

Head-of-line: an active and its replica (WAL in `fsync` mode) per run; 4 connections, pipeline
8, 90% GET and 10% durable SET (majority, then persist_to_majority). mcbp answers in request
order, so a GET behind a durable SET waits for it, unless the client said HELLO
UnorderedExecution; Greenstack answers each request when it is done. The table gives the GETs'
latency (from the send of their batch to their reply).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import sluice
from _common import RESULTS, SluiceNode, wait_until, write_json, write_paired_bars

PROTOCOLS = ("memcached", "greenstack")


def loads() -> list[tuple[str, float, int]]:
    """(name, share of GETs, pipeline)."""
    return [
        ("90% GET, pipeline 32", 0.9, 32),
        ("50% GET, pipeline 32", 0.5, 32),
        ("90% GET, no pipelining", 0.9, 1),
    ]


#: The head-of-line loads run over mcbp in request order, over mcbp after HELLO
#: UnorderedExecution (as Couchbase's SDKs say it), and over Greenstack.
HOL_VARIANTS = ("memcached", "memcached_unordered", "greenstack")

#: (name, durability level) of the head-of-line loads.
HEAD_OF_LINE = [
    ("90% GET, 10% majority SET", "majority"),
    ("90% GET, 10% persist_to_majority SET", "persist_to_majority"),
]


def replica_follows(address: str) -> bool:
    """Whether a majority write succeeds on every vbucket (the replica follows them all)."""
    with sluice.Client(address) as c:
        try:
            for vb in range(64):
                key = next(
                    f"probe-{i}".encode()
                    for i in range(10_000)
                    if sluice.vbucket_of(f"probe-{i}".encode(), 64) == vb
                )
                c.set(key, b"x", durability="majority")
        except sluice.DurabilityImpossibleError:
            return False
    return True


def head_of_line(args: argparse.Namespace, run: int, results: dict) -> None:
    """The head-of-line loads on an active with a replica, over both protocols."""
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "sluice.toml"
        config.write_text('[wal]\nmode = "fsync"\n[snapshot]\ninterval = 0\n')
        active = SluiceNode(Path(d) / "active", config)
        replica = SluiceNode(Path(d) / "replica", config, replica_of=active.address)
        addresses = {
            "memcached": active.address,
            "greenstack": active.ready_line.split("(Greenstack ")[1].split(")")[0],
        }
        addresses["memcached_unordered"] = active.address
        try:
            wait_until(lambda: replica_follows(active.address), 60, "the replica to follow every vbucket")
            for name, level in HEAD_OF_LINE:
                for variant in HOL_VARIANTS if run % 2 == 0 else HOL_VARIANTS[::-1]:
                    protocol = "memcached" if variant == "memcached_unordered" else variant
                    r = sluice._native.bench(
                        addresses[variant],
                        protocol=protocol,
                        unordered=variant == "memcached_unordered",
                        connections=4,
                        pipeline=8,
                        duration=args.duration,
                        keys=10_000,
                        value_size=100,
                        get_ratio=0.9,
                        threads=2,
                        durability=level,
                    )
                    if r["errors"]:
                        raise RuntimeError(
                            f"{name} | {variant}: {r['errors']} requests failed, the first with "
                            f"status {r['first_error_status']:#06x}"
                        )
                    results["head_of_line"][name][variant].append(r)
                    print(
                        f"{name} | {variant} run {run + 1}: {r['ops_per_s']:,.0f} ops/s, GET p50 "
                        f"{r['read_latency_us']['p50']} us, p99 {r['read_latency_us']['p99']} us",
                        file=sys.stderr,
                    )
        finally:
            replica.stop()
            active.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--keys", type=int, default=100_000)
    args = ap.parse_args()
    results: dict = {
        "duration": args.duration,
        "runs": args.runs,
        "connections": args.connections,
        "keys": args.keys,
        "loads": {name: {p: [] for p in PROTOCOLS} for name, _, _ in loads()},
        "head_of_line": {name: {p: [] for p in HOL_VARIANTS} for name, _ in HEAD_OF_LINE},
    }
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as d:
            config = Path(d) / "sluice.toml"
            config.write_text('[wal]\nmode = "write"\n[snapshot]\ninterval = 0\n')
            node = SluiceNode(Path(d) / "data", config)
            addresses = {
                "memcached": node.address,
                "greenstack": node.ready_line.split("(Greenstack ")[1].split(")")[0],
            }
            try:
                for name, ratio, pipeline in loads():
                    for protocol in PROTOCOLS if run % 2 == 0 else PROTOCOLS[::-1]:
                        r = sluice._native.bench(
                            addresses[protocol],
                            protocol=protocol,
                            connections=args.connections,
                            pipeline=pipeline,
                            duration=args.duration,
                            keys=args.keys,
                            value_size=100,
                            get_ratio=ratio,
                            threads=2,
                        )
                        if r["errors"]:
                            raise RuntimeError(f"{name} | {protocol}: {r['errors']} requests failed")
                        results["loads"][name][protocol].append(r)
                        print(
                            f"{name} | {protocol} run {run + 1}: {r['ops_per_s']:,.0f} ops/s, "
                            f"p50 {r['latency_us']['p50']} us, p99 {r['latency_us']['p99']} us",
                            file=sys.stderr,
                        )
            finally:
                node.stop()
        head_of_line(args, run, results)
    write(results)
    return 0


def write(results: dict) -> None:
    write_json(RESULTS / "greenstack.json", results)
    rows = [
        "| load | mcbp ops/s | Greenstack ops/s | Greenstack / mcbp | median of each run's ratio "
        "| mcbp p50 / p99 (us) | Greenstack p50 / p99 (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    names, medians = [], []
    for name, per in results["loads"].items():
        m = statistics.median(r["ops_per_s"] for r in per["memcached"])
        g = statistics.median(r["ops_per_s"] for r in per["greenstack"])
        ml = [statistics.median(r["latency_us"][k] for r in per["memcached"]) for k in ("p50", "p99")]
        gl = [statistics.median(r["latency_us"][k] for r in per["greenstack"]) for k in ("p50", "p99")]
        # Each run measures both protocols back to back: its own ratio is spared what
        # another tenant of the machine did to a whole run.
        paired = statistics.median(
            gr["ops_per_s"] / mr["ops_per_s"]
            for mr, gr in zip(per["memcached"], per["greenstack"], strict=True)
        )
        rows.append(
            f"| {name} | {m:,.0f} | {g:,.0f} | {g / m:.2f} | {paired:.2f} | {ml[0]:,.0f} / {ml[1]:,.0f} | "
            f"{gl[0]:,.0f} / {gl[1]:,.0f} |"
        )
        names.append(name)
        medians.append((m, g))
    hol = [
        "| load | GET p50 / p99 (us): mcbp | mcbp, UnorderedExecution | Greenstack "
        "| mcbp p99 / Greenstack p99 |",
        "|---|---|---|---|---|",
    ]
    for name, per in results["head_of_line"].items():
        lat = [
            [statistics.median(r["read_latency_us"][k] for r in per[v]) for k in ("p50", "p99")]
            for v in HOL_VARIANTS
        ]
        cells = " | ".join(f"{p50:,.0f} / {p99:,.0f}" for p50, p99 in lat)
        hol.append(f"| {name} | {cells} | {lat[0][1] / lat[2][1]:.1f} |")
    md = (
        "# Greenstack against the memcached binary protocol on one sluice server\n\n"
        f"`python bench/greenstack_bench.py --duration {results['duration']} --runs {results['runs']}`: "
        f"`sluice bench`, {results['connections']} connections, {results['keys']:,} keys, 100 B "
        'values, WAL `mode = "write"`, medians of the runs on this 2-core machine (the load '
        "generator shares it).\n\n" + "\n".join(rows) + "\n\n"
        "## Head-of-line\n\n"
        'An active and its replica, WAL `mode = "fsync"`; 4 connections x pipeline 8, 10,000 keys, '
        "90% GET and 10% durable SET. The GETs' latency, from the send of their batch to their reply: "
        "over mcbp a GET waits for the durable SETs before it on its connection, unless the client "
        "said HELLO UnorderedExecution; over Greenstack it does not.\n\n" + "\n".join(hol) + "\n"
    )
    (RESULTS / "greenstack.md").write_text(md)
    print(md)
    write_paired_bars(
        RESULTS / "greenstack.png",
        names,
        [(g, m) for m, g in medians],
        ("Greenstack", "mcbp"),
        "Greenstack against mcbp, same server, same load",
    )


if __name__ == "__main__":
    sys.exit(main())
