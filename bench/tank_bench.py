"""sluice's TANK listener against TANK's own broker, under the same commands of TANK's
tank-cli, in one run on this machine. Writes bench/results/tank.{json,md,png}.

    python bench/tank_bench.py --tank-dir /path/to/TANK [--messages 1000000] [--runs 3]

The broker and tank-cli are built from TANK's public source (see
shared/reference/tank-captures/README.md: `make -j2 service cli-tool`). Each run starts a fresh
server of each kind, both up at once, creates a one-partition topic on each, and runs each load
against one and then the other (which goes first alternates from run to run) before the next
load: `bm p2b -c N -s 100 -B 1000` (N × 100 B in bundles of 1,000, Snappy), `bm p2c` (one bundle
produced while a consumer tails: until the consumer has it; the median of 9), `consume -S -d 0`
(every message back), and sluice's Python client (`sluice.tank`) producing N incompressible 100
B messages in plain bundles of 1,000, one request at a time, and reading them back. Last, with
fresh servers, the same client produces those bundles to both in turns of 50 bundles. Then
sluice alone retains `--retained-gib` GiB in one partition: its anonymous memory before and
after, and after kill -9 how soon a restart answers and how much it read to get there. On this
shared machine the rate of a load drifts by tens of percent from minute to minute: figures taken
seconds apart, or turns a few milliseconds long, take what drift there is alike.

There is no plain produce from tank-cli: its `-R` ("do not compress") sets the client's
compression strategy, which TANK's client never reads, so its bundles are Snappy either way
(measured: 5.2 stored bytes per 100 B message with `-R`); plain bundles come from sluice's
client. sluice writes its WAL in `write` mode (a produce is answered once the WAL holds it);
TANK's broker never syncs. The table gives medians of the runs and each sluice/TANK ratio of
throughput (above 1: sluice is faster).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _common import RESULTS, free_port, kill_group, pyplot, write_json

KINDS = ("sluice", "tank")
# `--baseline PYTHON`: the interpreter whose sluice (an earlier build) stands in for TANK.
BASELINE: str | None = None
# Not a throughput: the server's CPU seconds per bundle of the Python client's produce.
SERVER_CPU = "server CPU per bundle produced"
# `bm p2c` round trips per run; the run reports their median.
P2C_ROUNDS = 9
# Bundles the Python client produces to one server before it turns to the other (`interleaved`).
TURN = 50
INTERLEAVED = "Python client, produce random, interleaved"


def seconds(text: str) -> float:
    """tank-cli's durations: 114ms, 0.114s, 850us, 1.2m."""
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if m is None:
        raise ValueError(f"not a tank-cli duration: {text!r}")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[m.group(2)]


def start(
    kind: str, work: Path, tank_dir: Path, address: str | None = None
) -> tuple[subprocess.Popen, str, str]:
    """A server of `kind` with its data under `work` (on `address`, or a free port): the
    process, its TANK address and (sluice's) admin address. sluice's other fronts are off or on
    ports of their own, so nothing else on the machine holds a port it wants."""
    address = address or f"127.0.0.1:{free_port()}"
    admin = f"127.0.0.1:{free_port()}"
    if kind == "sluice" or BASELINE:
        # With --baseline, the second kind is an earlier build of sluice instead of TANK.
        python = BASELINE if kind != "sluice" and BASELINE else sys.executable
        data = work / ("d" if kind == "sluice" else "baseline")
        cmd = [python, "-m", "sluice", "serve", "--data-dir", str(data)]
        cmd += ["--listen", "127.0.0.1:0", "--admin-listen", admin, "--iproto-listen", ""]
        cmd += ["--greenstack-listen", "", "--tank-listen", address]
    else:
        (work / "t").mkdir()
        cmd = [str(tank_dir / "tank"), "-p", str(work / "t"), "-l", address]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            # Short: a probe that hangs is retried until the deadline says the server did not
            # start (once, a probe to a just-started server went unanswered for minutes).
            cli(tank_dir, address, "status", timeout=5)
            return p, address, admin
        except (RuntimeError, subprocess.TimeoutExpired):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind} did not start ({cmd})") from None
            time.sleep(0.1)


def cli(tank_dir: Path, address: str, *args: str, timeout: float = 300) -> str:
    r = subprocess.run(
        [str(tank_dir / "tank-cli"), "-b", address, *args], capture_output=True, text=True, timeout=timeout
    )
    if r.returncode != 0:
        raise RuntimeError(f"tank-cli {' '.join(args)} failed ({r.returncode}): {r.stdout}{r.stderr}")
    return r.stdout + r.stderr


def took(out: str) -> float:
    m = re.search(r"took (\S+)\s*$", out.strip())
    if m is None:
        raise RuntimeError(f"no duration in tank-cli's output: {out[-500:]}")
    return seconds(m.group(1))


def status_field(pid: int, name: str) -> int:
    """A `/proc/PID/status` size in bytes (`VmRSS`, `RssAnon`, ...)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} for {pid}")


def bytes_read(pid: int) -> int:
    """What a process has read with read system calls (`rchar`), page cache hits included."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError(f"no rchar for {pid}")


def retained(tank_dir: Path, gib: int) -> dict[str, float]:
    """sluice alone: `gib` GiB produced into one partition (plain 1 MiB bundles of 1 KiB
    incompressible messages); its anonymous memory before and after; then kill -9 and a
    restart: how long until its TANK listener answers, and what it read meanwhile."""
    from sluice.tank import TankConnection

    message = os.urandom(1 << 10)
    bundle = [message] * 1024
    with tempfile.TemporaryDirectory() as d:
        p, address, _ = start("sluice", Path(d), tank_dir)
        try:
            with TankConnection(address, timeout=60) as t:
                t.create_topic("big", 1)
                before = status_field(p.pid, "RssAnon")
                for _ in range(gib * 1024):
                    t.produce("big", bundle)
                after = status_field(p.pid, "RssAnon")
                last = t.partitions("big")[0][1]
            os.killpg(p.pid, 9)
            p.wait()
            started = time.monotonic()
            p, address, _ = start("sluice", Path(d), tank_dir, address=address)
            ready = time.monotonic() - started
            read = bytes_read(p.pid)
            with TankConnection(address, timeout=60) as t:
                assert t.partitions("big")[0][1] == last, "messages lost across kill -9"
            return {
                "retained GiB": gib,
                "anonymous memory before, MiB": before / 2**20,
                "anonymous memory after, MiB": after / 2**20,
                "restart ready, s": ready,
                "restart read, MiB": read / 2**20,
            }
        finally:
            kill_group(p)


def run_pair(tank_dir: Path, n: int, order: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """One run: a fresh server of each kind, both up at once, and each load run against one and
    then the other (in `order`) before the next load, so that the two figures of a load are
    taken seconds apart. Returns each kind's figures."""
    t = ("-t", "bench")
    p2b = ("bm", "p2b", "-c", str(n), "-s", "100", "-B", "1000")
    p2c = ("bm", "p2c", "-c", "1000", "-s", "100", "-B", "1000")

    def produce(address: str, _pid: int) -> dict[str, float]:
        return {"produce, Snappy": n / took(cli(tank_dir, address, *t, *p2b))}

    def round_trip(address: str, _pid: int) -> dict[str, float]:
        # One round trip is well under a millisecond: the median of several.
        trips = [took(cli(tank_dir, address, *t, *p2c)) for _ in range(P2C_ROUNDS)]
        return {"produce to consume, 1,000": 1 / statistics.median(trips)}

    def consume(address: str, _pid: int) -> dict[str, float]:
        out = cli(tank_dir, address, *t, "consume", "-S", "-d", "0")
        m = re.search(r"([\d,]+) messages consumed in (\S+?),", out)
        if m is None:
            raise RuntimeError(f"no consume figures: {out[-500:]}")
        return {"consume all": int(m.group(1).replace(",", "")) / seconds(m.group(2))}

    def python(address: str, pid: int) -> dict[str, float]:
        return python_client(address, n, pid)

    with tempfile.TemporaryDirectory() as d:
        servers = {}
        try:
            for kind in order:
                servers[kind] = start(kind, Path(d), tank_dir)
            res: dict[str, dict[str, float]] = {kind: {} for kind in order}
            for _p, address, _ in servers.values():
                cli(tank_dir, address, *t, "create_topic", "1")
            for load in (produce, round_trip, consume, python):
                for kind in order:
                    p, address, _ = servers[kind]
                    res[kind].update(load(address, p.pid))
            return res
        finally:
            for p, *_ in servers.values():
                kill_group(p)


def shown(name: str, value: float) -> str:
    """One figure of a run, for the progress lines."""
    if name == SERVER_CPU:
        return f"{name} {value * 1e6:.0f} µs"
    if name.startswith("resident"):
        return f"{name} {value:.1f}"
    return f"{name} {value:,.0f}/s"


def cpu_seconds(pid: int) -> float:
    """The CPU time a process has used, every thread's, user and system."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def python_client(address: str, n: int, server: int) -> dict[str, float]:
    """sluice's Python client (`sluice.tank`) against either: n incompressible 100 B messages
    produced in plain bundles of 1,000 (each acknowledged before the next), then read back; and
    the server's CPU per bundle produced (`server` is its pid)."""
    from sluice.tank import TankConnection

    bundles = random_bundles(n)
    with TankConnection(address, timeout=60) as t:
        t.create_topic("py", 1)
        cpu = cpu_seconds(server)
        started = time.perf_counter()
        for b in bundles:
            t.produce("py", b)
        produced = time.perf_counter() - started
        cpu = cpu_seconds(server) - cpu
        started = time.perf_counter()
        seq, got = 0, 0
        while got < n:
            f = t.consume("py", seq=seq, fetch_size=1 << 20)
            got += len(f.messages)
            seq = f.next_seq
        consumed = time.perf_counter() - started
    return {
        "Python client, produce random": n / produced,
        "Python client, consume all": got / consumed,
        "server CPU per bundle produced": cpu / len(bundles),
    }


def random_bundles(n: int) -> list[list[bytes]]:
    """n incompressible 100 B messages in bundles of 1,000."""
    payload = os.urandom(n * 100)
    return [[payload[i * 100 : (i + 1) * 100] for i in range(b, min(b + 1000, n))] for b in range(0, n, 1000)]


def interleaved(tank_dir: Path, n: int, sluice_first: bool) -> dict[str, float]:
    """The Python client's produce of n messages to each kind, with both servers up at once and
    the client turning from one to the other every TURN bundles (each acknowledged before the
    next), the first of each turn alternating. Returns each kind's mean µs per bundle."""
    from sluice.tank import TankConnection

    bundles = random_bundles(n)
    order = KINDS if sluice_first else KINDS[::-1]
    with tempfile.TemporaryDirectory() as d:
        servers = {k: start(k, Path(d), tank_dir) for k in order}
        try:
            conns = {k: TankConnection(servers[k][1], timeout=60) for k in order}
            spent = dict.fromkeys(KINDS, 0.0)
            for c in conns.values():
                c.create_topic("py", 1)
            for i in range(0, len(bundles), TURN):
                for k in order if (i // TURN) % 2 == 0 else order[::-1]:
                    started = time.perf_counter()
                    for b in bundles[i : i + TURN]:
                        conns[k].produce("py", b)
                    spent[k] += time.perf_counter() - started
            for c in conns.values():
                c.close()
        finally:
            for p, *_ in servers.values():
                kill_group(p)
    return {k: spent[k] / len(bundles) * 1e6 for k in KINDS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tank-dir", type=Path, required=True, help="where TANK's tank and tank-cli were built")
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--retained-gib", type=int, default=3, help="GiB retained for the memory and restart")
    ap.add_argument(
        "--baseline",
        metavar="PYTHON",
        help="compare with the sluice of this interpreter (an earlier build) instead of TANK's broker",
    )
    args = ap.parse_args()
    global BASELINE
    BASELINE = args.baseline
    for tool in ("tank", "tank-cli"):
        if not (args.tank_dir / tool).exists():
            print(
                f"{args.tank_dir / tool} is missing: build TANK (make -j2 service cli-tool)", file=sys.stderr
            )
            return 1
    per: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    for run in range(args.runs):
        pair = run_pair(args.tank_dir, args.messages, KINDS if run % 2 == 0 else KINDS[::-1])
        for kind, r in pair.items():
            per[kind].append(r)
            print(
                f"run {run + 1} {kind}: " + ", ".join(shown(k, v) for k, v in r.items()),
                file=sys.stderr,
            )
    turns = []
    for run in range(args.runs):
        r = interleaved(args.tank_dir, args.messages, run % 2 == 0)
        turns.append(r)
        print(
            f"interleaved {run + 1}: sluice {r['sluice']:.0f} µs per bundle, TANK {r['tank']:.0f} µs "
            f"(sluice / TANK {r['tank'] / r['sluice']:.2f})",
            file=sys.stderr,
        )
    kept = retained(args.tank_dir, args.retained_gib) if not BASELINE else None
    if kept:
        print(f"retained: {kept}", file=sys.stderr)
    results = {
        "messages": args.messages,
        "runs": args.runs,
        "per_run": per,
        "interleaved": turns,
        "retained": kept,
    }
    write(results)
    return 0


def write(results: dict) -> None:
    # With --baseline, "tank" is an earlier build of sluice: the same tables, named for it.
    stem = "tank_vs_baseline" if BASELINE else "tank"
    write_json(RESULTS / f"{stem}.json", results)
    loads = [
        k for k in results["per_run"]["sluice"][0] if k in results["per_run"]["tank"][0] and k != SERVER_CPU
    ]
    rows = [
        "| load | sluice | TANK | sluice / TANK | median of each run's ratio |",
        "|---|---|---|---|---|",
    ]
    medians = []
    for load in loads:
        s = statistics.median(r[load] for r in results["per_run"]["sluice"])
        t = statistics.median(r[load] for r in results["per_run"]["tank"])
        # Each run measures both back to back: its own ratio is spared what another tenant of
        # the machine did to a whole run.
        paired = statistics.median(
            rs[load] / rt[load]
            for rs, rt in zip(results["per_run"]["sluice"], results["per_run"]["tank"], strict=True)
        )
        unit = "round trips/s" if load.startswith("produce to consume") else "messages/s"
        rows.append(f"| {load} | {s:,.0f} {unit} | {t:,.0f} {unit} | {s / t:.2f} | {paired:.2f} |")
        medians.append((load, s, t))
    memory = ""
    if kept := results.get("retained"):
        memory = (
            f"\n{kept['retained GiB']} GiB retained in one partition (plain 1 MiB bundles): sluice's "
            f"anonymous memory {kept['anonymous memory before, MiB']:.0f} MiB before, "
            f"{kept['anonymous memory after, MiB']:.0f} MiB after (target: at most 256 MiB more); "
            f"after kill -9, a restart answers on its TANK listener in {kept['restart ready, s']:.2f} s "
            f"(target: 2 s), having read {kept['restart read, MiB']:.1f} MiB (its WAL's tail and the "
            "segments' indexes and tails, not the retained bytes).\n"
        )
    cpu = ""
    if all(SERVER_CPU in r for k in KINDS for r in results["per_run"][k]):
        per = {k: [r[SERVER_CPU] * 1e6 for r in results["per_run"][k]] for k in KINDS}
        cpu = (
            "\nServer CPU per plain 1,000-message bundle the Python client produced (all the "
            "server's threads; the kernel's own writeback threads not counted): sluice median "
            f"{statistics.median(per['sluice']):.0f} µs, TANK {statistics.median(per['tank']):.0f} µs "
            f"(runs: sluice {', '.join(f'{c:.0f}' for c in per['sluice'])}; "
            f"TANK {', '.join(f'{c:.0f}' for c in per['tank'])}).\n"
        )
    inter = ""
    if results.get("interleaved"):
        us = {k: statistics.median(r[k] for r in results["interleaved"]) for k in KINDS}
        ratios = [r["tank"] / r["sluice"] for r in results["interleaved"]]
        inter = (
            f"\n{INTERLEAVED}: the same bundles produced with a server of each kind up at once, the "
            f"client turning from one to the other every {TURN} bundles: sluice median "
            f"{us['sluice']:.0f} µs per bundle, TANK {us['tank']:.0f} µs, sluice / TANK "
            f"{statistics.median(ratios):.2f} (runs: {', '.join(f'{x:.2f}' for x in ratios)}).\n"
        )
        medians.append((INTERLEAVED, 1 / us["sluice"], 1 / us["tank"]))
    md = (
        (
            f"# sluice's TANK listener against an earlier build of it ({BASELINE}): in the tables "
            "below, 'TANK' is that build\n\n"
            if BASELINE
            else "# sluice's TANK listener against TANK's broker\n\n"
        )
        + f"`python bench/tank_bench.py --tank-dir TANK --messages {results['messages']} "
        f"--runs {results['runs']}`: "
        "the same tank-cli commands against each, 100 B messages in bundles of 1,000 (Snappy: "
        "tank-cli's `-R` does not turn its compression off), then the same from sluice's Python "
        "client with incompressible messages in plain bundles; in each run both servers are up "
        "and each load runs against one and then the other before the next; medians of the runs "
        "on this 2-core machine (the clients share it); sluice's WAL in `write` mode.\n\n"
        + "\n".join(rows)
        + "\n"
        + inter
        + cpu
        + memory
    )
    (RESULTS / f"{stem}.md").write_text(md)
    print(md)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(medians))
    ax.bar(list(x), [m[1] / m[2] for m in medians], 0.5, label="sluice / TANK", color="#4C72B0")
    ax.axhline(1.0, color="#DD8452", linestyle="--", label="TANK")
    ax.set_xticks(list(x), [textwrap.fill(m[0], 18) for m in medians], fontsize=8)
    ax.set_ylabel("throughput ratio (median)")
    ax.set_title("TANK protocol: sluice against TANK's broker, same tank-cli commands")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
