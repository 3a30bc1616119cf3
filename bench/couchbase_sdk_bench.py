"""The official Couchbase Python SDK against sluice, and the same script over the plain memcached
binary protocol (python-binary-memcached) against the same server, in one run on this machine.
Writes bench/results/couchbase_sdk.{json,md,png}.

    pip install '.[test,bench]' && python bench/couchbase_sdk_bench.py [--duration 5] [--runs 3]

Each load runs --runs times per client, alternating the order. Both clients run the same Python
loop: --threads threads, each doing one blocking get or upsert after another on 100,000 keys
(1 KiB values). The table gives medians of ops/s and p99 latency, and the server's CPU time per
operation (user + system time of the `sluice serve` process over the run, from /proc): the
figure that shows what the SDK's path (SCRAM, collections-aware keys, JSON datatype, mutation
tokens, cluster map polling) costs the server against a plain memcached binary client.
`sluice bench` (the native pipelined load generator) gives the server's capacity beside them.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import sluice
from _common import RESULTS, cpu_seconds, free_port, percentile, pyplot, wait_port, write_json

KEYS = 100_000
VALUE = os.urandom(1024)
LOADS = [
    # name, share of gets (the rest are upserts)
    ("get, 1 KiB", 1.0),
    ("upsert, 1 KiB", 0.0),
    ("90% get, 1 KiB", 0.9),
]
# get, upsert and close of one client kind
Ops = tuple[Callable[[bytes], object], Callable[[bytes, bytes], object], Callable[[], None]]
CLIENTS = ["couchbase SDK", "memcached binary"]
# Every client logs in as this user (PLAIN for the memcached client and `sluice bench`, the SDK's
# default mechanism, SCRAM-SHA512, for the SDK), as an application against a node with users does.
USER, PASSWORD = "bench", "bench-secret"


def start(data: Path) -> tuple[subprocess.Popen, int]:
    """`sluice serve` on the embedded defaults plus one read-write user."""
    config = data / "bench.toml"
    data.mkdir(parents=True, exist_ok=True)
    keys = sluice.config.user_credentials(PASSWORD, iterations=1000)
    config.write_text(
        f"[users.{USER}]\n"
        + "".join(f'{k} = "{v}"\n' for k, v in keys.items())
        + 'buckets = { default = ["read", "write"] }\n'
    )
    port = free_port()
    cmd = [sys.executable, "-m", "sluice", "serve", "--config", str(config), "--data-dir", str(data / "d")]
    p = subprocess.Popen(
        [*cmd, "--listen", f"127.0.0.1:{port}", "--admin-listen", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_port(port)
    return p, port


def sdk_ops(port: int) -> Ops:
    from datetime import timedelta

    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.options import ClusterOptions
    from couchbase.transcoder import RawBinaryTranscoder

    options = ClusterOptions(
        PasswordAuthenticator(USER, PASSWORD),
        transcoder=RawBinaryTranscoder(),
    )
    cluster = Cluster(f"couchbase://127.0.0.1:{port}", options)
    cluster.wait_until_ready(timedelta(seconds=30))
    coll = cluster.bucket("default").default_collection()
    return (lambda k: coll.get(k.decode())), (lambda k, v: coll.upsert(k.decode(), v)), cluster.close


def memcached_ops(port: int) -> Ops:
    import bmemcached

    local = threading.local()
    clients: list = []

    def client():
        c = getattr(local, "client", None)
        if c is None:
            c = local.client = bmemcached.Client([f"127.0.0.1:{port}"], USER, PASSWORD)
            clients.append(c)
        return c

    def close() -> None:
        for c in clients:
            c.disconnect_all()

    def get(key: bytes) -> bytes:
        value = client().get(key)
        if value is None:  # a miss counts as an error, as the SDK's DocumentNotFoundException does
            raise KeyError(key)
        return value

    return get, (lambda k, v: client().set(k, v)), close


def run_load(client: str, port: int, pid: int, get_share: float, threads: int, duration: float) -> dict:
    """Connects, then runs the loop; the server's CPU time is taken over the loop alone."""
    get, upsert, close = (sdk_ops if client == "couchbase SDK" else memcached_ops)(port)
    try:
        per_thread: list[list[float]] = [[] for _ in range(threads)]
        errors = [0] * threads
        start_at = time.monotonic() + 0.5
        stop_at = start_at + duration

        def work(n: int) -> None:
            rng = random.Random(n)
            lat = per_thread[n]
            while time.monotonic() < start_at:
                time.sleep(0.005)
            while (t0 := time.perf_counter()) and time.monotonic() < stop_at:
                key = b"key:%012d" % rng.randrange(KEYS)  # as sluice bench names them
                try:
                    if rng.random() < get_share:
                        get(key)
                    else:
                        upsert(key, VALUE)
                except Exception as e:
                    errors[n] += 1
                    if errors[n] == 1:
                        print(f"{client}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                lat.append(time.perf_counter() - t0)

        pool = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
        for t in pool:
            t.start()
        while time.monotonic() < start_at:
            time.sleep(0.001)
        cpu0 = cpu_seconds(pid)
        for t in pool:
            t.join(timeout=duration + 120)
        cpu = cpu_seconds(pid) - cpu0
        lat = [x for per in per_thread for x in per]
        return {"ops": len(lat), "errors": sum(errors), "p99_us": percentile(lat, 99) * 1e6, "cpu": cpu}
    finally:
        close()


def one_run(client: str, get_share: float, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d:
        p, port = start(Path(d))
        try:
            filled = sluice._native.bench(  # its prefill writes every key, so gets find items
                f"127.0.0.1:{port}",
                connections=4,
                pipeline=64,
                duration=0.2,
                keys=KEYS,
                value_size=len(VALUE),
                user=USER,
                password=PASSWORD,
            )
            assert filled["errors"] == 0, filled
            if client == "sluice bench":
                cpu0 = cpu_seconds(p.pid)
                r = sluice._native.bench(
                    f"127.0.0.1:{port}",
                    connections=args.threads,
                    pipeline=1,
                    duration=args.duration,
                    keys=KEYS,
                    value_size=len(VALUE),
                    get_ratio=get_share,
                    threads=2,
                    prefill=False,
                    user=USER,
                    password=PASSWORD,
                )
                cpu = cpu_seconds(p.pid) - cpu0
                ops, errors, p99 = r["ops_per_s"] * args.duration, r["errors"], r["latency_us"]["p99"]
            else:
                r = run_load(client, port, p.pid, get_share, args.threads, args.duration)
                ops, errors, p99, cpu = r["ops"], r["errors"], r["p99_us"], r["cpu"]
        finally:
            p.terminate()
            p.wait(timeout=60)
    return {
        "ops_per_s": ops / args.duration,
        "p99_us": p99,
        "errors": errors,
        "server_cpu_us_per_op": cpu / ops * 1e6 if ops else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    kinds = [*CLIENTS, "sluice bench"]
    results: dict = {"duration": args.duration, "runs": args.runs, "threads": args.threads, "loads": {}}
    for name, get_share in LOADS:
        per: dict[str, list[dict]] = {k: [] for k in kinds}
        for run in range(args.runs):
            for kind in kinds if run % 2 == 0 else kinds[::-1]:
                r = one_run(kind, get_share, args)
                per[kind].append(r)
                print(
                    f"{name} | {kind} run {run + 1}: {r['ops_per_s']:,.0f} ops/s, p99 {r['p99_us']:,.0f} us, "
                    f"server {r['server_cpu_us_per_op'] or 0:.1f} us CPU/op, errors {r['errors']}",
                    file=sys.stderr,
                )
        results["loads"][name] = per
    write(results)
    return 0


def write(results: dict) -> None:
    write_json(RESULTS / "couchbase_sdk.json", results)

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs if r[key] is not None)

    rows = [
        "| load | client | ops/s | p99 µs | server CPU µs/op | errors |",
        "|---|---|---|---|---|---|",
    ]
    plotted = []
    for name, per in results["loads"].items():
        for kind, runs in per.items():
            rows.append(
                f"| {name} | {kind} | {median(runs, 'ops_per_s'):,.0f} | {median(runs, 'p99_us'):,.0f} | "
                f"{median(runs, 'server_cpu_us_per_op'):.1f} | {sum(r['errors'] for r in runs)} |"
            )
        plotted.append((name, [median(per[k], "server_cpu_us_per_op") for k in per]))
    md = (
        "# The Couchbase SDK against sluice\n\n"
        f"`python bench/couchbase_sdk_bench.py --duration {results['duration']:g} --runs {results['runs']} "
        f"--threads {results['threads']}`: {results['threads']} Python threads of blocking operations per "
        "client (`sluice bench`: as many connections, no pipelining), medians of the runs; server CPU is "
        "the `sluice serve` process's user + system time per operation.\n\n" + "\n".join(rows) + "\n"
    )
    (RESULTS / "couchbase_sdk.md").write_text(md)
    print(md)
    plt = pyplot()
    if plt is None:
        return
    kinds = list(next(iter(results["loads"].values())))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(kinds)
    for n, kind in enumerate(kinds):
        xs = [i + (n - (len(kinds) - 1) / 2) * width for i in range(len(plotted))]
        ax.bar(xs, [p[1][n] for p in plotted], width, label=kind)
    ax.set_xticks(range(len(plotted)), [p[0] for p in plotted], fontsize=8)
    ax.set_ylabel("server CPU µs per operation (median)")
    ax.set_title("What each client's operations cost sluice's server")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "couchbase_sdk.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
