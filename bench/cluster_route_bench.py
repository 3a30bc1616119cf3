"""What a cluster's routing costs: the same load sent to the node that owns every key (direct)
and to a node that owns none and sends each request on (routed), alternating, in one run.
Writes bench/results/cluster_route.{json,md,png}.

    pip install '.[test,bench]'
    python bench/cluster_route_bench.py [--duration 5] [--runs 3] [--tank-dir TANK]

Two nodes on etcd (Debian's etcd-server): n2 owns every vbucket and leads every partition; n1
registers in the cluster but is not added to its map, so it owns nothing and routes. Loads:
- iproto: `sluice bench --protocol iproto` (90% SELECT by key, 10% REPLACE), 8 connections with
  16 requests in flight each: n1 forwards every request to n2 over one shared connection.
- memcached text: memcaslap in its default text mode (90% get, 10% set).
- TANK: tank-cli `bm p2b` (produce, Snappy bundles of 1,000 messages) pointed at n1, which
  answers the first produce with the leader's endpoint (0xfc); tank-cli then produces to n2
  itself. Needs --tank-dir (a build of TANK's source, shared/reference/tank-captures).

Routed/direct is the figure: ≥ 0.7 is the target for the router; the TANK redirect costs one
round trip per partition and client, so its ratio should be near 1. On this 2-core machine both
nodes, etcd and the load generator share the cores: a routed request costs the machine two
nodes' work, which a cluster of real machines spreads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, SluiceNode, admin_get, cpu_seconds, log, write_json, write_paired_bars
from cluster_bench import EtcdProcess, cli
from tank_bench import took
from text_bench import memcaslap

SPACE = """[spaces.users]
id = 512
format = [
  { name = "id", type = "unsigned" },
  { name = "name", type = "string" },
  { name = "age", type = "unsigned" },
]
"""


TANK_MESSAGES = 2_000_000


def node_config(path: Path, cluster: str, name: str) -> Path:
    path.write_text(
        SPACE + f'[cluster]\netcd = "{cluster}"\nnode_name = "{name}"\nauto_failover_timeout = 30\n'
    )
    return path


def front(node: SluiceNode, title: str) -> str:
    return node.ready_line.split(f"({title} ")[1].split(")")[0].split(", TLS ")[0]


def iproto_load(address: str, duration: float) -> float:
    r = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "--protocol", "iproto", "--server", address,
         "--duration", str(duration), "--keys", "10000", "--connections", "8", "--pipeline", "16",
         "--threads", "1", "--json"],
        capture_output=True, text=True, timeout=duration + 120,
    )  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"sluice bench failed: {r.stdout}{r.stderr}")
    return float(json.loads(r.stdout)["ops_per_s"])


def text_load(address: str, duration: float) -> float:
    return memcaslap(int(address.rsplit(":", 1)[1]), duration, ["-X", "100", "-c", "8"])


def tank_load(tank_dir: Path, address: str, messages: int) -> float:
    r = subprocess.run(
        [str(tank_dir / "tank-cli"), "-b", address, "-t", "bench", "-p", "0",
         "bm", "p2b", "-c", str(messages), "-s", "100", "-B", "1000"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"tank-cli failed: {r.stdout}{r.stderr}")
    return messages / took(r.stdout + r.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tank-dir", type=Path)
    args = ap.parse_args()
    for tool in ("etcd", "memcaslap"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (etcd-server, libmemcached-tools)", file=sys.stderr)
            return 1
    results: dict = {"duration": args.duration, "runs": args.runs, "loads": {}}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        etcd = EtcdProcess(work / "etcd")
        nodes: dict[str, SluiceNode] = {}
        try:
            # n2 forms the cluster and owns everything; n1 registers but is never added to the
            # map: it holds nothing and routes every request.
            for name in ("n2", "n1"):
                nodes[name] = SluiceNode(work / name, node_config(work / f"{name}.toml", etcd.url, name))
                deadline = time.monotonic() + 30
                while etcd.json("map") is None:
                    assert time.monotonic() < deadline, "no map"
                    time.sleep(0.1)
            log(cli(etcd.url, "status"))
            router, owner = nodes["n1"], nodes["n2"]
            with_tank = args.tank_dir is not None and (args.tank_dir / "tank-cli").exists()
            if with_tank:
                from sluice.tank import TankConnection

                with TankConnection(front(owner, "TANK")) as t:
                    t.create_topic("bench", 1)
                deadline = time.monotonic() + 30
                while "bench" not in (etcd.json("map") or {}).get("topics", {}):
                    assert time.monotonic() < deadline, "the topic was never placed"
                    time.sleep(0.1)
            # (name, the load against a node, how long a run at a rate lasted)
            timed = lambda _rate: args.duration  # noqa: E731
            loads = [
                ("iproto, 90% SELECT", lambda n: iproto_load(front(n, "iproto"), args.duration), timed),
                ("memcached text, 90% get", lambda n: text_load(n.address, args.duration), timed),
            ]
            if with_tank:
                loads.append(
                    (
                        "TANK produce (tank-cli bm p2b)",
                        lambda n: tank_load(args.tank_dir, front(n, "TANK"), TANK_MESSAGES),
                        lambda rate: TANK_MESSAGES / rate,
                    )
                )
            for name, load, seconds in loads:
                per: dict[str, list[float]] = {"direct": [], "routed": []}
                # The nodes' CPU time per request (both nodes: the router's and the owner's).
                cpu: dict[str, list[float]] = {"direct": [], "routed": []}
                for run in range(args.runs):
                    order = [("direct", owner), ("routed", router)]
                    for kind, node in order if run % 2 == 0 else order[::-1]:
                        before = sum(cpu_seconds(n.proc.pid) for n in nodes.values())
                        rate = load(node)
                        used = sum(cpu_seconds(n.proc.pid) for n in nodes.values()) - before
                        per[kind].append(rate)
                        cpu[kind].append(used / (rate * seconds(rate)) * 1e6)
                        log(f"{name} | {kind} run {run + 1}: {rate:,.0f}/s, {cpu[kind][-1]:.2f} µs CPU")
                results["loads"][name] = per
                results.setdefault("cpu_us", {})[name] = cpu
            metrics = admin_get(router.admin, "/metrics")
            results["routed_metrics"] = [
                line for line in metrics.splitlines() if line.startswith("sluice_routed")
            ]
        finally:
            for n in nodes.values():
                n.stop()
            etcd.stop()
    write(results, args)
    return 0


def write(results: dict, args: argparse.Namespace) -> None:
    write_json(RESULTS / "cluster_route.json", results)
    rows = [
        "| load | direct (to the owner) | routed (through another node) | routed / direct "
        "| nodes' CPU per request: direct | routed |",
        "|---|---|---|---|---|---|",
    ]
    names, pairs = [], []
    for name, per in results["loads"].items():
        d, r = statistics.median(per["direct"]), statistics.median(per["routed"])
        cpu = results["cpu_us"][name]
        cd, cr = statistics.median(cpu["direct"]), statistics.median(cpu["routed"])
        rows.append(f"| {name} | {d:,.0f}/s | {r:,.0f}/s | {r / d:.2f} | {cd:.2f} µs | {cr:.2f} µs |")
        names.append(name)
        pairs.append((r, d))
    md = (
        "# A cluster's routing against direct access to the owner\n\n"
        f"`python bench/cluster_route_bench.py --duration {results['duration']:g} --runs {results['runs']}"
        + (" --tank-dir TANK" if args.tank_dir else "")
        + "`: medians of the runs, direct and routed alternating. Two nodes on one etcd: n2 owns "
        "every vbucket and leads every partition, n1 owns nothing and routes. Both nodes, etcd "
        "and the load generator share this machine's 2 cores.\n\n"
        + "\n".join(rows)
        + "\n\nThe router's counters after the run:\n\n```\n"
        + "\n".join(results.get("routed_metrics", []))
        + "\n```\n"
    )
    (RESULTS / "cluster_route.md").write_text(md)
    print(md)
    write_paired_bars(
        RESULTS / "cluster_route.png",
        names,
        pairs,
        ("routed", "direct"),
        "Routed through a node that owns nothing, against direct",
    )


if __name__ == "__main__":
    sys.exit(main())
