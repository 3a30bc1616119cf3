"""sluice replication against Redis (primary + replica) and Tarantool (master + replica), Debian
packages, same machine, 127.0.0.1 only. Writes bench/results/replication.{json,md,png}.

    apt-get install redis-server tarantool && pip install redis msgpack matplotlib
    python bench/replication_bench.py [--items 1000000] [--runs 3] [--duration 10] [--skip-peers]

Every system runs in fresh processes on fresh temp dirs for each measurement; runs alternate the
order of the systems. All keys are 16 bytes (b"key:%012d"), all values the same 100 bytes of hex
digits (no repeats inside the value, so Redis' LZF finds nothing to compress in the RDB).

1. Catch-up from empty: the primary is loaded with --items items, then the replica is spawned on
   an empty data dir and timed from its spawn until it holds every item (polled every 10 ms):
   sluice by the replica vbuckets' high seqnos (admin /status) summing to the active's; Redis by
   `master_link_status:up` and DBSIZE on the replica; Tarantool by box.space.kv:len() on the
   replica. Loads: sluice by pipelined SETs over 4 connections (raw memcached binary protocol);
   Redis by redis-py pipelines (transaction=False, 10k per batch); Tarantool by a Lua loop in the
   master (box.space.kv:replace, transactions of 1000).
2. Replication lag at half the maximum SET rate: with the replica attached, a loader process
   (raw sockets, 4 connections x 256 pipelined SETs over 100k keys) measures the pair's maximum
   SET rate for --max-rate-duration seconds; then it paces SETs at half that rate (batches per
   10 ms tick) for --duration seconds while a probe thread, every 2 ms, writes a unique key to the
   primary and polls the replica (sluice GET_REPLICA, Redis GET, Tarantool select) every 0.2 ms
   until it appears. Lag: from the write's reply to the first reply that shows it. Polling stops
   2 s after the write (the probe then counts as 2 s, a lower bound); a replica too busy to answer
   a poll for longer gives a lag above 2 s. The achieved rate is what the loader got acked.
3. Majority writes: --clients threads, one write in flight each, raw sockets: sluice SET on a
   bucket with durability = "majority" (active + 1 replica); Redis SET then WAIT 1 1000 (a WAIT
   that returns 0 counts as an error); Tarantool 2.6 replace into an is_sync space with
   replication_synchro_quorum = 2. sluice also runs `sluice bench --get-ratio 0` (16 connections
   x pipeline 32) on the same pair.

Settings: sluice wal.mode = "write", 4 GiB bucket. Redis: --save "" --appendonly no,
repl-diskless-sync yes with repl-diskless-sync-delay 0 on the primary, repl-diskless-load
on-empty-db on the replica (the fastest full sync Redis 7.0 offers). Tarantool: memtx, a hash
primary index, wal_mode write (the default) on both. The machine is shared and noisy (2 cores
for primary, replica and load): figures are medians over --runs runs, every run kept in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import sluice
from _common import RESULTS, log, med, percentile, pyplot, wait_until, write_json
from _load import BG_KEYS, CHUNK, KEY, VALUE, Conn, LoaderProcess
from _systems import SYSTEM_CLASSES, System, peer_problem

SYSTEMS = ("sluice", "redis", "tarantool")
LABELS = {"sluice": "sluice", "redis": "Redis", "tarantool": "Tarantool"}
# A catch-up is abandoned after this long.
CATCHUP_TIMEOUT_S = 600.0
# Probes for the lag test.
PROBE_INTERVAL_S = 0.002
PROBE_POLL_S = 0.0002
PROBE_TIMEOUT_S = 2.0
# Targets.
TARGET_CATCHUP = 1_000_000  # items/s
TARGET_CATCHUP_VS_REDIS = 2.0
TARGET_LAG_P99_MS = 5.0


# ---------------------------------------------------------------------------------------------
# The three measurements.


def measure_catchup(kind: str, items: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"repl-{kind}-") as d, ExitStack() as stack:
        s = SYSTEM_CLASSES[kind](Path(d), stack, items)
        s.start_primary()
        s.load(items)
        spawned = s.start_replica()
        done = wait_until(lambda: s.caught_up(items), CATCHUP_TIMEOUT_S, f"{kind} catch-up")
        seconds = done - spawned
        r = {"items": items, "seconds": seconds, "items_per_s": items / seconds, **s.extra()}
    log(f"  {kind}: catch-up of {items:,} items in {seconds:.2f} s = {r['items_per_s']:,.0f} items/s")
    return r


def sluice_bench(address: str, seconds: float, connections: int = 16, pipeline: int = 32) -> dict:
    cmd = [sys.executable, "-m", "sluice", "bench", "--server", address, "--connections", str(connections)]
    cmd += ["--pipeline", str(pipeline), "--duration", str(seconds), "--keys", str(BG_KEYS)]
    cmd += ["--value-size", str(len(VALUE)), "--get-ratio", "0", "--threads", "2", "--no-prefill", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise RuntimeError(f"sluice bench exited {p.returncode}: {p.stderr[-2000:]}") from e


def probe_lags(s: System, seconds: float) -> dict:
    """Writes a fresh key to the primary every PROBE_INTERVAL_S and polls the replica for it."""
    w, r = Conn(s.kind, s.primary_addr, 10), Conn(s.kind, s.replica_addr, 10)
    lags: list[float] = []
    timeouts = write_errors = 0
    try:
        t_end = time.perf_counter() + seconds
        next_at = time.perf_counter()
        for i in range(int(seconds / PROBE_INTERVAL_S) + 1):
            now = time.perf_counter()
            if now >= t_end:
                break
            if next_at > now:
                time.sleep(next_at - now)
            next_at += PROBE_INTERVAL_S
            key = b"probe:%010d" % i
            if not w.set(key, s.space):
                write_errors += 1
                continue
            acked = time.perf_counter()
            while True:
                if r.replica_has(key, s.space):
                    lags.append((time.perf_counter() - acked) * 1e3)
                    break
                if time.perf_counter() - acked > PROBE_TIMEOUT_S:
                    timeouts += 1
                    break
                time.sleep(PROBE_POLL_S)
    finally:
        w.close()
        r.close()
    counted = lags + [PROBE_TIMEOUT_S * 1e3] * timeouts
    return {
        "probes": len(counted),
        "timeouts": timeouts,
        "write_errors": write_errors,
        "lag_ms_p50": percentile(counted, 50),
        "lag_ms_p90": percentile(counted, 90),
        "lag_ms_p99": percentile(counted, 99),
        "lag_ms_max": max(counted) if counted else float("nan"),
    }


def measure_lag(kind: str, duration: float, max_rate_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"repl-{kind}-") as d, ExitStack() as stack:
        s = SYSTEM_CLASSES[kind](Path(d), stack, BG_KEYS)
        s.start_primary()
        s.start_replica()
        s.settle()
        load = {"kind": kind, "address": s.primary_addr, "space": s.space}
        mx = LoaderProcess(**load, rate=0, seconds=max_rate_s, max_ops=10**9).result()
        if mx["errors"]:
            raise RuntimeError(f"{kind} max-rate load: {mx['errors']} errors")
        out = {"max_set_rate": mx["ops_per_s"], "max_run": mx}
        log(f"  {kind}: max SET rate {mx['ops_per_s']:,.0f}/s (loader, {mx['seconds']:.1f} s)")
        if kind == "sluice":
            nb = sluice_bench(s.primary_addr, max_rate_s)
            out["sluice_bench_max"] = nb
            log(f"  sluice: max SET rate {nb['ops_per_s']:,.0f}/s (sluice bench 16 x 32)")
        s.settle()
        rate = mx["ops_per_s"] / 2
        bg = LoaderProcess(**load, rate=rate, seconds=duration, max_ops=int(rate * duration) + CHUNK)
        probes = probe_lags(s, max(0.5, duration - 0.3))
        bgr = bg.result()
        out.update(probes)
        out.update(
            {
                "target_rate": rate,
                "background_rate": bgr["ops_per_s"],
                "background_errors": bgr["errors"],
                "background_run": bgr,
            }
        )
    log(
        f"  {kind}: background {bgr['ops_per_s']:,.0f}/s (target {rate:,.0f}), lag p50 "
        f"{out['lag_ms_p50']:.2f} ms p99 {out['lag_ms_p99']:.2f} ms over {out['probes']} probes "
        f"({out['timeouts']} timeouts)"
    )
    return out


def durable_clients(s: System, seconds: float, clients: int) -> dict:
    lats: list[list[float]] = [[] for _ in range(clients)]
    errs = [0] * clients
    conns = [Conn(s.kind, s.primary_addr, 30) for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)
    failures: list[str] = []

    def client(i: int) -> None:
        try:
            barrier.wait(30)
            end = time.perf_counter() + seconds
            n = 0
            while n < 5_000_000:
                t = time.perf_counter()
                if t >= end:
                    break
                if s.durable_write(conns[i], b"m%02d-%012d" % (i, n)):
                    lats[i].append((time.perf_counter() - t) * 1e6)
                else:
                    errs[i] += 1
                n += 1
        except Exception as e:  # reported below
            failures.append(f"client {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    try:
        for t in threads:
            t.start()
        barrier.wait(30)
        t0 = time.perf_counter()
        for t in threads:
            t.join(seconds + 60)
        elapsed = time.perf_counter() - t0
    finally:
        for c in conns:
            c.close()
    if failures:
        raise RuntimeError("; ".join(failures[:3]))
    all_lat = [x for per in lats for x in per]
    return {
        "clients": clients,
        "ops": len(all_lat),
        "errors": sum(errs),
        "seconds": elapsed,
        "ops_per_s": len(all_lat) / elapsed,
        "latency_us_p50": percentile(all_lat, 50),
        "latency_us_p99": percentile(all_lat, 99),
        "latency_us_max": max(all_lat) if all_lat else float("nan"),
    }


def measure_majority(kind: str, duration: float, clients: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"repl-{kind}-") as d, ExitStack() as stack:
        s = SYSTEM_CLASSES[kind](Path(d), stack, BG_KEYS, majority=True)
        s.start_primary()
        s.start_replica()
        s.wait_following()
        # Until the replica follows, a durable write fails (sluice: durability impossible; Redis:
        # WAIT returns 0; Tarantool: quorum timeout after 5 s).
        c = Conn(kind, s.primary_addr, 30)
        try:
            wait_until(lambda: s.durable_write(c, b"warm-up"), 120, f"{kind} first durable write", 0.05)
        finally:
            c.close()
        out = durable_clients(s, duration, clients)
        log(
            f"  {kind}: durable writes, {clients} clients: {out['ops_per_s']:,.0f}/s, p50 "
            f"{out['latency_us_p50']:,.0f} us p99 {out['latency_us_p99']:,.0f} us, errors {out['errors']}"
        )
        if kind == "sluice":
            nb = sluice_bench(s.primary_addr, duration)
            out["sluice_bench"] = nb
            log(
                f"  sluice: sluice bench 16 x 32 majority: {nb['ops_per_s']:,.0f}/s, p50 "
                f"{nb['latency_us']['p50']:,} us p99 {nb['latency_us']['p99']:,} us, errors {nb['errors']}"
            )
    return out


# ---------------------------------------------------------------------------------------------
# Output.


def summarize(res: dict) -> dict:
    summary = {}
    for kind, per in res["systems"].items():
        c, lag, maj = per["catchup"], per["lag"], per["majority"]
        summary[kind] = {
            "catchup_items_per_s": med(c, "items_per_s"),
            "catchup_seconds": med(c, "seconds"),
            "replica_ready_after_spawn_s": med(c, "replica_ready_after_spawn_s"),
            "max_set_rate": med(lag, "max_set_rate"),
            "sluice_bench_max": med(lag, "sluice_bench_max", "ops_per_s"),
            "background_rate": med(lag, "background_rate"),
            "target_rate": med(lag, "target_rate"),
            "lag_ms_p50": med(lag, "lag_ms_p50"),
            "lag_ms_p99": med(lag, "lag_ms_p99"),
            "probes": med(lag, "probes"),
            "timeouts": med(lag, "timeouts"),
            "majority_ops_per_s": med(maj, "ops_per_s"),
            "majority_p50_us": med(maj, "latency_us_p50"),
            "majority_p99_us": med(maj, "latency_us_p99"),
            "majority_errors": med(maj, "errors"),
            "bench_majority_ops_per_s": med(maj, "sluice_bench", "ops_per_s"),
            "bench_majority_p50_us": med(maj, "sluice_bench", "latency_us", "p50"),
            "bench_majority_p99_us": med(maj, "sluice_bench", "latency_us", "p99"),
            "failed_runs": {
                t: sum("error" in r for r in per[t]) for t in ("catchup", "lag", "majority") if per[t]
            },
        }
    return summary


def fmt(v: float | None, spec: str = ",.0f", unit: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{unit}"


def write_outputs(res: dict) -> None:
    res["summary"] = sm = summarize(res)
    write_json(RESULTS / "replication.json", res)

    def cell(kind: str, key: str, spec: str = ",.0f", unit: str = "") -> str:
        if kind in res["skipped"]:
            return "skipped"
        return fmt(sm.get(kind, {}).get(key), spec, unit)

    def cells(key: str, spec: str = ",.0f", unit: str = "") -> list[str]:
        return [cell(k, key, spec, unit) for k in SYSTEMS]

    def sluice_only(text: str) -> list[str]:
        return [text] + ["skipped" if k in res["skipped"] else "n/a" for k in SYSTEMS[1:]]

    def line(metric: str, values: list[str], target: str = "", met: str = "") -> str:
        return f"| {metric} | {' | '.join(values)} | {target} | {met} |"

    def yes(ok: bool | None) -> str:
        return "—" if ok is None else ("yes" if ok else "no")

    def share(k: str) -> str:
        if k in res["skipped"]:
            return "skipped"
        got, top = sm.get(k, {}).get("background_rate"), sm.get(k, {}).get("max_set_rate")
        return fmt(got / top * 100 if got and top else None, ".0f", "%")

    s = sm.get("sluice", {})
    cu, cr = s.get("catchup_items_per_s"), sm.get("redis", {}).get("catchup_items_per_s")
    ratio = cu / cr if cu and cr else None
    p99 = s.get("lag_ms_p99")
    items = res["items"]
    bench_lat = f"{fmt(s.get('bench_majority_p50_us'))} / {fmt(s.get('bench_majority_p99_us'))}"
    rows = [
        "| metric | sluice | Redis | Tarantool | target | met? |",
        "|---|---|---|---|---|---|",
        line(
            f"catch-up from empty, {items:,} items (items/s)",
            cells("catchup_items_per_s"),
            f"≥ {TARGET_CATCHUP:,} items/s",
            yes(None if cu is None else cu >= TARGET_CATCHUP),
        ),
        line(
            "catch-up, sluice / Redis",
            sluice_only(fmt(ratio, ".2f", "x")),
            f"≥ {TARGET_CATCHUP_VS_REDIS:.0f}x Redis",
            yes(None if ratio is None else ratio >= TARGET_CATCHUP_VS_REDIS),
        ),
        line("catch-up time (s, replica spawn → all items)", cells("catchup_seconds", ".2f")),
        line("max SET rate with the replica attached (loader, SET/s)", cells("max_set_rate")),
        line("background SET rate achieved (SET/s)", cells("background_rate")),
        line("background rate / max SET rate", [share(k) for k in SYSTEMS], "50%"),
        line("replication lag p50 (ms)", cells("lag_ms_p50", ".2f")),
        line(
            "replication lag p99 (ms)",
            cells("lag_ms_p99", ".2f"),
            f"≤ {TARGET_LAG_P99_MS:.0f} ms (sluice)",
            yes(None if p99 is None else p99 <= TARGET_LAG_P99_MS),
        ),
        line("lag probes", cells("probes")),
        line(f"lag probes not seen within {PROBE_TIMEOUT_S:.0f} s", cells("timeouts")),
        line(f"majority writes, {res['clients']} clients x 1 in flight (ops/s)", cells("majority_ops_per_s")),
        line("majority write latency p50 (µs)", cells("majority_p50_us")),
        line("majority write latency p99 (µs)", cells("majority_p99_us")),
        line("majority writes not acknowledged by the replica", cells("majority_errors")),
        line(
            "sluice bench, majority SETs, 16 conns x pipeline 32 (ops/s)",
            sluice_only(fmt(s.get("bench_majority_ops_per_s"))),
        ),
        line("sluice bench, majority SET latency p50 / p99 (µs)", sluice_only(bench_lat)),
        line(
            "sluice bench, max SET rate with the replica, 16 x 32 (ops/s)",
            sluice_only(fmt(s.get("sluice_bench_max"))),
        ),
    ]
    failed = [
        f"{LABELS[k]} {t}: {n} failed run(s)"
        for k, v in sm.items()
        for t, n in v.get("failed_runs", {}).items()
        if n
    ]
    skipped = [f"{LABELS[k]} skipped: {why}" for k, why in res["skipped"].items()]
    ready = s.get("replica_ready_after_spawn_s")
    notes = [
        f"Catch-up is timed from the replica's spawn; the sluice replica's Python process takes "
        f"{fmt(ready, '.2f')} s of that to get ready."
        if ready is not None
        else "",
        "Lag: probes every 2 ms, replica polled every 0.2 ms; polling stops 2 s after the write "
        "(an unseen probe counts as 2 s, a lower bound), a single slow poll can report more. "
        "Background SETs paced per 10 ms tick by one loader process (4 connections); max SET "
        "rate from the same loader at 4 x 256 in flight, replica attached.",
        f"Majority writes: {res['clients']} Python threads on raw sockets, one write in flight "
        'each: sluice SET on a durability = "majority" bucket, Redis SET + WAIT 1 1000, '
        "Tarantool replace into an is_sync space (replication_synchro_quorum 2).",
        *skipped,
        *failed,
    ]
    md = (
        f"# Replication: sluice against Redis and Tarantool\n\n`{res['command']}` on {res['machine']}, "
        f"{res['date']}; {res['versions']}. Medians of {res['runs']} run(s), every run in "
        "replication.json; primary, replica and load share the machine.\n\n"
        + "\n".join(rows)
        + "\n\n"
        + "\n".join(f"- {n}" for n in notes if n)
        + "\n"
    )
    (RESULTS / "replication.md").write_text(md)
    print(md)
    plot(res, sm)


def plot(res: dict, sm: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    kinds = [k for k in SYSTEMS if k in sm]
    colors = {"sluice": "#4C72B0", "redis": "#DD8452", "tarantool": "#55A868"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))

    def val(k: str, key: str, scale: float = 1) -> float:
        v = sm[k].get(key)
        return 0.0 if v is None else v / scale

    def bars(ax, xs: list[float], vals: list[float], **kw: object) -> None:
        drawn = ax.bar(xs, [v if v > 0 else float("nan") for v in vals], **kw)
        ax.bar_label(drawn, labels=[f"{v:,.3g}" if v > 0 else "" for v in vals], fontsize=7)

    ticks = (range(len(kinds)), [LABELS[k] for k in kinds])
    ax = axes[0]
    bars(
        ax,
        list(ticks[0]),
        [val(k, "catchup_items_per_s", 1e6) for k in kinds],
        color=[colors[k] for k in kinds],
    )
    ax.axhline(TARGET_CATCHUP / 1e6, color="red", linestyle="--", linewidth=1)
    ax.set_xticks(*ticks)
    ax.set_ylabel("million items/s (median)")
    ax.set_title(f"catch-up from empty, {res['items']:,} items", fontsize=10)

    ax = axes[1]
    for j, key in enumerate(("lag_ms_p50", "lag_ms_p99")):
        bars(
            ax,
            [i - 0.2 + 0.4 * j for i in ticks[0]],
            [val(k, key) for k in kinds],
            width=0.4,
            color=[colors[k] for k in kinds],
            alpha=0.55 if j == 0 else 1.0,
        )
    ax.axhline(TARGET_LAG_P99_MS, color="red", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(*ticks)
    ax.set_ylabel("ms, log scale (light: p50, dark: p99)")
    ax.set_title("replication lag at 50% of max SET rate", fontsize=10)

    ax = axes[2]
    bars(
        ax,
        list(ticks[0]),
        [val(k, "majority_ops_per_s", 1e3) for k in kinds],
        color=[colors[k] for k in kinds],
    )
    ax.set_xticks(*ticks)
    ax.set_ylabel("thousand writes/s (median)")
    ax.set_title(f"majority writes, {res['clients']} clients x 1 in flight", fontsize=10)
    fig.suptitle("sluice, Redis and Tarantool replication on one machine (red: sluice target)", fontsize=11)
    fig.tight_layout()
    fig.savefig(RESULTS / "replication.png", dpi=110)
    print(f"wrote {RESULTS / 'replication.png'}", file=sys.stderr)


def versions(kinds: list[str]) -> str:
    out = [f"sluice {getattr(sluice, '__version__', '?')}"]
    for k, cmd in (("redis", ["redis-server", "--version"]), ("tarantool", ["tarantool", "--version"])):
        if k in kinds:
            line = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
            out.append(line.split(" sha=")[0].replace("Redis server v=", "Redis "))
    return ", ".join(out)


def main() -> int:
    global RESULTS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=1_000_000, help="items for the catch-up test")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--duration", type=float, default=10.0, help="seconds of paced load and of majority writes"
    )
    ap.add_argument(
        "--max-rate-duration", type=float, default=3.0, help="seconds to measure the max SET rate"
    )
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients for majority writes")
    ap.add_argument("--skip-peers", action="store_true", help="run sluice only")
    ap.add_argument(
        "--only",
        action="append",
        choices=["catchup", "lag", "majority"],
        help="run only this test (repeatable)",
    )
    ap.add_argument("--results", type=Path, default=RESULTS, help="where replication.{json,md,png} go")
    args = ap.parse_args()
    RESULTS = args.results

    skipped: dict[str, str] = {}
    kinds = ["sluice"]
    for peer in ("redis", "tarantool"):
        why = "--skip-peers" if args.skip_peers else peer_problem(peer)
        if why:
            skipped[peer] = why
            log(f"skipping {LABELS[peer]}: {why}")
        else:
            kinds.append(peer)
    res: dict = {
        "command": " ".join(["python bench/replication_bench.py", *sys.argv[1:]]),
        "items": args.items,
        "runs": args.runs,
        "duration": args.duration,
        "max_rate_duration": args.max_rate_duration,
        "clients": args.clients,
        "key_size": len(KEY % 0),
        "value_size": len(VALUE),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}",
        "versions": versions(kinds),
        "settings": {
            "sluice": 'wal.mode = "write", memory_quota = "4GiB"; majority test: durability = "majority", '
            "replicas = 1; catch-up load: raw pipelined SETs, 4 connections x 512",
            "redis": '--save "" --appendonly no, repl-diskless-sync yes, repl-diskless-sync-delay 0; '
            "replica: repl-diskless-load on-empty-db; load: redis-py pipelines of 10k",
            "tarantool": "memtx, hash primary index, wal_mode write, memtx_memory max(1 GiB, 512 B/item); "
            "majority: is_sync space, replication_synchro_quorum 2, replication_synchro_timeout 5; "
            "load: Lua loop in the master, transactions of 1000",
        },
        "skipped": skipped,
        "systems": {k: {"catchup": [], "lag": [], "majority": []} for k in kinds},
    }
    failures = 0
    tests = (
        ("catchup", lambda k: measure_catchup(k, args.items)),
        ("lag", lambda k: measure_lag(k, args.duration, args.max_rate_duration)),
        ("majority", lambda k: measure_majority(k, args.duration, args.clients)),
    )
    tests = tuple(t for t in tests if not args.only or t[0] in args.only)
    for run in range(args.runs):
        order = kinds if run % 2 == 0 else kinds[::-1]
        for test, fn in tests:
            for kind in order:
                log(f"run {run + 1}/{args.runs}: {test} | {LABELS[kind]}")
                try:
                    r = fn(kind)
                except Exception as e:  # recorded, the other systems still run
                    failures += 1
                    r = {"error": f"{type(e).__name__}: {e}"}
                    log(f"  {kind} {test} FAILED: {r['error'][:2000]}")
                res["systems"][kind][test].append(r)
    write_outputs(res)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
