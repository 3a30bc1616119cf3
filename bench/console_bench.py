"""What the web console costs the node: its page weight, and the node's CPU while browser tabs
keep it open (each polls GET /status every 2 s, as the page does).

    apt-get install chromium chromium-driver && pip install selenium
    python bench/console_bench.py [--seconds 60] [--rounds 3] [--tabs 5] [--rate 100]

Starts an active node (64 vbuckets) and its replica on free ports in a temp dir, and a steady
light load on the active (memcached SETs at `--rate` a second, which the replica streams).
Then, in `--rounds` rounds, measures the active's CPU (utime + stime of the `sluice serve`
process from /proc, all its threads) over a window of `--seconds` with `--tabs` headless
chromium windows showing its console, and over an equal window with them on about:blank; the
order alternates from round to round (ABBA) so that a drift cancels. The tabs' cost is the
difference, in % of one core. As a check, it also times back-to-back GET /status requests on
the idle node (CPU per request) and reports what `--tabs` tabs polling every 2 s would cost at
that price, and it counts the polls the tabs made (each page's own counter).

Writes bench/results/console.md (with the command) and prints it. Every loop and wait is
bounded: the script finishes or fails within about 2 x rounds x (seconds + 15) s plus a few
minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, SluiceNode, cpu_seconds, log, wait_until  # noqa: E402

CONFIG = "[snapshot]\ninterval = 0\n[buckets.default]\nnum_vbuckets = 64\n"
# The files the page is made of, as the admin endpoint serves them.
PAGE_FILES = ("/", "/console.js", "/console.css", "/uPlot.iife.min.js", "/uPlot.min.css")
POLL_S = 2.0  # the page's polling interval (console.js POLL_MS)
SETTLE_S = 3.0  # after the tabs open or close, before a window is measured
TARGET_PCT = 1.0  # of one core, for 5 tabs (issue 52)
PAGE_TARGET = 300_000  # bytes


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


class Load:
    """SETs at `rate` a second on one connection, bounded in count and time; counts them."""

    def __init__(self, address: str, rate: float, max_seconds: float) -> None:
        self.address, self.rate = address, rate
        self.max_seconds = max_seconds
        self.max_sets = int(rate * max_seconds) + 1
        self.sets = 0
        self.error: str | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import bmemcached

        c = bmemcached.Client([self.address])
        try:
            start = time.monotonic()
            deadline = start + self.max_seconds
            while not self.stop.is_set() and self.sets < self.max_sets and time.monotonic() < deadline:
                c.set(f"key{self.sets % 5000}", "v" * 200)
                self.sets += 1
                # Paced against the start, so a slow set is made up for and the rate holds.
                ahead = start + self.sets / self.rate - time.monotonic()
                if ahead > 0:
                    self.stop.wait(ahead)
        except Exception as e:  # noqa: BLE001 - reported in the results
            self.error = repr(e)
        finally:
            c.disconnect_all()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


class Tabs:
    """`n` windows of one headless chromium, each its own visible page (background tabs of one
    window would have their timers throttled, which a person's open tabs are not, always)."""

    def __init__(self, n: int) -> None:
        from selenium import webdriver

        chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
        if not (chromium and chromedriver):
            sys.exit("needs chromium and chromedriver: apt-get install chromium chromium-driver")
        opts = webdriver.ChromeOptions()
        opts.binary_location = chromium
        for arg in ("--headless=new", "--disable-dev-shm-usage", "--window-size=1400,1200"):
            opts.add_argument(arg)
        if os.geteuid() == 0:
            opts.add_argument("--no-sandbox")  # chromium's sandbox refuses to run as root
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.d = webdriver.Chrome(options=opts, service=webdriver.ChromeService(chromedriver))
        self.d.set_page_load_timeout(30)
        self.d.set_script_timeout(30)
        self.handles = [self.d.current_window_handle]
        for _ in range(n - 1):
            self.d.switch_to.new_window("window")
            self.handles.append(self.d.current_window_handle)

    def polls(self) -> list[int]:
        """Each page's count of /status answers drawn (0 on a blank page)."""
        out = []
        for h in self.handles:
            self.d.switch_to.window(h)
            out.append(int(self.d.execute_script("return Number(document.body?.dataset?.polls || 0)")))
        return out

    def open(self, url: str) -> None:
        for h in self.handles:
            self.d.switch_to.window(h)
            self.d.get(url)
        wait_until(lambda: min(self.polls()) >= 1, 30, "every tab's first poll", interval=0.2)

    def blank(self) -> None:
        for h in self.handles:
            self.d.switch_to.window(h)
            self.d.get("about:blank")

    def errors(self) -> list[str]:
        out = []
        for h in self.handles:
            self.d.switch_to.window(h)
            out += [e["message"] for e in self.d.get_log("browser") if e["level"] == "SEVERE"]
        return out

    def close(self) -> None:
        self.d.quit()


def window(pid: int, seconds: float, load: Load) -> dict:
    """The node's CPU over `seconds` of wall time, in % of one core, and the load's rate then."""
    t0, c0, s0 = time.monotonic(), cpu_seconds(pid), load.sets
    time.sleep(seconds)
    t1, c1, s1 = time.monotonic(), cpu_seconds(pid), load.sets
    wall = t1 - t0
    return {
        "wall_s": wall,
        "cpu_s": c1 - c0,
        "cpu_pct": 100 * (c1 - c0) / wall,
        "sets_per_s": (s1 - s0) / wall,
    }


def status_cost(node: SluiceNode, requests: int, max_seconds: float) -> dict:
    """CPU per GET /status on the node (idle but for this), from back-to-back requests less
    the idle node's own CPU over the same time."""
    url = f"http://{node.admin}/status"
    fetch(url)
    t0, c0 = time.monotonic(), cpu_seconds(node.proc.pid)
    time.sleep(5)
    idle_rate = (cpu_seconds(node.proc.pid) - c0) / (time.monotonic() - t0)
    size, n = 0, 0
    t0, c0 = time.monotonic(), cpu_seconds(node.proc.pid)
    while n < requests and time.monotonic() - t0 < max_seconds:
        size = len(fetch(url))
        n += 1
    wall, cpu = time.monotonic() - t0, cpu_seconds(node.proc.pid) - c0
    per_request = 1000 * (cpu - idle_rate * wall) / n
    return {
        "requests": n,
        "bytes": size,
        "wall_s": wall,
        "cpu_ms_per_request": per_request,
        "idle_pct": 100 * idle_rate,
    }


def fmt_pct(x: float) -> str:
    return f"{x:.2f} %"


def report(res: dict) -> str:
    a = res["args"]
    rounds = res["rounds"]
    diffs = [r["with"]["cpu_pct"] - r["without"]["cpu_pct"] for r in rounds]
    mean_diff = statistics.mean(diffs)
    polls_per_s = statistics.mean(r["polls_per_s"] for r in rounds)
    sc = res["status_cost"]
    predicted = a.tabs / POLL_S * sc["cpu_ms_per_request"] / 1000 * 100
    ok = "under" if mean_diff < TARGET_PCT else "OVER"
    without = statistics.mean(r["without"]["cpu_pct"] for r in rounds)
    with_tabs = statistics.mean(r["with"]["cpu_pct"] for r in rounds)
    page = res["page_bytes"]
    lines = [
        "# The web console's cost to the node",
        "",
        f"`{res['command']}`: an active node (64 vbuckets, one bucket) with a replica, under "
        f"{a.rate:g} memcached SETs/s; {a.tabs} headless chromium windows show the active's console "
        f"(each polls GET /status every {POLL_S:g} s) for {a.seconds:g} s, then an equal window with "
        f"them on about:blank, in {a.rounds} rounds, the order alternating. CPU is the `sluice serve` "
        f"process's utime + stime from /proc (all threads), in % of one core. "
        f"{res['date']}, {res['machine']}; chromium and the load run on the same machine.",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| page weight (the 5 files, uncompressed) | {page:,} B ({page / 1024:.1f} KiB) "
        f"| < {PAGE_TARGET // 1000} KB: {'met' if page < PAGE_TARGET else 'MISSED'} |",
        f"| node CPU, no tabs (mean of rounds) | {fmt_pct(without)} | |",
        f"| node CPU, {a.tabs} tabs open (mean of rounds) | {fmt_pct(with_tabs)} | |",
        f"| **{a.tabs} tabs' cost** (with − without, mean of rounds) | **{fmt_pct(mean_diff)} of a core** "
        f"(rounds: {', '.join(f'{d:+.2f}' for d in diffs)}) | < {TARGET_PCT:g} %: {ok} |",
        f"| polls the tabs made | {polls_per_s:.2f}/s (expected {a.tabs / POLL_S:.2f}/s) | |",
        f"| GET /status back to back, idle node | {sc['cpu_ms_per_request']:.2f} ms CPU each, "
        f"{sc['bytes']:,} B answer ({sc['requests']} requests) | |",
        f"| so {a.tabs} tabs at one poll per {POLL_S:g} s | {fmt_pct(predicted)} of a core "
        f"| < {TARGET_PCT:g} % |",
        "",
        "| round | order | without tabs | with tabs | difference | polls/s | SETs/s without, with |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds, 1):
        lines.append(
            f"| {i} | {r['order']} | {fmt_pct(r['without']['cpu_pct'])} | {fmt_pct(r['with']['cpu_pct'])} "
            f"| {r['with']['cpu_pct'] - r['without']['cpu_pct']:+.2f} % | {r['polls_per_s']:.2f} "
            f"| {r['without']['sets_per_s']:.0f}, {r['with']['sets_per_s']:.0f} |"
        )
    if res.get("page_errors"):
        lines += ["", f"The pages logged errors: {res['page_errors'][:5]}"]
    if res.get("load_error"):
        lines += ["", f"The load failed: {res['load_error']}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60, help="length of each measured window")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (with tabs, without)")
    ap.add_argument("--tabs", type=int, default=5)
    ap.add_argument("--rate", type=float, default=100, help="memcached SETs a second on the active")
    ap.add_argument("--out", type=Path, default=RESULTS / "console.md")
    args = ap.parse_args()
    if not (1 <= args.rounds <= 20 and 1 <= args.tabs <= 20 and 1 <= args.seconds <= 3600 and args.rate > 0):
        sys.exit("--rounds 1-20, --tabs 1-20, --seconds 1-3600, --rate > 0")

    cmd = "python bench/console_bench.py" + "".join(f" {a}" for a in sys.argv[1:])
    res: dict = {
        "command": cmd,
        "args": args,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}",
        "rounds": [],
    }
    with tempfile.TemporaryDirectory(prefix="sluice-console-bench-") as tmp:
        config = Path(tmp) / "sluice.toml"
        config.write_text(CONFIG)
        active = replica = load = tabs = None
        try:
            active = SluiceNode(Path(tmp) / "active", config)
            replica = SluiceNode(Path(tmp) / "replica", config, replica_of=active.address)
            base = f"http://{active.admin}"
            page = fetch(base + "/").decode(errors="replace")
            if "console.js" not in page:
                sys.exit(f"{base}/ serves no console (an older sluice?): {page[:200]!r}")
            res["page_bytes"] = sum(len(fetch(base + p)) for p in PAGE_FILES)

            def streaming() -> bool:
                followed = (replica.status().get("replication") or {}).get("buckets", [{}])
                return all(b.get("connected") for b in followed)

            wait_until(streaming, 30, "the replica streaming", interval=0.2)
            log("timing GET /status back to back on the idle node")
            res["status_cost"] = status_cost(active, 500, 60)

            per_window = args.seconds + SETTLE_S + 15  # the tabs' opening, bounded by its waits
            load = Load(active.address, args.rate, 2 * args.rounds * per_window + 120)
            tabs = Tabs(args.tabs)
            pid = active.proc.pid
            time.sleep(SETTLE_S)
            for i in range(args.rounds):
                order = ("without", "with") if i % 2 == 0 else ("with", "without")
                r: dict = {"order": ", ".join(order)}
                for kind in order:
                    active.proc.poll()
                    if active.proc.returncode is not None:
                        raise RuntimeError(f"the active exited: {''.join(active.lines)[-2000:]}")
                    if kind == "with":
                        tabs.open(base + "/")
                        time.sleep(SETTLE_S)
                        p0 = sum(tabs.polls())
                        r["with"] = window(pid, args.seconds, load)
                        r["polls_per_s"] = (sum(tabs.polls()) - p0) / r["with"]["wall_s"]
                        tabs.blank()
                    else:
                        time.sleep(SETTLE_S)
                        r["without"] = window(pid, args.seconds, load)
                    log(f"round {i + 1}, {kind} tabs: {r[kind]['cpu_pct']:.2f} % of a core")
                res["rounds"].append(r)
            res["page_errors"] = tabs.errors()
            res["load_error"] = load.error
        finally:
            for x in (tabs, load):
                if x is not None:
                    x.close()
            for n in (replica, active):
                if n is not None:
                    n.stop()
    text = report(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
