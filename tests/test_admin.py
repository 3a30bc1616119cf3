"""The admin endpoint of a running `sluice serve`: /metrics in Prometheus text, /status as JSON,
and `sluice status` printing it as tables."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request

import bmemcached
import pytest
from helpers import FRONTS_OFF, Node, admin_get, admin_post, basic_auth, write_users_config


def test_metrics_count_what_clients_did(server):
    c = bmemcached.Client([server.address])
    for i in range(25):
        c.set(f"k{i}", "v")
    c.get("k1")
    c.get("missing")
    c.disconnect_all()
    text = server.metrics()
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
    st = server.status()
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
        admin_get(server.admin, "/nope")
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
    assert r.returncode == 1, r.stderr
    assert "nothing listens at 127.0.0.1:1 (connection refused); expected a node's admin endpoint" in r.stderr


# --- Who may change the node: users, the token, and cross-site requests -------------------


def role(node) -> str | None:
    """Whom the node follows (None once it is active) and checks its vbuckets agree."""
    st = node.status()
    states = {v["state"] for v in st["buckets"][0]["vbuckets"]}
    rep = st["replication"]
    assert states == ({"replica"} if rep else {"active"}), states
    return rep and rep["replica_of"]


def refused(node) -> dict[str, int]:
    return {
        line.split('reason="')[1].split('"')[0]: int(line.rsplit(" ", 1)[1])
        for line in node.metrics().splitlines()
        if line.startswith("sluice_admin_refused_total{")
    }


@pytest.fixture
def secured_pair(tmp_path):
    """An active and its replica, both with users (write_users_config's ada, bob read-only, root
    admin on "*"); the replica logs in to the active as root."""

    users = tmp_path / "users.toml"
    write_users_config(users, '["read"]')
    active = Node(tmp_path / "a", "--config", str(users))
    (tmp_path / "root.pw").write_text("root-secret\n")
    replica_cfg = tmp_path / "replica.toml"
    replica_cfg.write_text(
        users.read_text() + f'[replication]\nuser = "root"\npassword_file = "{tmp_path / "root.pw"}"\n'
    )
    replica = Node(tmp_path / "b", "--config", str(replica_cfg), "--replica-of", active.address)
    active.data_dir, replica.data_dir = tmp_path / "a", tmp_path / "b"
    yield active, replica
    assert replica.stop() == 0 and active.stop() == 0


def test_state_changes_need_a_user_with_admin(secured_pair):
    active, replica = secured_pair
    takeover = f"/takeover?vbucket=5&source={active.address}"
    for path in ("/promote", takeover):
        code, headers, _ = admin_post(replica, path, {"X-Sluice-Request": "1"})
        assert code == 401 and headers["WWW-Authenticate"] == 'Basic realm="sluice"', path
        code, _, body = admin_post(replica, path, basic_auth("bob", "bob-secret"))
        assert code == 403 and "admin permission" in body, path
    assert admin_post(replica, "/promote", basic_auth("root", "wrong"))[0] == 401
    assert admin_post(replica, "/promote", basic_auth("nobody", "root-secret"))[0] == 401
    assert admin_post(replica, "/promote", {"Authorization": "Bearer not-the-token"})[0] == 401
    assert role(replica) == active.address, "nothing refused changed the node"
    assert refused(replica) == {
        "no_credentials": 2,
        "bad_credentials": 3,
        "no_permission": 2,
        "cross_site": 0,
        "not_loopback": 0,
    }
    # Reads stay open on a loopback endpoint (Prometheus scrapes without credentials).
    assert "vbucket  state" in run_status(replica).stdout
    env = {**os.environ, "SLUICE_PASSWORD": "root-secret"}
    r = subprocess.run(
        [sys.executable, "-m", "sluice", "promote", "--admin", replica.admin, "--user", "root"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=replica.data_dir.parent,
    )
    assert r.returncode == 0 and "64 vbucket(s) promoted to active" in r.stdout, r.stderr
    assert role(replica) is None


def run_status(node, *args: str):
    r = subprocess.run(
        [sys.executable, "-m", "sluice", "status", "--admin", node.admin, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return r


def test_the_local_cli_uses_the_nodes_token_file(secured_pair, tmp_path):
    active, replica = secured_pair
    token = replica.data_dir / "admin.token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text().strip()) == 64
    promote = [sys.executable, "-m", "sluice", "promote", "--admin", replica.admin]
    # Elsewhere (no ./sluice-data/admin.token) and without --user: refused, and told how.
    r = subprocess.run(promote, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 1 and "credentials required" in r.stderr and "--token-file" in r.stderr
    r = subprocess.run(
        [*promote, "--token-file", str(active.data_dir / "admin.token")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "wrong user, password or token" in r.stderr, "another node's token"
    r = subprocess.run(
        [*promote, "--token-file", str(tmp_path / "none")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "--token-file: cannot read" in r.stderr
    assert role(replica) == active.address
    assert "role: replica of" in run_status(replica, "--data-dir", str(replica.data_dir)).stdout
    # The default: admin.token in --data-dir (or the configuration's data_dir).
    r = subprocess.run(
        [*promote, "--data-dir", str(replica.data_dir)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "64 vbucket(s) promoted to active" in r.stdout, r.stderr
    assert role(replica) is None
    assert replica.stop() == 0
    assert not token.exists(), "the token goes with the node"


def test_a_cross_site_post_changes_nothing(tmp_path):
    """Without users, a loopback endpoint takes state changes from local tools; a page in a
    browser on the same machine must not be able to make them."""

    active = Node(tmp_path / "a")
    replica = Node(tmp_path / "b", "--replica-of", active.address)
    try:
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        port = replica.admin.rsplit(":", 1)[1]
        attempts = [
            {**form, "Origin": "http://evil.example"},  # a plain HTML form posted from another site
            form,  # no Origin (an old browser) but nothing a form cannot send
            {**form, "Origin": "null", "X-Sluice-Request": "1"},
            {"Origin": "http://evil.example", "X-Sluice-Request": "1"},
            {"Sec-Fetch-Site": "cross-site", "X-Sluice-Request": "1"},
            {"Host": f"evil.example:{port}", "X-Sluice-Request": "1"},  # DNS rebinding
        ]
        for headers in attempts:
            code, _, body = admin_post(replica, "/promote", headers, data=b"a=1")
            assert code == 403 and "cross-site" in body, headers
        assert refused(replica)["cross_site"] == len(attempts)
        assert role(replica) == active.address, "the replica was not promoted"
        # The same origin, or a tool saying it is no browser, is taken.
        code, _, body = admin_post(
            replica, "/promote", {"Origin": f"http://localhost:{port}", "X-Sluice-Request": "1"}
        )
        assert code == 200 and len(json.loads(body)["promoted"][0]["vbuckets"]) == 64
        assert role(replica) is None
    finally:
        assert replica.stop() == 0 and active.stop() == 0


def test_an_admin_endpoint_beyond_loopback_needs_users_or_insecure(tmp_path):

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sluice",
            "serve",
            "--data-dir",
            str(tmp_path / "d"),
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "0.0.0.0:0",
            *FRONTS_OFF,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "admin_listen: 0.0.0.0:0 is beyond loopback" in r.stderr and "--insecure" in r.stderr
    node = Node(tmp_path / "d", "--admin-listen", "0.0.0.0:0", "--insecure")
    try:
        node.admin = "127.0.0.1:" + node.admin.rsplit(":", 1)[1]
        assert node.status()["buckets"]
        # Even from loopback: without users nothing on a reachable endpoint vouches for the caller.
        code, _, body = admin_post(node, "/promote", {"X-Sluice-Request": "1"})
        assert code == 403 and "no users are configured" in body
        assert refused(node)["not_loopback"] == 1
        token = (tmp_path / "d" / "admin.token").read_text().strip()
        assert admin_post(node, "/promote", {"Authorization": f"Bearer {token}"})[0] == 200
    finally:
        assert node.stop() == 0


def test_bad_requests_get_bounded_answers(server):
    import socket

    def exchange(data: bytes) -> bytes:
        host, port = server.admin.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(data)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out

    assert exchange(b"GET /status HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 9000 + b"\r\n\r\n").startswith(
        b"HTTP/1.1 431"
    )
    assert exchange(b"GET /status\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert exchange(b"POST /promote HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n").startswith(
        b"HTTP/1.1 413"
    )
    assert exchange(b"POST /promote HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n").startswith(
        b"HTTP/1.1 501"
    )
    # A body within the limit is read (and ignored) before the answer.
    ok = exchange(b"POST /promote HTTP/1.1\r\nX-Sluice-Request: 1\r\nContent-Length: 5\r\n\r\nab" + b"cde")
    assert ok.startswith(b"HTTP/1.1 200") and b'"promoted"' in ok


def test_fault_injection_is_off_unless_the_node_was_started_with_it(tmp_path, clocked_server):
    server = Node(tmp_path / "plain")
    token = (server.data_dir / "admin.token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}", "X-Sluice-Request": "1"}
    code, _, body = admin_post(server, "/errinj?name=clock_offset_secs&value=5", headers)
    assert code == 404 and "SLUICE_ERRINJ" in body
    assert clocked_server.inject("clock_offset_secs", 5)["clock_offset_secs"] == 5
    token = (clocked_server.data_dir / "admin.token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}", "X-Sluice-Request": "1"}
    code, _, body = admin_post(clocked_server, "/errinj?name=no_such_point&value=1", headers)
    assert code == 400 and "wal_write_delay_ms" in body
    # Setting one needs the admin's credentials like any other change.
    assert admin_post(clocked_server, "/errinj?name=clock_offset_secs&value=0")[0] in (401, 403)
    assert server.stop() == 0
