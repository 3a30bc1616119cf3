"""The admin endpoint of a running `sluice serve`: /metrics in Prometheus text, /status as JSON,
and `sluice status` printing it as tables."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import bmemcached
import pytest


def fetch(node, path: str) -> str:
    with urllib.request.urlopen(f"http://{node.admin}{path}", timeout=10) as r:
        return r.read().decode()


def test_metrics_count_what_clients_did(server):
    c = bmemcached.Client([server.address])
    for i in range(25):
        c.set(f"k{i}", "v")
    c.get("k1")
    c.get("missing")
    c.disconnect_all()
    text = fetch(server, "/metrics")
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert int(lines['sluice_ops_total{bucket="default",op="set"}']) == 25
    assert int(lines['sluice_ops_total{bucket="default",op="get_miss"}']) == 1
    assert int(lines['sluice_items{bucket="default",kind="live"}']) == 25
    assert int(lines['sluice_network_bytes_total{direction="in"}']) > 0
    assert 'sluice_wal_sync_seconds_bucket{le="+Inf"}' in lines
    highs = [int(v) for k, v in lines.items() if k.startswith("sluice_vbucket_seqno") and 'kind="high"' in k]
    assert len(highs) == 64 and sum(highs) == 25
    assert "# TYPE sluice_wal_sync_seconds histogram" in text


def test_status_json_and_the_table(server):
    c = bmemcached.Client([server.address])
    c.set("a", "1")
    c.disconnect_all()
    st = json.loads(fetch(server, "/status"))
    assert st["listen"] == server.address and len(st["buckets"][0]["vbuckets"]) == 64
    vb = [v for v in st["buckets"][0]["vbuckets"] if v["high_seqno"]]
    assert len(vb) == 1 and vb[0]["state"] == "active" and vb[0]["items"] == 1
    r = subprocess.run(
        [sys.executable, "-m", "sluice", "status", "--admin", server.admin],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "vbucket  state" in r.stdout and "63 empty active vbuckets not shown" in r.stdout
    assert f"listening on {server.address}" in r.stdout


def test_other_paths_and_methods(server):
    with pytest.raises(urllib.error.HTTPError) as e:
        fetch(server, "/nope")
    assert e.value.code == 404
    req = urllib.request.Request(f"http://{server.admin}/metrics", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 405


def test_status_of_a_node_that_is_not_there():
    r = subprocess.run(
        [sys.executable, "-m", "sluice", "status", "--admin", "127.0.0.1:1", "--timeout", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "cannot reach the admin endpoint" in r.stderr
