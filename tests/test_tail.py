"""`sluice tail`: a bucket's change stream as JSON lines or a table, from the beginning or from
now, chosen vbuckets, resumable from a state file, with backfill progress on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import bmemcached
import sluice
from helpers import run_cli


def tail(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_cli("tail", *args, timeout=timeout)


def test_from_the_beginning_then_resume_from_state(server, tmp_path):
    mc = bmemcached.Client([server.address])
    for i in range(20000):
        mc.set(f"t{i}", f"value{i}")
    mc.delete("t7")
    state = tmp_path / "tail.json"
    r = tail("--address", server.address, "--from", "beginning", "--until-now", "--state", str(state))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 20000  # the latest version of each key, t7 as a deletion
    by_key = {row["key"]: row for row in rows}
    assert by_key["t5"]["value"] == "value5" and by_key["t5"]["op"] == "mutation"
    assert by_key["t7"]["op"] == "deletion" and "value" not in by_key["t7"]
    assert "backfill: done, 20,001 seqnos from 64 vbuckets" in r.stderr  # backfill progress
    # Resuming from the state file prints only what changed since.
    mc.set("t1", "again")
    mc.set("new", "key")
    r = tail("--address", server.address, "--until-now", "--state", str(state))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["key"], x["value"]) for x in rows] == sorted(
        [("t1", "again"), ("new", "key")], key=lambda x: sluice.vbucket_of(x[0].encode(), 64)
    )
    r = tail("--address", server.address, "--until-now", "--state", str(state))
    assert r.stdout == ""


def test_table_chosen_vbuckets_and_from_now(server):
    mc = bmemcached.Client([server.address])
    for i in range(300):
        mc.set(f"v{i}", "x")
    r = tail(
        "--address",
        server.address,
        "--from",
        "beginning",
        "--until-now",
        "--vbuckets",
        "0,2-3",
        "--format",
        "table",
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["vbucket", "seqno", "op", "rev", "key"]
    vbs = {int(line.split()[0]) for line in lines[1:]}
    assert vbs == {0, 2, 3}
    expected = sum(1 for i in range(300) if sluice.vbucket_of(f"v{i}".encode(), 64) in (0, 2, 3))
    assert len(lines) - 1 == expected

    # From now: follows only new changes; --max stops it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice", "tail", "--address", server.address, "--max", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Wait until its 64 streams are open on the server.
    deadline = time.monotonic() + 60
    while "sluice_dcp_streams 64" not in server.metrics():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    mc.set("later1", "a")
    mc.set("later2", "b")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert sorted(json.loads(line)["key"] for line in out.splitlines()) == ["later1", "later2"]


def test_usage_and_connection_errors(server):
    r = tail("--address", server.address, "--vbuckets", "0,x")
    assert r.returncode == 2 and "--vbuckets" in r.stderr
    r = tail("--address", "127.0.0.1:1", "--until-now")
    assert r.returncode == 1 and "cannot connect" in r.stderr
