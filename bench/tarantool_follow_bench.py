"""sluice following a real Tarantool 2.6 (`[tarantool_upstream]`) against a Tarantool 2.6 replica
of the same upstream, in one run on this machine. Writes bench/results/tarantool_follow.{json,md,png}.

    apt-get install tarantool && python bench/tarantool_follow_bench.py [--tuples 1000000] [--runs 3]

- **Catch-up**: the upstream holds --tuples tuples of `users` (tests/tarantool_peer.py: id,
  name, age; 100-byte names). A fresh replica starts and copies them: the Tarantool replica is
  anonymous (`replication_anon = true`, FETCH_SNAPSHOT, as sluice), and is caught up when its
  box.cfg returns; sluice when its /status shows the follower in state `follow` (the copy
  loaded and logged). Both from process start, both with a WAL without fsync per write.
- **Lag**: both replicas attached, a Lua fiber on the upstream REPLACEs at half the rate one
  fiber reaches alone (measured first), for --duration seconds, while the lag each replica
  reports is sampled every 20 ms: Tarantool's `box.info.replication[1].upstream.lag` and
  sluice's `lag_seconds` in /status, both the time from a row's timestamp on the upstream to
  its application on the replica.

Runs alternate which replica goes first; the table gives medians.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import tarantool
from _common import RESULTS, ROOT, SluiceNode, percentile, pyplot, write_json

sys.path.insert(0, str(ROOT / "tests"))
from tarantool_peer import PASSWORD, TARANTOOL, USER, USERS, TarantoolPeer, sluice_config  # noqa: E402

SAMPLE_S = 0.02


def connect(address: str) -> tarantool.Connection:
    host, _, port = address.rpartition(":")
    return tarantool.connect(host, int(port), user=USER, password=PASSWORD)


def preload(peer: TarantoolPeer, tuples: int) -> None:
    conn = connect(peer.address)
    try:
        conn.eval(
            "local n = ... local name = string.rep('x', 100) "
            "for b = 0, n - 1, 10000 do box.begin() "
            "for i = b + 1, math.min(b + 10000, n) do box.space.users:replace{i, name, i % 100} end "
            "box.commit() end",
            (tuples,),
        )
    finally:
        conn.close()


class TarantoolReplica:
    """An anonymous, read-only Tarantool replica of `upstream`, started in `work`."""

    def __init__(self, work: Path, upstream: str) -> None:
        work.mkdir(parents=True)
        ready = work / "listen.addr"
        (work / "init.lua").write_text(
            "box.cfg{\n"
            "    listen = '127.0.0.1:0',\n"
            f"    work_dir = '{work}',\n"
            "    log = 'tarantool.log',\n"
            "    wal_mode = 'write',\n"
            "    memtx_memory = 2048 * 1024 * 1024,\n"
            "    checkpoint_interval = 0,\n"
            f"    replication = {{'{USER}:{PASSWORD}@{upstream}'}},\n"
            "    replication_anon = true,\n"
            "    read_only = true,\n"
            "}\n"
            f"local f = io.open('{ready}.tmp', 'w') f:write(box.info.listen) f:close()\n"
            f"os.rename('{ready}.tmp', '{ready}')\n"
        )
        self.started = time.perf_counter()
        self.out = open(work / "stdout.log", "wb")
        self.proc = subprocess.Popen(
            [TARANTOOL, str(work / "init.lua")], cwd=work, stdout=self.out, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 600
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the Tarantool replica did not start: {(work / 'tarantool.log').read_text()}"
                )
            time.sleep(0.005)
        self.caught_up_s = time.perf_counter() - self.started
        self.address = ready.read_text().strip()
        self.conn = connect(self.address)

    def count(self) -> int:
        return self.conn.eval("return box.space.users:len()").data[0]

    def lag(self) -> float:
        return self.conn.eval("return box.info.replication[1].upstream.lag").data[0]

    def stop(self) -> None:
        if getattr(self, "conn", None) is not None:
            self.conn.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        self.out.close()


class SluiceReplica:
    """`sluice serve` following `upstream` into its `users` space, started in `work`."""

    def __init__(self, work: Path, upstream: str) -> None:
        work.mkdir(parents=True)
        config = sluice_config(work / "sluice.toml", spaces=(USERS,))
        (work / "password").write_text(PASSWORD)
        with config.open("a") as f:
            f.write(
                f'[tarantool_upstream]\naddress = "{upstream}"\nuser = "{USER}"\n'
                f'password_file = "{work / "password"}"\n'
            )
        self.node = SluiceNode(work / "data", config)
        while self.upstream_status()["state"] != "follow":
            if self.node.proc.poll() is not None:
                raise RuntimeError(f"sluice exited: {''.join(self.node.lines)[-3000:]}")
            time.sleep(0.005)
        self.caught_up_s = time.perf_counter() - self.node.spawned
        self.address = self.node.ready_line.split("(iproto ")[1].split(")")[0]
        self.conn = connect(self.address)

    def upstream_status(self) -> dict:
        return self.node.status()["tarantool_upstream"]

    def count(self) -> int:
        return self.conn.call("box.space.users:count").data[0]

    def lag(self) -> float:
        return self.upstream_status()["lag_seconds"]

    def stop(self) -> None:
        self.conn.close()
        self.node.stop()


def single_fiber_rate(peer: TarantoolPeer) -> float:
    """REPLACEs per second one Lua fiber reaches on the upstream in 2 s."""
    conn = connect(peer.address)
    try:
        return conn.eval(
            "local clock = require('clock') local t0 = clock.monotonic() local n = 0 "
            "while clock.monotonic() - t0 < 2 do "
            "box.space.users:replace{1000000000 + n % 1000, 'rate', n % 100} n = n + 1 end "
            "return n / (clock.monotonic() - t0)"
        ).data[0]
    finally:
        conn.close()


def lag_run(peer: TarantoolPeer, replicas: dict, rate: float, duration: float) -> dict[str, list[float]]:
    """Lag samples of each replica while a fiber on the upstream writes at `rate` per second."""
    conn = connect(peer.address)
    writer = threading.Thread(
        target=conn.eval,
        args=(
            "local rate, duration = ... local fiber, clock = require('fiber'), require('clock') "
            "local t0 = clock.monotonic() local n = 0 "
            "while clock.monotonic() - t0 < duration do "
            "local due = math.floor((clock.monotonic() - t0) * rate) "
            "while n < due do box.space.users:replace{2000000000 + n % 100000, 'lag', n % 100} n = n + 1 end "
            "fiber.sleep(0.001) end",
            (rate, duration),
        ),
    )
    samples: dict[str, list[float]] = {k: [] for k in replicas}
    writer.start()
    time.sleep(0.5)  # past the first rows
    end = time.monotonic() + duration - 1.0
    while time.monotonic() < end:
        for kind, r in replicas.items():
            samples[kind].append(r.lag())
        time.sleep(SAMPLE_S)
    writer.join()
    conn.close()
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tuples", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of the lag load")
    args = ap.parse_args()
    if shutil.which("tarantool") is None:
        print("tarantool is not installed: apt-get install tarantool", file=sys.stderr)
        return 1
    kinds = ("sluice", "tarantool")
    results: dict = {"tuples": args.tuples, "runs": args.runs, "duration": args.duration, "per_run": []}
    grant = f"box.schema.user.grant('{USER}', 'replication')"
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        peer = TarantoolPeer(work / "upstream", spaces=(USERS,), extra_lua=grant)
        try:
            t0 = time.perf_counter()
            preload(peer, args.tuples)
            print(
                f"upstream loaded {args.tuples:,} tuples in {time.perf_counter() - t0:.1f} s", file=sys.stderr
            )
            rate = single_fiber_rate(peer)
            results["single_fiber_rate"] = rate
            print(f"one fiber: {rate:,.0f} REPLACE/s; the lag load runs at half", file=sys.stderr)
            for run in range(args.runs):
                replicas: dict = {}
                try:
                    for kind in kinds if run % 2 == 0 else kinds[::-1]:
                        where = work / f"run{run}-{kind}"
                        up = peer.address
                        replicas[kind] = (
                            SluiceReplica(where, up) if kind == "sluice" else TarantoolReplica(where, up)
                        )
                    counts = {k: r.count() for k, r in replicas.items()}
                    samples = lag_run(peer, replicas, rate / 2, args.duration)
                    row = {
                        "catch_up_s": {k: r.caught_up_s for k, r in replicas.items()},
                        "count": counts,
                        "lag_ms": {
                            k: {
                                "p50": percentile(v, 50) * 1e3,
                                "p99": percentile(v, 99) * 1e3,
                                "samples": len(v),
                            }
                            for k, v in samples.items()
                        },
                    }
                finally:
                    for r in replicas.values():
                        r.stop()
                results["per_run"].append(row)
                print(f"run {run + 1}: {row}", file=sys.stderr)
        finally:
            peer.stop()
    write(results)
    return 0


def write(results: dict) -> None:
    write_json(RESULTS / "tarantool_follow.json", results)
    runs = results["per_run"]

    def med(*path: str) -> float:
        values = []
        for r in runs:
            v = r
            for p in path:
                v = v[p]
            values.append(v)
        return statistics.median(values)

    s_up, t_up = med("catch_up_s", "sluice"), med("catch_up_s", "tarantool")
    rows = [
        "| measure | sluice | Tarantool 2.6 replica | ratio (Tarantool / sluice for times) |",
        "|---|---|---|---|",
        f"| catch-up of {results['tuples']:,} tuples, from process start (s) | {s_up:.2f} | {t_up:.2f} | "
        f"{t_up / s_up:.2f} |",
    ]
    for p in ("p50", "p99"):
        s, t = med("lag_ms", "sluice", p), med("lag_ms", "tarantool", p)
        rows.append(
            f"| lag {p} at half the one-fiber write rate (ms) | {s:.2f} | {t:.2f} | {t / s if s else 0:.2f} |"
        )
    md = (
        "# sluice following Tarantool 2.6 against a Tarantool replica\n\n"
        f"`python bench/tarantool_follow_bench.py --tuples {results['tuples']} --runs {results['runs']} "
        f"--duration {results['duration']}`: an upstream Tarantool 2.6 with `users` (100-byte names); "
        "an anonymous Tarantool replica and sluice (`[tarantool_upstream]`) each copy it from process "
        f"start; then both follow a Lua writer at {results['single_fiber_rate'] / 2:,.0f} REPLACE/s "
        "(half one fiber's rate) while their reported lag is sampled every 20 ms. Medians of the "
        "runs on this 2-core machine (upstream, replicas and sampler share it).\n\n" + "\n".join(rows) + "\n"
    )
    (RESULTS / "tarantool_follow.md").write_text(md)
    print(md)
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(["sluice", "Tarantool"], [s_up, t_up], color=["#4C72B0", "#DD8452"])
    a.set_ylabel("seconds (median)")
    a.set_title(f"catch-up of {results['tuples']:,} tuples")
    x = range(2)
    for n, (kind, color) in enumerate([("sluice", "#4C72B0"), ("tarantool", "#DD8452")]):
        b.bar(
            [i + (n - 0.5) * 0.4 for i in x],
            [med("lag_ms", kind, p) for p in ("p50", "p99")],
            0.4,
            label=kind,
            color=color,
        )
    b.set_xticks(list(x), ["lag p50", "lag p99"])
    b.set_ylabel("ms (median of runs)")
    b.set_title("lag at half the one-fiber write rate")
    b.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "tarantool_follow.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
