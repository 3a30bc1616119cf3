"""What the benchmarks share: free ports, waiting, percentiles and medians, server processes
(`sluice serve` with readers for its admin endpoint), the memcached binary header, and writing
results (JSON, Markdown, PNG) under bench/results. Not a benchmark itself."""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# wait_until's default polling interval.
POLL_S = 0.01
# memcached binary protocol: magic, opcode, keylen, extlen, datatype, vb/status, body, opaque, cas
MC_HEADER = struct.Struct(">BBHBBHIIQ")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout: float, what: str, interval: float = POLL_S) -> float:
    """Calls pred() until it is true; returns the perf_counter time it was; raises after timeout."""
    deadline = time.perf_counter() + timeout
    while True:
        if pred():
            return time.perf_counter()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


def wait_port(port: int, timeout: float = 30) -> None:
    """Waits until something accepts connections on 127.0.0.1:`port`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def percentile(values: list[float], p: float) -> float:
    """Nearest rank."""
    s = sorted(values)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def med(runs: list[dict], *path: str) -> float | None:
    """The median of the number at `path` in each run (failed runs and missing values skipped)."""
    vals = []
    for r in runs:
        if "error" in r:
            continue
        for p in path:
            r = r.get(p) if isinstance(r, dict) else None
        if isinstance(r, (int, float)) and not math.isnan(r):
            vals.append(r)
    return statistics.median(vals) if vals else None


def write_json(path: Path, res: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said on stderr) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no plot", file=sys.stderr)
        return None
    return plt


def write_paired_bars(
    path: Path, names: list[str], pairs: list[tuple[float, float]], labels: tuple[str, str], title: str
) -> None:
    """A PNG of two bars per load (thousand ops/s), `labels` naming the pair's sides; nothing
    when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    x = range(len(names))
    for n, (label, color) in enumerate(zip(labels, ("#4C72B0", "#DD8452"), strict=True)):
        offset = (n - 0.5) * 0.4
        ax.bar([i + offset for i in x], [p[n] / 1e3 for p in pairs], 0.4, label=label, color=color)
    ax.set_xticks(list(x), names, fontsize=8)
    ax.set_ylabel("thousand ops/s (median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def admin_get(address: str, path: str) -> str:
    """GET `path` on a node's admin endpoint (reads are open on loopback): the body."""
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as r:
        return r.read().decode()


class Proc:
    """A server process in its own process group, output to a log file."""

    def __init__(self, cmd: list[str], logfile: Path, cwd: Path | None = None) -> None:
        self.cmd = cmd
        self.logfile = logfile
        self.out = open(logfile, "ab")
        self.proc = subprocess.Popen(
            cmd, stdout=self.out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.cmd[0]} exited ({self.proc.returncode}): {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        try:
            return self.logfile.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        kill_group(self.proc)
        self.out.close()


def cpu_seconds(pid: int) -> float:
    """User plus system time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kill_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=timeout)


class SluiceNode:
    """`python -m sluice serve` on free ports; stderr read on a thread (as tests/helpers.Node)."""

    def __init__(
        self, data_dir: Path, config: Path, replica_of: str | None = None, python: str = sys.executable
    ) -> None:
        """`python`: the interpreter whose sluice runs (an earlier build in a virtualenv)."""
        cmd = [python, "-m", "sluice", "serve", "--config", str(config), "--data-dir", str(data_dir)]
        cmd += ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--tank-listen", "127.0.0.1:0"]
        cmd += ["--greenstack-listen", "127.0.0.1:0", "--iproto-listen", "127.0.0.1:0"]
        if replica_of:
            cmd += ["--replica-of", replica_of]
        self.lines: collections.deque[str] = collections.deque(maxlen=300)
        self.ready = threading.Event()
        self.ready_line = ""
        self.ready_at = 0.0
        self.spawned = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 60
        while not self.ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"sluice serve not ready (exit {self.proc.poll()}): {''.join(self.lines)[-3000:]}"
                )
        self.address = self.ready_line.split("listening on ")[1].split(" ")[0]
        self.admin = self.ready_line.split("(admin ")[1].split(")")[0]

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if not self.ready.is_set() and "sluice ready" in line:
                self.ready_at = time.perf_counter()
                self.ready_line = line
                self.ready.set()

    def status(self) -> dict:
        return json.loads(admin_get(self.admin, "/status"))

    def metric_sum(self, name: str) -> float:
        """The sum over every series of `name` in /metrics, whatever its labels."""
        lines = admin_get(self.admin, "/metrics").splitlines()
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((name + "{", name + " "))
        )

    def seqnos(self, state: str) -> tuple[int, int]:
        """(sum of high seqnos, sum of items) over the vbuckets in `state`."""
        seq = items = 0
        for b in self.status()["buckets"]:
            for v in b["vbuckets"]:
                if v["state"] == state:
                    seq += v["high_seqno"]
                    items += v["items"]
        return seq, items

    def stop(self) -> None:
        kill_group(self.proc)
