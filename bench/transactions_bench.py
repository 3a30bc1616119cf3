"""Couchbase's SDK transactions against sluice: an active with one replica, --threads threads
each committing transactions that move a unit between two of --keys documents, beside the same
threads doing plain durable upserts (majority) in the same run, alternating. Writes
bench/results/transactions.{json,md,png}.

    pip install '.[test,bench]' && python bench/transactions_bench.py [--duration 5] [--runs 3]

A transaction of two documents costs the server about a dozen requests at majority (two
lookups, the ATR set pending, two staged writes, the ATR committed, two unstagings, the ATR
entry removed), each waiting for the replica, so the table gives transactions per second,
upserts per second, and the server's CPU time (active + replica, from /proc) per transaction
and per upsert. Conflicts (two transactions on one document) are rare at 10,000 keys; those the
SDK ends (a CAS mismatch) are counted and retried.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import sluice
from _common import RESULTS, cpu_seconds, free_port, percentile, pyplot, wait_port, write_json

USER, PASSWORD = "bench", "bench-secret"
REPL = "repl"
LOADS = ["transactions (2 documents)", "durable upserts (majority)"]


def start(data: Path, name: str, *extra: str) -> tuple[subprocess.Popen, int]:
    """`sluice serve` on the embedded defaults, with the bench user and a replication user."""
    d = data / name
    d.mkdir(parents=True, exist_ok=True)
    config = d / "bench.toml"
    text = ""
    for user, perms in ((USER, '{ default = ["read", "write"] }'), (REPL, '{ default = ["replication"] }')):
        keys = sluice.config.user_credentials(PASSWORD, iterations=1000)
        text += f"[users.{user}]\n" + "".join(f'{k} = "{v}"\n' for k, v in keys.items())
        text += f"buckets = {perms}\n"
    (d / "repl.pw").write_text(PASSWORD + "\n")
    text += f'[replication]\nuser = "{REPL}"\npassword_file = "{d / "repl.pw"}"\n'
    config.write_text(text)
    port = free_port()
    p = subprocess.Popen(
        [sys.executable, "-m", "sluice", "serve", "--config", str(config), "--data-dir", str(d / "data")]
        + ["--listen", f"127.0.0.1:{port}", "--admin-listen", "", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_port(port)
    return p, port


def connect(port: int):
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.options import ClusterOptions

    cluster = Cluster(f"couchbase://127.0.0.1:{port}", ClusterOptions(PasswordAuthenticator(USER, PASSWORD)))
    cluster.wait_until_ready(timedelta(seconds=30))
    return cluster


def run_load(load: str, args: argparse.Namespace) -> dict:
    from couchbase.durability import DurabilityLevel, ServerDurability
    from couchbase.exceptions import TransactionFailed
    from couchbase.options import UpsertOptions

    with tempfile.TemporaryDirectory() as tmp:
        active, port = start(Path(tmp), "active")
        replica, _ = start(Path(tmp), "replica", "--replica-of", f"127.0.0.1:{port}")
        cluster = None
        try:
            cluster = connect(port)
            coll = cluster.bucket("default").default_collection()
            majority = UpsertOptions(durability=ServerDurability(DurabilityLevel.MAJORITY))
            deadline = time.monotonic() + 60
            while True:  # majority writes succeed once the replica streams every vbucket
                try:
                    coll.upsert("ready", {"ok": True}, majority)
                    break
                except Exception:  # noqa: BLE001 - DurabilityImpossible until then
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            for k in range(args.keys):
                coll.upsert(f"acct:{k}", {"balance": 100})
            done = [0] * args.threads
            retried = [0] * args.threads
            lat: list[list[float]] = [[] for _ in range(args.threads)]
            start_at = time.monotonic() + 0.5
            stop_at = start_at + args.duration

            def work(n: int) -> None:
                rng = random.Random(n)
                while time.monotonic() < start_at:
                    time.sleep(0.005)
                while time.monotonic() < stop_at:
                    a, b = rng.sample(range(args.keys), 2)
                    t0 = time.perf_counter()
                    if load == LOADS[1]:
                        coll.upsert(f"acct:{a}", {"balance": rng.randrange(1000)}, majority)
                    else:

                        def move(ctx, a=a, b=b):
                            x, y = ctx.get(coll, f"acct:{a}"), ctx.get(coll, f"acct:{b}")
                            ctx.replace(x, {"balance": x.content_as[dict]["balance"] - 1})
                            ctx.replace(y, {"balance": y.content_as[dict]["balance"] + 1})

                        try:
                            cluster.transactions.run(move)
                        except TransactionFailed:
                            retried[n] += 1
                            continue
                    lat[n].append(time.perf_counter() - t0)
                    done[n] += 1

            pool = [threading.Thread(target=work, args=(n,)) for n in range(args.threads)]
            for t in pool:
                t.start()
            while time.monotonic() < start_at:
                time.sleep(0.001)
            cpu0 = cpu_seconds(active.pid) + cpu_seconds(replica.pid)
            for t in pool:
                t.join(timeout=args.duration + 120)
            cpu = cpu_seconds(active.pid) + cpu_seconds(replica.pid) - cpu0
            total = sum(done)
            if load == LOADS[0]:
                # Money moved, never made: the balances still add up.
                balances = [coll.get(f"acct:{k}").content_as[dict]["balance"] for k in range(args.keys)]
                assert sum(balances) == 100 * args.keys, sum(balances)
            flat = [x for per in lat for x in per]
            return {
                "per_s": total / args.duration,
                "p99_ms": percentile(flat, 99) * 1e3,
                "server_cpu_ms_each": cpu / total * 1e3 if total else None,
                "retried": sum(retried),
            }
        finally:
            if cluster is not None:
                cluster.close()
            for p in (replica, active):
                p.terminate()
                p.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--keys", type=int, default=10_000)
    args = ap.parse_args()
    results: dict = {"duration": args.duration, "runs": args.runs, "threads": args.threads, "keys": args.keys}
    per: dict[str, list[dict]] = {load: [] for load in LOADS}
    for run in range(args.runs):
        for load in LOADS if run % 2 == 0 else LOADS[::-1]:
            r = run_load(load, args)
            per[load].append(r)
            print(
                f"{load} run {run + 1}: {r['per_s']:,.0f}/s, p99 {r['p99_ms']:.1f} ms, "
                f"{r['server_cpu_ms_each'] or 0:.2f} ms server CPU each, {r['retried']} retried",
                file=sys.stderr,
            )
    results["loads"] = per
    write(results)
    return 0


def write(results: dict) -> None:
    write_json(RESULTS / "transactions.json", results)

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs if r[key] is not None)

    rows = ["| load | per second | p99 ms | server CPU ms each | retried |", "|---|---|---|---|---|"]
    for load, runs in results["loads"].items():
        rows.append(
            f"| {load} | {median(runs, 'per_s'):,.0f} | {median(runs, 'p99_ms'):.1f} | "
            f"{median(runs, 'server_cpu_ms_each'):.2f} | {sum(r['retried'] for r in runs)} |"
        )
    md = (
        "# Couchbase SDK transactions against sluice\n\n"
        f"`python bench/transactions_bench.py --duration {results['duration']:g} --runs {results['runs']} "
        f"--threads {results['threads']} --keys {results['keys']}`: an active with one replica, "
        f"{results['threads']} threads, medians of the runs; server CPU is the two `sluice serve` "
        "processes' user + system time per transaction or upsert.\n\n" + "\n".join(rows) + "\n"
    )
    (RESULTS / "transactions.md").write_text(md)
    print(md)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    loads = list(results["loads"])
    ax.bar(range(len(loads)), [median(results["loads"][k], "per_s") for k in loads])
    ax.set_xticks(range(len(loads)), loads, fontsize=8)
    ax.set_ylabel("per second (median)")
    ax.set_title("Transactions of two documents beside durable upserts, one replica")
    fig.tight_layout()
    fig.savefig(RESULTS / "transactions.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
