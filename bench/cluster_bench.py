"""A cluster of sluice nodes on etcd under a steady Couchbase SDK writer: throughput of three nodes
against one node on its own (same load generator, same run), the time from a node's kill -9 to
writes accepted again on the new actives of its vbuckets, and a rebalance that adds a node under
load (vbuckets and items per second, the write pause per moved vbucket). Writes
bench/results/cluster.{json,md,png}; the plot is the writer's throughput through the failover
and the rebalance.

    pip install '.[test,bench]' && python bench/cluster_bench.py [--failover-timeout 5] [--runs 3]

Needs etcd (Debian's etcd-server). The writer is the SDK's batched upsert (upsert_multi, 256
keys a batch, 256-byte values) from one thread: map-aware, it follows NOT_MY_VBUCKET and the
map's revisions as an application does. On this 2-core machine every node, etcd and the writer
share the same cores, so three nodes cannot outrun one; the ratio shows what the cluster costs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import sluice
from _common import RESULTS, SluiceNode, admin_get, free_port, log, percentile, pyplot, write_json
from sluice.cluster.etcd import Etcd, parse_cluster_url

USER, PASSWORD = "bench", "bench-secret"
VALUE = "v" * 256  # a JSON string: the SDK's default transcoder
KEYS = 100_000
BATCH = 256
NUM_VBUCKETS = 64


def node_config(path: Path, cluster: str | None, name: str, timeout: float) -> Path:
    keys = sluice.config.user_credentials(PASSWORD, iterations=1000)
    creds = "".join(f'{k} = "{v}"\n' for k, v in keys.items())
    text = f'[users.{USER}]\n{creds}buckets = {{ default = ["read", "write", "replication"] }}\n'
    if cluster:
        (path.parent / "pw").write_text(PASSWORD)
        text += f'[replication]\nuser = "{USER}"\npassword_file = "{path.parent / "pw"}"\n'
        text += f'[cluster]\netcd = "{cluster}"\nnode_name = "{name}"\nauto_failover_timeout = {timeout}\n'
    path.write_text(text)
    return path


class Writer(threading.Thread):
    """Batched SDK upserts over KEYS keys, round and round; each batch's start, end and the
    keys that succeeded are kept."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        from couchbase.auth import PasswordAuthenticator
        from couchbase.cluster import Cluster
        from couchbase.options import ClusterOptions, ClusterTimeoutOptions

        timeouts = ClusterTimeoutOptions(
            kv_timeout=timedelta(seconds=2.5), bootstrap_timeout=timedelta(seconds=20)
        )
        self.cluster = Cluster.connect(
            f"couchbase://{address}",
            ClusterOptions(PasswordAuthenticator(USER, PASSWORD), timeout_options=timeouts),
        )
        self.cluster.wait_until_ready(timedelta(seconds=20))
        self.coll = self.cluster.bucket("default").default_collection()
        self.batches: list[tuple[float, float, list[str]]] = []
        self.failed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            keys = [f"key{(i + j) % KEYS}" for j in range(BATCH)]
            i += BATCH
            started = time.perf_counter()
            try:
                r = self.coll.upsert_multi(dict.fromkeys(keys, VALUE))
                ok = list(r.results)
                self.failed += len(r.exceptions)
            except Exception:  # noqa: BLE001 - a batch the SDK gave up on counts as failed
                ok = []
                self.failed += len(keys)
            self.batches.append((started, time.perf_counter(), ok))

    def finish(self) -> None:
        self.stop.set()
        self.join(timeout=60)
        self.cluster.close()

    def rate(self, since: float, until: float) -> float:
        n = sum(len(ok) for s, e, ok in self.batches if s >= since and e <= until)
        return n / (until - since)


def probe_writes(w: Writer, lost: set[int], marks: dict[str, float]) -> None:
    """From the kill on, one upsert after another to a key of a vbucket the dead node was
    active for, each given 200 ms: when the first succeeds, a write was accepted on the
    vbucket's new active (the batched writer's own ops to the dead node wait out the SDK's
    2.5 s timeout first)."""
    from couchbase.options import UpsertOptions

    key = next(f"probe{i}" for i in range(10_000) if vbucket_of(f"probe{i}") in lost)
    deadline = time.perf_counter() + 60
    while time.perf_counter() < deadline:
        try:
            w.coll.upsert(key, "p", UpsertOptions(timeout=timedelta(milliseconds=200)))
            marks["probe_accepted"] = time.perf_counter()
            return
        except Exception:  # noqa: BLE001 - timeouts and refusals until the failover
            time.sleep(0.01)


def vbucket_of(key: str) -> int:
    return sluice.vbucket_of(key.encode(), NUM_VBUCKETS)


class EtcdProcess:
    def __init__(self, data: Path) -> None:
        self.client, peer = free_port(), free_port()
        self.url = f"etcd://127.0.0.1:{self.client}/bench"
        self.proc = subprocess.Popen(
            ["etcd", "--data-dir", str(data), "--listen-client-urls", f"http://127.0.0.1:{self.client}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
             f"http://127.0.0.1:{peer}", "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.api = Etcd(parse_cluster_url(self.url)[0])
        deadline = time.monotonic() + 30
        while True:
            try:
                self.api.get("/ping")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def json(self, key: str) -> dict | None:
        kv = self.api.get(f"/sluice/bench/{key}")
        return kv.json() if kv else None

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def cli(url: str, *args: str) -> str:
    r = subprocess.run(
        [os.sys.executable, "-m", "sluice", "cluster", *args, "--cluster", url],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"sluice cluster {' '.join(args)}: {r.stdout}{r.stderr}")
    return r.stdout


def wait(pred, timeout: float, what: str) -> float:
    deadline = time.perf_counter() + timeout
    while not pred():
        if time.perf_counter() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)
    return time.perf_counter()


def highs(node: SluiceNode) -> dict[int, int]:
    """A node's high seqno per vbucket of the default bucket."""
    return {v["vbucket"]: v["high_seqno"] for v in node.status()["buckets"][0]["vbuckets"]}


def most_advanced(nodes: list[SluiceNode]) -> dict[int, int]:
    """Per vbucket, the highest high seqno any of `nodes` holds."""
    out: dict[int, int] = {}
    for n in nodes:
        for vb, h in highs(n).items():
            out[vb] = max(out.get(vb, 0), h)
    return out


def replica_items(node: SluiceNode) -> int:
    """What a node's replica streams have applied since it started (`sluice_replica_items_total`)."""
    total = 0
    for line in admin_get(node.admin, "/metrics").splitlines():
        if line.startswith("sluice_replica_items_total"):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def longest_stall(batches: list[tuple[float, float, list[str]]], since: float) -> float:
    """The longest stretch from `since` without a batch of acknowledged writes ending."""
    ends = [since] + sorted(e for s, e, ok in batches if ok and e > since)
    return max(b - a for a, b in zip(ends[:-1], ends[1:], strict=True)) if len(ends) > 1 else float("inf")


def one_node(tmp: Path, seconds: float) -> float:
    node = SluiceNode(tmp / "single", node_config(tmp / "single.toml", None, "single", 0))
    try:
        w = Writer(node.address)
        w.start()
        t0 = time.perf_counter()
        time.sleep(seconds)
        t1 = time.perf_counter()
        w.finish()
        return w.rate(t0 + 1, t1)
    finally:
        node.stop()


def cluster_run(tmp: Path, seconds: float, timeout: float) -> dict:
    etcd = EtcdProcess(tmp / "etcd")
    nodes: dict[str, SluiceNode] = {}
    configs = {n: node_config(tmp / f"{n}.toml", etcd.url, n, timeout) for n in ("n1", "n2", "n3", "n4")}
    try:
        for n in ("n1", "n2", "n3"):
            nodes[n] = SluiceNode(tmp / n, configs[n])
            if n == "n1":
                wait(lambda: etcd.json("map") is not None, 30, "the cluster formed")
        wait(lambda: len(etcd.api.get_prefix("/sluice/bench/nodes/")[0]) == 3, 30, "nodes registered")
        cli(etcd.url, "add", "n2", "n3")
        cli(etcd.url, "rebalance")
        w = Writer(nodes["n1"].address)
        w.start()
        marks: dict[str, float] = {"start": time.perf_counter()}
        time.sleep(seconds)
        before = etcd.json("map")
        lost = {vb for vb, c in enumerate(before["chains"]) if c[0] == "n3"}
        at_kill = most_advanced(list(nodes.values()))
        nodes["n3"].proc.kill()
        nodes["n3"].proc.wait()
        # From the moment it is gone: a batch begun just before may still have reached it.
        marks["kill"] = time.perf_counter()
        probe = threading.Thread(target=probe_writes, args=(w, lost, marks), daemon=True)
        probe.start()
        marks["failed_over"] = wait(lambda: "n3" in etcd.json("map")["failed"], 120, "failover")
        probe.join(timeout=60)

        def accepted_again() -> bool:
            return any(
                s > marks["kill"] and any(vbucket_of(k) in lost for k in ok) for s, _, ok in list(w.batches)
            )

        wait(accepted_again, 60, "writes to the lost vbuckets")
        marks["accepted"] = next(
            e for s, e, ok in w.batches if s > marks["kill"] and any(vbucket_of(k) in lost for k in ok)
        )
        time.sleep(2)
        nodes["n3"] = SluiceNode(tmp / "n3", configs["n3"])
        marks["back"] = wait(lambda: "n3" not in etcd.json("map")["failed"], 60, "n3 taken back")
        # What n3 missed while it was gone: every change since the kill to the vbuckets it holds
        # copies of now; and how long until it holds all of it (full replication again).
        held = {vb for vb, c in enumerate(etcd.json("map")["chains"]) if "n3" in c[1:]}
        at_back = most_advanced([nodes["n1"], nodes["n2"]])
        missed = sum(at_back[vb] - at_kill[vb] for vb in held)
        marks["caught_up"] = wait(
            lambda: all(h >= at_back[vb] for vb, h in highs(nodes["n3"]).items() if vb in held),
            120,
            "n3 caught up",
        )
        recopied = replica_items(nodes["n3"])
        time.sleep(2)
        nodes["n4"] = SluiceNode(tmp / "n4", configs["n4"])
        wait(lambda: len(etcd.api.get_prefix("/sluice/bench/nodes/")[0]) == 4, 30, "n4 registered")
        cli(etcd.url, "add", "n4")
        marks["rebalance"] = time.perf_counter()
        cli(etcd.url, "rebalance")
        marks["rebalanced"] = time.perf_counter()
        reb = etcd.json("rebalance")
        # What the new node holds is what the rebalance copied to it (replicas built, actives moved).
        copied = sum(v["items"] for v in nodes["n4"].status()["buckets"][0]["vbuckets"])
        time.sleep(seconds / 2)
        marks["end"] = time.perf_counter()
        w.finish()
        steady = w.rate(marks["start"] + 1, marks["kill"])
        pauses = reb.get("pauses_ms", [])
        return {
            "steady_ops_s": steady,
            "failover_timeout_s": timeout,
            "kill_to_failover_s": marks["failed_over"] - marks["kill"],
            "kill_to_writes_accepted_s": marks["accepted"] - marks["kill"],
            "kill_to_probe_accepted_s": marks["probe_accepted"] - marks["kill"],
            "longest_stall_s": longest_stall(w.batches, marks["kill"] - 0.001),
            "back_to_caught_up_s": marks["caught_up"] - marks["back"],
            "missed_changes": missed,
            "recopied_items": recopied,
            "lost_vbuckets": len(lost),
            "rebalance_s": marks["rebalanced"] - marks["rebalance"],
            "rebalance_moves": reb.get("total", 0),
            "rebalance_active_moves": len(pauses),
            "rebalance_items": copied,
            "pause_p50_ms": percentile(pauses, 50) if pauses else None,
            "pause_p99_ms": percentile(pauses, 99) if pauses else None,
            "failed_ops": w.failed,
            "timeline": [(s - marks["start"], len(ok)) for s, _, ok in w.batches],
            "marks": {k: v - marks["start"] for k, v in marks.items()},
        }
    finally:
        for n in nodes.values():
            n.stop()
        etcd.stop()


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    c = res["cluster"]
    step = 0.25
    buckets: dict[int, int] = {}
    for t, n in c["timeline"]:
        buckets[int(t / step)] = buckets.get(int(t / step), 0) + n
    xs = list(range(min(buckets), max(buckets) + 1))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([x * step for x in xs], [buckets.get(x, 0) / step for x in xs], lw=1)
    labels = {"kill": "kill -9 n3", "failed_over": "failed over", "back": "n3 back", "rebalance": "add n4"}
    for k, text in labels.items():
        ax.axvline(c["marks"][k], color="grey", ls="--", lw=0.8)
        ax.text(c["marks"][k], ax.get_ylim()[1] * 0.95, text, rotation=90, va="top", fontsize=8)
    ax.axvspan(c["marks"]["rebalance"], c["marks"]["rebalanced"], color="orange", alpha=0.15)
    ax.set_xlabel("seconds")
    ax.set_ylabel("writes/s (SDK upsert_multi)")
    ax.set_title("3-node cluster: a failover, a return, a rebalance adding a node")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--failover-timeout", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if shutil.which("etcd") is None:
        raise SystemExit("cluster_bench: etcd is not installed (apt-get install etcd-server)")
    singles, clusters = [], []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            log(f"run {run + 1}/{args.runs}: one node on its own")
            singles.append(one_node(tmp, args.seconds))
            log(f"run {run + 1}/{args.runs}: three nodes on etcd: steady, kill -9, return, a fourth added")
            clusters.append(cluster_run(tmp, args.seconds, args.failover_timeout))
    # Medians over the runs; the plot is the last run's timeline.
    cluster = dict(clusters[-1])
    for k, v in cluster.items():
        if isinstance(v, (int, float)) and all(c.get(k) is not None for c in clusters):
            cluster[k] = statistics.median(c[k] for c in clusters)
    single = statistics.median(singles)
    ratios = [c["steady_ops_s"] / s for c, s in zip(clusters, singles, strict=True)]
    res = {
        "runs": args.runs,
        "one_node_ops_s": single,
        "cluster": cluster,
        "cluster_vs_one_node": statistics.median(ratios),
        "per_run": [{k: v for k, v in c.items() if k != "timeline"} for c in clusters],
        "one_node_per_run": singles,
    }
    RESULTS.mkdir(exist_ok=True)
    write_json(RESULTS / "cluster.json", res)
    c = cluster
    rows = [
        ("writes/s, one node on its own", f"{single:,.0f}"),
        ("writes/s, 3-node cluster (1 replica)", f"{c['steady_ops_s']:,.0f} ({res['cluster_vs_one_node']:.2f}x)"),  # noqa: E501
        ("auto-failover timeout", f"{c['failover_timeout_s']:.0f} s"),
        ("kill -9 to failover in the map", f"{c['kill_to_failover_s']:.2f} s"),
        ("kill -9 to a write accepted on a new active (probe)", f"{c['kill_to_probe_accepted_s']:.2f} s"),
        ("kill -9 to the batched writer's writes accepted there", f"{c['kill_to_writes_accepted_s']:.2f} s"),
        ("longest stretch without an acknowledged batch", f"{c['longest_stall_s']:.2f} s"),
        ("n3 back to caught up (full replication again)", f"{c['back_to_caught_up_s']:.2f} s"),
        ("  changes n3 missed / items its streams applied",
         f"{c['missed_changes']:,.0f} / {c['recopied_items']:,.0f}"),
        ("rebalance adding a 4th node", f"{c['rebalance_s']:.1f} s, {c['rebalance_moves']} chains changed"),
        ("  vbuckets/s, items/s copied to the new node", f"{c['rebalance_moves'] / c['rebalance_s']:.1f}, "
         f"{c['rebalance_items'] / c['rebalance_s']:,.0f}"),
        ("  write pause per moved active p50 / p99", f"{c['pause_p50_ms']:.1f} / {c['pause_p99_ms']:.1f} ms"),
    ]  # fmt: skip
    md = f"| measure | median of {args.runs} |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)
    (RESULTS / "cluster.md").write_text(md)
    plot(res, RESULTS / "cluster.png")
    print(md)
    print(json.dumps({k: v for k, v in c.items() if k not in ("timeline",)}, indent=1))


if __name__ == "__main__":
    main()
