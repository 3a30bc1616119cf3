"""Instructions the server spends per request, counted by valgrind's callgrind: the stable way to
compare two builds of the same path on a machine whose throughput moves by tens of percent
between runs. Each load runs twice against a fresh server under callgrind, with two request
counts; the difference of the two totals over the difference of the counts is the cost of one
request, start-up and prefill cancelled out. `--baseline PYTHON` counts an earlier build too (a
virtualenv holding it), load by load.

    apt-get install valgrind tarantool && python bench/instructions_bench.py [--baseline PYTHON]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, ROOT, write_json

sys.path.insert(0, str(ROOT / "tests"))
from tarantool_peer import PASSWORD, USER, USERS, sluice_config  # noqa: E402

# (name, protocol, share of reads, pipeline, connections, the two request counts)
LOADS = [
    ("memcached SET, unpipelined, 4 connections", "memcached", 0.0, 1, 4, (10_000, 30_000)),
    ("memcached 50% GET, pipeline 32, 16 connections", "memcached", 0.5, 32, 16, (50_000, 250_000)),
    ("iproto SELECT, unpipelined, 4 connections", "iproto", 1.0, 1, 4, (5_000, 15_000)),
]
OFF = ["--admin-listen", "", "--tank-listen", "", "--greenstack-listen", ""]


def total(python: str, protocol: str, ratio: float, pipeline: int, connections: int, count: int) -> int:
    """The instructions a fresh server under callgrind executes for start-up, a prefill and
    `count` requests of the load, to its clean stop."""
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        out = work / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", python, "-m", "sluice", "serve"]
        cmd += ["--data-dir", str(work / "data"), "--listen", "127.0.0.1:0", *OFF]
        if protocol == "iproto":
            cmd += ["--config", str(sluice_config(work / "sluice.toml", wal_mode="write"))]
        else:
            cmd += ["--iproto-listen", ""]
        log = work / "log"
        with log.open("w") as f:
            server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)
        deadline = time.monotonic() + 120
        while "sluice ready" not in log.read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sluice did not start under valgrind: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        ready = next(line for line in log.read_text().splitlines() if "sluice ready" in line)
        key = "(iproto " if protocol == "iproto" else "listening on "
        address = ready.split(key)[1].split(")")[0].split(" ")[0]
        load = [sys.executable, "-m", "sluice", "bench", "--server", address, "--protocol", protocol]
        load += ["--get-ratio", str(ratio), "--count", str(count), "--keys", "10000"]
        load += ["--pipeline", str(pipeline), "--connections", str(connections), "--json"]
        if protocol == "iproto":
            load += ["--space", str(USERS.id), "--user", USER, "--password-stdin"]
        r = subprocess.run(load, input=PASSWORD, capture_output=True, text=True, timeout=900)
        server.terminate()
        server.wait(timeout=300)
        if r.returncode != 0 or json.loads(r.stdout)["errors"]:
            raise RuntimeError(f"the load failed: {r.stdout} {r.stderr}")
        m = re.search(r"^totals: (\d+)", out.read_text(), re.M)
        if m is None:
            raise RuntimeError(f"no totals in {out}")
        return int(m.group(1))


def per_request(python: str, load: tuple) -> float:
    _, protocol, ratio, pipeline, connections, (a, b) = load
    ta = total(python, protocol, ratio, pipeline, connections, a)
    tb = total(python, protocol, ratio, pipeline, connections, b)
    return (tb - ta) / (b - a)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", metavar="PYTHON", help="count the sluice of this interpreter too")
    args = ap.parse_args()
    for tool in ("valgrind", "tarantool"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed", file=sys.stderr)
            return 1
    builds = {"this build": sys.executable}
    if args.baseline:
        builds["baseline"] = args.baseline
    results: dict = {"baseline": args.baseline, "loads": {}}
    for load in LOADS:
        results["loads"][load[0]] = {}
        for name, python in builds.items():
            ir = per_request(python, load)
            results["loads"][load[0]][name] = ir
            print(f"{load[0]} | {name}: {ir:,.0f} instructions per request", file=sys.stderr)
    write_json(RESULTS / "instructions.json", results)
    head = "| load | this build |" + (" baseline | this / baseline |" if args.baseline else "")
    rows = [head, "|---|---|" + ("---|---|" if args.baseline else "")]
    for name, per in results["loads"].items():
        row = f"| {name} | {per['this build']:,.0f} |"
        if args.baseline:
            row += f" {per['baseline']:,.0f} | {per['this build'] / per['baseline']:.3f} |"
        rows.append(row)
    flags = f" --baseline {args.baseline}" if args.baseline else ""
    md = (
        "# Instructions per request (callgrind)\n\n"
        f"`python bench/instructions_bench.py{flags}`: the server's instructions per request under "
        "valgrind's callgrind, from two runs of different request counts against fresh servers "
        "(start-up and prefill cancel out); `sluice bench` loads, WAL in `write` mode, iproto with "
        "chap-sha1 AUTH on the tests' `users` space.\n\n" + "\n".join(rows) + "\n"
    )
    (RESULTS / "instructions.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
