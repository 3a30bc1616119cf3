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
        # Refusals are no throughput: none of them counts in the rate.
        r = run_bench("--server", node.address, "--duration", "0.5", "--keys", "100", "--no-prefill")
        assert r.returncode == 1 and " = 0 ops/s succeeded" in r.stdout, r.stdout + r.stderr
        assert "errors 0" not in r.stdout
    finally:
        assert node.stop() == 0


def test_bench_iproto_counts_match_the_server(tmp_path):
    """`--protocol iproto`: SELECTs and REPLACEs in space `users` after a chap-sha1 AUTH; the
    node counts the same requests, prefill included, and the tuples are there."""
    from tarantool_peer import PASSWORD, USER, sluice_config

    node = Node(tmp_path / "d", "--config", str(sluice_config(tmp_path / "c.toml")))
    try:
        r = run_bench(
            "--protocol",
            "iproto",
            "--server",
            node.iproto,
            "--count",
            "2000",
            "--connections",
            "2",
            "--pipeline",
            "10",
            "--keys",
            "300",
            "--value-size",
            "40",
            "--get-ratio",
            "0.5",
            "--user",
            USER,
            "--password-stdin",
            "--json",
            stdin=PASSWORD + "\n",
        )
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["errors"] == 0 and out["ops"] == out["gets"] + out["sets"] >= 2000
        assert out["misses"] == 0, "prefilled: every SELECT finds its tuple"
        assert node.metric("sluice_iproto_requests_total", type="select") == out["gets"]
        assert node.metric("sluice_iproto_requests_total", type="replace") == out["sets"] + 300
        users = next(b for b in node.status()["buckets"] if b["name"] == "users")
        assert sum(v["items"] for v in users["vbuckets"]) == 300

        r = run_bench(
            "--protocol", "iproto", "--server", node.iproto, "--count", "10", "--user", USER,
            "--password-stdin", stdin="wrong\n",
        )  # fmt: skip
        assert r.returncode != 0
        assert f"chap-sha1 AUTH refused: Incorrect password supplied for user '{USER}'" in r.stderr
    finally:
        assert node.stop() == 0
