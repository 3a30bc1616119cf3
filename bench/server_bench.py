"""sluice against memcached (Debian package) under the same load from `sluice bench`, in one
run on this machine. Writes bench/results/server.{json,md,png}.

    apt-get install memcached && python bench/server_bench.py [--duration 10] [--runs 3]

Each configuration runs --runs times alternating servers; the table gives medians and the
sluice/memcached ratio. Both servers get the same threads (2) and the same memory (1 GiB).

`--baseline PYTHON` also runs the sluice installed for another interpreter (a virtualenv holding
an earlier build) in the same rounds, and adds the ratio of this build to it: what a change
costs, measured side by side.

Where `openssl` is installed, each round also runs sluice with its TLS listener (a certificate
from a CA made for the run) and drives the TLS port with the same load (`sluice bench --cacert`):
the table adds what TLS costs against the plain port of the same build.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import sluice
from _common import RESULTS, cpu_seconds, free_port, pyplot, wait_port, write_json

LOADS = [
    # name, get ratio, value size, pipeline
    ("90% GET, 100 B, pipeline 32", 0.9, 100, 32),
    ("50% GET, 100 B, pipeline 32", 0.5, 100, 32),
    ("90% GET, 1 KiB, pipeline 32", 0.9, 1024, 32),
    ("90% GET, 100 B, no pipelining", 0.9, 100, 1),
    ("100% SET, 100 B, pipeline 32", 0.0, 100, 32),
]


def make_certificate(root: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate it signed for 127.0.0.1: (CA file, certificate, key)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca, ca_key = root / "ca.pem", root / "ca.key"
    cert, key, csr, ext = root / "server.pem", root / "server.key", root / "server.csr", root / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n")
    for cmd in (
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=sluice bench CA"],
        ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert]
        + ["-days", "2", "-extfile", ext],
    ):
        subprocess.run(["openssl", *map(str, cmd)], check=True, capture_output=True)
    return ca, cert, key


def start(
    kind: str, data: Path, baseline: str | None = None, tls: tuple[Path, Path, Path] | None = None
) -> tuple[subprocess.Popen, int]:
    port = free_port()
    if kind == "memcached":
        cmd = [
            "memcached",
            "-U",
            "0",
            "-l",
            "127.0.0.1",
            "-p",
            str(port),
            "-t",
            "2",
            "-m",
            "1024",
            "-c",
            "4096",
        ]
        if hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0:
            cmd += ["-u", "root"]
    else:
        cmd = [
            baseline if kind == "baseline" and baseline else sys.executable,
            "-m",
            "sluice",
            "serve",
            "--data-dir",
            str(data),
            "--listen",
            f"127.0.0.1:{port}",
            "--admin-listen",
            "",
            # Off: a baseline and this build may be up at once.
            "--iproto-listen",
            "",
            "--tank-listen",
            "",
            "--greenstack-listen",
            "",
        ]
        if kind == "tls" and tls is not None:
            _, cert, key = tls
            plain, port = port, free_port()
            config = data / "tls.toml"
            config.write_text(
                f'tls_listen = "127.0.0.1:{port}"\n[tls]\ncertificate = "{cert}"\nkey = "{key}"\n'
            )
            cmd += ["--config", str(config)]
            cmd[cmd.index("--listen") + 1] = f"127.0.0.1:{plain}"
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return p, port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--baseline", metavar="PYTHON", help="also run the sluice of this interpreter")
    args = ap.parse_args()
    kinds = ["sluice", "memcached"] + (["baseline"] if args.baseline else [])
    if shutil.which("memcached") is None:
        print("memcached is not installed: apt-get install memcached", file=sys.stderr)
        return 1
    tls_dir = Path(tempfile.mkdtemp(prefix="sluice-bench-tls-"))
    tls = None
    if shutil.which("openssl") is None:
        print("openssl is not installed: no TLS rows", file=sys.stderr)
    else:
        tls = make_certificate(tls_dir)
        kinds.append("tls")
    results: dict = {
        "duration": args.duration,
        "runs": args.runs,
        "connections": args.connections,
        "loads": {},
    }
    for name, ratio, size, pipeline in LOADS:
        per: dict[str, list] = {k: [] for k in kinds}
        for run in range(args.runs):
            for kind in kinds if run % 2 == 0 else kinds[::-1]:
                with tempfile.TemporaryDirectory() as d:
                    p, port = start(kind, Path(d), args.baseline, tls)
                    try:
                        before = cpu_seconds(p.pid)
                        r = sluice._native.bench(
                            f"127.0.0.1:{port}",
                            cacert=str(tls[0]) if kind == "tls" and tls else None,
                            connections=args.connections,
                            pipeline=pipeline,
                            duration=args.duration,
                            keys=100_000,
                            value_size=size,
                            get_ratio=ratio,
                            threads=2,
                        )
                        served = r["ops_per_s"] * args.duration
                        r["server_cpu_us_per_op"] = (cpu_seconds(p.pid) - before) / served * 1e6
                    finally:
                        p.terminate()
                        p.wait(timeout=60)
                per[kind].append(r)
                print(
                    f"{name} | {kind} run {run + 1}: {r['ops_per_s']:,.0f} ops/s, "
                    f"p99 {r['latency_us']['p99']} us, {r['server_cpu_us_per_op']:.2f} us server CPU/op, "
                    f"errors {r['errors']}",
                    file=sys.stderr,
                )
        results["loads"][name] = per
    shutil.rmtree(tls_dir, ignore_errors=True)
    write(results)
    return 0


def write(results: dict) -> None:
    write_json(RESULTS / "server.json", results)
    with_baseline = any("baseline" in per for per in results["loads"].values())
    with_tls = any("tls" in per for per in results["loads"].values())
    extra = [" baseline ops/s | sluice / baseline |"] if with_baseline else []
    extra += [" sluice over TLS ops/s | TLS p50 / p99 (us) | TLS / plain |"] if with_tls else []
    rows = [
        "| load | sluice ops/s | memcached ops/s | ratio | sluice p50 / p99 (us) "
        "| memcached p50 / p99 (us) | server CPU per op, sluice / memcached (us) |" + "".join(extra),
        "|---|---|---|---|---|---|---|" + "---|---|" * with_baseline + "---|---|---|" * with_tls,
    ]
    names, ratios = [], []
    for name, per in results["loads"].items():
        s = statistics.median(r["ops_per_s"] for r in per["sluice"])
        m = statistics.median(r["ops_per_s"] for r in per["memcached"])
        sl = [statistics.median(r["latency_us"][k] for r in per["sluice"]) for k in ("p50", "p99")]
        ml = [statistics.median(r["latency_us"][k] for r in per["memcached"]) for k in ("p50", "p99")]
        sc, mc = (
            statistics.median(r["server_cpu_us_per_op"] for r in per[k]) for k in ("sluice", "memcached")
        )
        row = (
            f"| {name} | {s:,.0f} | {m:,.0f} | {s / m:.2f} | {sl[0]:,.0f} / {sl[1]:,.0f} | "
            f"{ml[0]:,.0f} / {ml[1]:,.0f} | {sc:.2f} / {mc:.2f} |"
        )
        b = t = 0.0
        if with_baseline:
            b = statistics.median(r["ops_per_s"] for r in per["baseline"])
            row += f" {b:,.0f} | {s / b:.3f} |"
        if with_tls:
            t = statistics.median(r["ops_per_s"] for r in per["tls"])
            tl = [statistics.median(r["latency_us"][k] for r in per["tls"]) for k in ("p50", "p99")]
            row += f" {t:,.0f} | {tl[0]:,.0f} / {tl[1]:,.0f} | {t / s:.2f} |"
        rows.append(row)
        names.append(name)
        ratios.append((s, m, b, t))
    flags = f"--duration {results['duration']} --runs {results['runs']}"
    flags += " --baseline PYTHON" if with_baseline else ""
    md = (
        f"# sluice against memcached\n\n`python bench/server_bench.py {flags}`: "
        f"{results['connections']} connections, 100,000 keys, medians of the runs, "
        "both servers on 2 threads on this 2-core machine (the load generator shares it). "
        "Server CPU per op: the server process's user and system time over the run per operation."
        + (" TLS: the same sluice on its TLS port, the load over TLS (rustls)." if with_tls else "")
        + "\n\n"
        + "\n".join(rows)
        + "\n"
    )
    (RESULTS / "server.md").write_text(md)
    print(md)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    x = range(len(names))
    bars = [("sluice", 0, "#4C72B0"), ("memcached", 1, "#DD8452")]
    bars += [("sluice (baseline build)", 2, "#8C8C8C")] if with_baseline else []
    bars += [("sluice over TLS", 3, "#55A868")] if with_tls else []
    width = 0.8 / len(bars)
    for n, (label, col, color) in enumerate(bars):
        offset = (n - (len(bars) - 1) / 2) * width
        ax.bar([i + offset for i in x], [r[col] / 1e3 for r in ratios], width, label=label, color=color)
    ax.set_xticks(list(x), names, fontsize=8)
    ax.set_ylabel("thousand ops/s (median)")
    ax.set_title("memcached binary protocol: sluice against memcached, same load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "server.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
