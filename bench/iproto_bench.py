"""sluice against a real Tarantool 2.6 (Debian package) over iproto, under the same load from
`sluice bench --protocol iproto`, in one run on this machine. Writes
bench/results/iproto.{json,md,png}.

    apt-get install tarantool && python bench/iproto_bench.py [--duration 10] [--runs 3]

Both servers declare the same spaces (tests/tarantool_peer.py: `users` id 512, format
id/name/age, primary TREE index on id; Tarantool's is memtx) and write a WAL without fsync per
write (sluice `[wal] mode = "write"`, Tarantool `wal_mode = 'write'`). The load authenticates
with chap-sha1 and runs REPLACEs, then SELECTs by primary key (every key written before
measuring). Each load runs --runs times, alternating which server goes first; the table gives
medians and the sluice/Tarantool ratio.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import sluice
from _common import RESULTS, ROOT, SluiceNode, pyplot, write_json

sys.path.insert(0, str(ROOT / "tests"))
from tarantool_peer import PASSWORD, USER, USERS, TarantoolPeer, sluice_config  # noqa: E402

KINDS = ("sluice", "tarantool")


def loads(value_size: int) -> list[tuple[str, float, int]]:
    """(name, share of SELECTs, pipeline)."""
    return [
        (f"REPLACE, {value_size} B, pipeline 32", 0.0, 32),
        (f"SELECT by key, {value_size} B, pipeline 32", 1.0, 32),
        (f"REPLACE, {value_size} B, no pipelining", 0.0, 1),
        (f"SELECT by key, {value_size} B, no pipelining", 1.0, 1),
    ]


def measure(kind: str, work: Path, args: argparse.Namespace, ratio: float, pipeline: int) -> dict:
    """One run of one load against a fresh server of `kind` (with `--baseline`, the second kind
    is that interpreter's sluice, an earlier build, instead of Tarantool)."""
    if kind == "sluice" or args.baseline:
        python = args.baseline if kind != "sluice" else sys.executable
        config = sluice_config(work / "sluice.toml", wal_mode="write")
        node = SluiceNode(work / "data", config, python=python)
        address = node.ready_line.split("(iproto ")[1].split(")")[0]
        stop = node.stop
    else:
        peer = TarantoolPeer(work / "tarantool", wal_mode="write")
        address, stop = peer.address, peer.stop
    try:
        return sluice._native.bench(
            address,
            protocol="iproto",
            space=USERS.id,
            connections=args.connections,
            pipeline=pipeline,
            duration=args.duration,
            keys=args.keys,
            value_size=args.value_size,
            get_ratio=ratio,
            threads=2,
            user=USER,
            password=PASSWORD,
        )
    finally:
        stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--value-size", type=int, default=100, help="bytes of each tuple's name field")
    ap.add_argument(
        "--baseline",
        metavar="PYTHON",
        help="compare with the sluice of this interpreter (an earlier build) instead of Tarantool",
    )
    args = ap.parse_args()
    if shutil.which("tarantool") is None:
        print("tarantool is not installed: apt-get install tarantool", file=sys.stderr)
        return 1
    results: dict = {
        "baseline": args.baseline,
        "duration": args.duration,
        "runs": args.runs,
        "connections": args.connections,
        "keys": args.keys,
        "value_size": args.value_size,
        "loads": {},
    }
    for name, ratio, pipeline in loads(args.value_size):
        per: dict[str, list] = {k: [] for k in KINDS}
        for run in range(args.runs):
            for kind in KINDS if run % 2 == 0 else KINDS[::-1]:
                with tempfile.TemporaryDirectory() as d:
                    r = measure(kind, Path(d), args, ratio, pipeline)
                if r["errors"]:
                    raise RuntimeError(f"{name} | {kind}: {r['errors']} requests failed")
                per[kind].append(r)
                print(
                    f"{name} | {kind} run {run + 1}: {r['ops_per_s']:,.0f} ops/s, "
                    f"p50 {r['latency_us']['p50']} us, p99 {r['latency_us']['p99']} us",
                    file=sys.stderr,
                )
        results["loads"][name] = per
    write(results)
    return 0


def write(results: dict) -> None:
    # With --baseline the second server is an earlier build of sluice, not Tarantool.
    other, stem = (
        ("earlier build", "iproto_vs_baseline") if results.get("baseline") else ("Tarantool", "iproto")
    )
    write_json(RESULTS / f"{stem}.json", results)
    rows = [
        f"| load | sluice ops/s | {other} ops/s | ratio | sluice p50 / p99 (us) | {other} p50 / p99 (us) |",
        "|---|---|---|---|---|---|",
    ]
    names, medians = [], []
    for name, per in results["loads"].items():
        s = statistics.median(r["ops_per_s"] for r in per["sluice"])
        t = statistics.median(r["ops_per_s"] for r in per["tarantool"])
        sl = [statistics.median(r["latency_us"][k] for r in per["sluice"]) for k in ("p50", "p99")]
        tl = [statistics.median(r["latency_us"][k] for r in per["tarantool"]) for k in ("p50", "p99")]
        rows.append(
            f"| {name} | {s:,.0f} | {t:,.0f} | {s / t:.2f} | {sl[0]:,.0f} / {sl[1]:,.0f} | "
            f"{tl[0]:,.0f} / {tl[1]:,.0f} |"
        )
        names.append(name)
        medians.append((s, t))
    flags = f"--duration {results['duration']} --runs {results['runs']}"
    if results["value_size"] != 100:
        flags += f" --value-size {results['value_size']}"
    if results.get("baseline"):
        flags += f" --baseline {results['baseline']}"
    md = (
        f"# sluice against {other} over iproto\n\n`python bench/iproto_bench.py {flags}`: "
        f"`sluice bench --protocol iproto`, {results['connections']} connections, "
        f"{results['keys']:,} keys, chap-sha1 AUTH, space `users` (memtx TREE primary on "
        'Tarantool), WAL written without fsync per write on both (sluice `[wal] mode = "write"`, '
        "Tarantool `wal_mode = 'write'`), medians of the runs, on this 2-core machine (the load "
        "generator shares it).\n\n" + "\n".join(rows) + "\n"
    )
    (RESULTS / f"{stem}.md").write_text(md)
    print(md)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    x = range(len(names))
    for n, (label, color) in enumerate([("sluice", "#4C72B0"), (other, "#DD8452")]):
        offset = (n - 0.5) * 0.4
        ax.bar([i + offset for i in x], [m[n] / 1e3 for m in medians], 0.4, label=label, color=color)
    ax.set_xticks(list(x), names, fontsize=8)
    ax.set_ylabel("thousand ops/s (median)")
    ax.set_title(f"iproto: sluice against {other}, same load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
