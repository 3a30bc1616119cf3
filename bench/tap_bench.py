"""TAP stream throughput with SUPPORT_ACK: the native defaults against Python policy plugins,
on one `sluice serve` node, switched by SIGHUP between runs. Writes
bench/results/tap.{json,md,png}.

    pip install '.[bench]'
    python bench/tap_bench.py [--items 3000000] [--runs 11]

The node is loaded with --items items (16-byte keys, 100-byte values, pipelined SETs). Each run
is one TAP DUMP with SUPPORT_ACK (every existing item, then the server closes the stream), read
by a native reader that acknowledges every ACK request (`sluice._native.tap_drain`), so the
reader is never the bottleneck. Five plugin settings, in rotating order within each round:

- native: no plugin; the ACK interval (1000) and window (10000) are the configured defaults.
- ack only, filter only: each of the two plugins below alone.
- python: an AckPolicy (bench/tap_plugins.py:AdaptiveAck, called on every ACK, adapting the
  interval to the round trip) and a StreamFilter (NoTempKeys, called per batch, answering a
  `Prefixes` rule the daemon applies per key).
- python per key: the same AckPolicy and a StreamFilter that looks at every key in Python
  (PerKeyFilter: one action per key as bytes).

Target: the Python plugins (the AckPolicy and prefix-rule StreamFilter together) cost at most 5%
of native throughput. The machine is shared and noisy (one run's native figure moves by 10%
and more): figures are medians over --runs rounds, and each run streams about half a second.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from statistics import median

from _common import RESULTS, SluiceNode, log, pyplot, write_json
from _load import run_load
from sluice import _native

HERE = Path(__file__).resolve().parent
TARGET_COST = 0.05
SUPPORT_ACK, DUMP = 0x10, 0x02
SETTINGS = {
    "native": {},
    "ack_only": {"ack": "tap_plugins:AdaptiveAck"},
    "filter_only": {"filter": "tap_plugins:NoTempKeys"},
    "python": {"ack": "tap_plugins:AdaptiveAck", "filter": "tap_plugins:NoTempKeys"},
    "python_per_key": {"ack": "tap_plugins:AdaptiveAck", "filter": "tap_plugins:PerKeyFilter"},
}
LABELS = {
    "native": "native defaults",
    "ack_only": "Python AckPolicy alone",
    "filter_only": "Python StreamFilter alone (prefix rule)",
    "python": "Python AckPolicy + StreamFilter (prefix rule)",
    "python_per_key": "Python AckPolicy + StreamFilter (every key in Python)",
}


def write_config(path: Path, plugins: dict[str, str]) -> None:
    text = '[wal]\nmode = "write"\n[snapshot]\ninterval = 0\n[buckets.default]\nmemory_quota = "4GiB"\n'
    text += "[policy]\n" + "".join(f'{k} = "{v}"\n' for k, v in plugins.items())
    path.write_text(text)


def switch(node: SluiceNode, config: Path, setting: str) -> None:
    """Rewrites the configuration and reloads it (SIGHUP), waiting for the daemon to say so."""
    plugins = SETTINGS[setting]
    write_config(config, plugins)
    node.lines.clear()
    node.proc.send_signal(signal.SIGHUP)
    # The reload's summary line comes after the plugins are in place.
    want = [f"policy {k}: {v}" for k, v in plugins.items()] + ["reload:"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        seen = "".join(list(node.lines))
        if all(w in seen for w in want):
            return
        time.sleep(0.05)
    raise RuntimeError(f"reload to {setting} not confirmed: {''.join(node.lines)[-2000:]}")


def one_run(node: SluiceNode, items: int) -> dict:
    r = _native.tap_drain(node.address, flags=SUPPORT_ACK | DUMP, timeout=600)
    if not r["closed"] or r["mutations"] < items:
        raise RuntimeError(f"the dump did not deliver every item: {r}")
    r["items_per_s"] = r["mutations"] / r["seconds"]
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=3_000_000)
    p.add_argument("--runs", type=int, default=11)
    args = p.parse_args()
    os.environ["PYTHONPATH"] = f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sluice-tap-bench-")))
        config = work / "sluice.toml"
        write_config(config, {})
        node = SluiceNode(work / "data", config)
        stack.callback(node.stop)
        load = run_load("sluice", node.address, 0, 0, 3600, args.items, depth=512, sequential=True)
        if load["errors"] or load["ops"] != args.items:
            raise RuntimeError(f"load: {load}")
        log(f"loaded {args.items:,} items in {load['seconds']:.1f} s")
        order = list(SETTINGS)
        one_run(node, args.items)  # warm-up
        for i in range(args.runs):
            for setting in order[i % len(order) :] + order[: i % len(order)]:
                switch(node, config, setting)
                r = one_run(node, args.items)
                runs[setting].append(r)
                log(f"round {i + 1} {setting}: {r['items_per_s']:,.0f} items/s ({r['acks_sent']} ACKs)")
        calls = node.metric_sum("sluice_policy_calls_total")
        timeouts = node.metric_sum("sluice_policy_timeouts_total")
        errors = node.metric_sum("sluice_policy_errors_total")
    med = {s: median(r["items_per_s"] for r in rs) for s, rs in runs.items()}
    res = {
        "command": f"python bench/tap_bench.py --items {args.items} --runs {args.runs}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}",
        "items": args.items,
        "runs": args.runs,
        "median_items_per_s": med,
        "cost": {s: 1 - med[s] / med["native"] for s in SETTINGS if s != "native"},
        "policy_calls": calls,
        "policy_timeouts": timeouts,
        "policy_errors": errors,
        "all_runs": runs,
    }
    write_outputs(res)
    print((RESULTS / "tap.md").read_text())
    return 0


def write_outputs(res: dict) -> None:
    write_json(RESULTS / "tap.json", res)
    med, cost = res["median_items_per_s"], res["cost"]
    lines = [
        f"# TAP stream throughput, native defaults vs Python policy plugins ({res['items']:,} items)",
        "",
        f"`{res['command']}` on {res['machine']}; one TAP DUMP with SUPPORT_ACK per run, read by a "
        f"native reader; medians of {res['runs']} rounds.",
        "",
        "| plugins | items/s | cost vs native |",
        "|---|---|---|",
    ]
    for s in SETTINGS:
        c = "" if s == "native" else f"{cost[s] * 100:+.1f}%"
        lines.append(f"| {LABELS[s]} | {med[s]:,.0f} | {c} |")
    met = "met" if cost["python"] <= TARGET_COST else "not met"
    lines += [
        "",
        f"Target: Python plugins cost at most {TARGET_COST:.0%}: **{met}** ({cost['python'] * 100:.1f}%).",
        f"Plugin calls over the whole run: {res['policy_calls']:,.0f}; timeouts "
        f"{res['policy_timeouts']:,.0f}; errors {res['policy_errors']:,.0f}.",
    ]
    (RESULTS / "tap.md").write_text("\n".join(lines) + "\n")
    plot(res)


def plot(res: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4.6))
    names = list(SETTINGS)
    for i, s in enumerate(names):
        vals = [r["items_per_s"] / 1e6 for r in res["all_runs"][s]]
        ax.scatter([i] * len(vals), vals, color="#999999", s=12, zorder=3)
        ax.bar(i, res["median_items_per_s"][s] / 1e6, 0.6, color="#4C72B0" if s == "native" else "#DD8452")
    ax.set_xticks(
        range(len(names)), [LABELS[s].replace(" (", "\n(").replace(" + ", " +\n") for s in names], fontsize=7
    )
    ax.set_ylabel("million items/s (median; dots: runs)")
    ax.set_title(f"TAP DUMP with SUPPORT_ACK, {res['items']:,} items")
    fig.tight_layout()
    fig.savefig(RESULTS / "tap.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
