"""`sluice bench`, the native load generator, against a real `sluice serve`: it reports what it
did, with no errors, and the server agrees with its counts."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import Node


def run_bench(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluice", "bench", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bench_json_counts_match_the_server(server):
    r = run_bench(
        "--server",
        server.address,
        "--duration",
        "1",
        "--connections",
        "4",
        "--pipeline",
        "8",
        "--keys",
        "1000",
        "--get-ratio",
        "0.5",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["errors"] == 0 and out["ops"] == out["gets"] + out["sets"] > 1000
    assert out["misses"] == 0, "prefilled: every GET hits"
    lat = out["latency_us"]
    assert 0 < lat["p50"] <= lat["p99"] <= lat["max"]
    text = server.metrics()
    sets = int(next(line.split()[-1] for line in text.splitlines() if 'op="set"' in line))
    assert sets == out["sets"] + 1000, "the server counted the bench's SETs and the 1000 of the prefill"


def test_bench_table_and_sasl(tmp_path):
    import sluice

    cfg = tmp_path / "c.toml"
    h = sluice.config.hash_password("pw", iterations=1000)
    cfg.write_text(f'[users.b]\npassword_hash = "{h}"\nbuckets = {{ default = ["read", "write"] }}\n')
    node = Node(tmp_path / "d", "--config", str(cfg))
    try:
        r = run_bench(
            "--server",
            node.address,
            "--duration",
            "0.5",
            "--keys",
            "100",
            "--user",
            "b",
            "--password-stdin",
            stdin="pw\n",
        )
        assert r.returncode == 0, r.stderr
        assert "ops/s" in r.stdout and "errors 0" in r.stdout and "latency (us)" in r.stdout
        r = run_bench("--server", node.address, "--duration", "0.5", "--keys", "100")
        assert r.returncode == 1 and "errors 0" not in r.stdout, (
            "unauthenticated: every request refused, exit 1"
        )
    finally:
        assert node.stop() == 0
