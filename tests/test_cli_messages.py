"""What the `sluice` command says when it is used the wrong way or on the wrong node: each
message names the culprit (the listener, the port, the file, the node's role) and every help
text shows its defaults."""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import os
import pty
import re
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import bmemcached
import pytest
import sluice
from helpers import FRONTS_OFF, NO_DEFAULT_PORTS, Node, run_cli, start_node, wait_converged

REPO = Path(__file__).resolve().parent.parent


def flat(text: str) -> str:
    """Help text with argparse's line wrapping undone."""
    return " ".join(text.split())


def test_serve_help_shows_every_default():
    r = run_cli("serve", "--help")
    assert r.returncode == 0, r.stderr
    out = flat(r.stdout)
    defaults = sluice._native.DEFAULTS
    assert "--listen HOST:PORT overrides listen (default: 127.0.0.1:11210)" in out
    assert 'overrides admin_listen ("" turns it off; default: 127.0.0.1:11280)' in out
    assert f"overrides data_dir (default: ./{defaults['data_dir']})" in out
    assert "no TLS listener" in out and "tls.certificate" in out
    assert "default: none, the node is active" in out


@pytest.mark.parametrize(
    "command, shown",
    [
        ("tail", ["--from {beginning,now}", "(default: now)", "(default: default)", "(default: json)"]),
        (
            "bench",
            ["client connections (default: 16)", "(default: 32)", "(default: 10.0)", "(default: 0.9)"],
        ),
        ("status", ["seconds to wait for the node (default: 10.0)"]),
    ],
)
def test_help_shows_the_defaults(command, shown):
    r = run_cli(command, "--help")
    assert r.returncode == 0, r.stderr
    for text in shown:
        assert text in flat(r.stdout), r.stdout
    assert "(default: None)" not in r.stdout and "(default: False)" not in r.stdout


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"sluice {sluice.__version__}"


def test_a_listener_that_cannot_bind_names_itself(tmp_path, server):
    # A second node whose only clash is the admin port (two nodes on one machine, defaults).
    r = run_cli(
        "serve",
        "--data-dir",
        str(tmp_path / "second"),
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        server.admin,
        *FRONTS_OFF,
    )
    assert r.returncode == 1
    assert f"admin listener {server.admin} (admin_listen): Address already in use" in r.stderr, r.stderr
    hint = '(another node on this machine? give this one --admin-listen HOST:PORT, or --admin-listen ""'
    assert hint in r.stderr, r.stderr
    r = run_cli(
        "serve",
        "--data-dir",
        str(tmp_path / "third"),
        "--listen",
        server.address,
        "--admin-listen",
        "",
        *FRONTS_OFF,
    )
    assert r.returncode == 1
    assert f"memcached listener {server.address} (listen): Address already in use" in r.stderr, r.stderr
    assert "give this one --listen HOST:PORT)" in r.stderr, r.stderr


def test_promote_on_a_node_that_follows_no_one_says_so(server):
    r = run_cli("promote", "--admin", server.admin)
    assert r.returncode == 1
    assert "follows no node" in r.stderr and "nothing to promote" in r.stderr, r.stderr
    assert "promoted" not in r.stdout
    assert {v["state"] for v in server.status()["buckets"][0]["vbuckets"]} == {"active"}


def test_move_vbucket_given_kv_ports_asks_for_admin_endpoints(server):
    r = run_cli("move-vbucket", "--vb", "0", "--from", server.address, "--to", server.admin, timeout=60)
    assert r.returncode == 1
    assert f"the source: {server.address} is a KV port" in r.stderr, r.stderr
    assert "admin_listen" in r.stderr
    r = run_cli("move-vbucket", "--vb", "0", "--from", server.admin, "--to", server.address, timeout=60)
    assert r.returncode == 1 and f"the target: {server.address} is a KV port" in r.stderr, r.stderr
    assert {v["state"] for v in server.status()["buckets"][0]["vbuckets"]} == {"active"}


def test_wal_dump_names_a_foreign_file(tmp_path):
    r = run_cli("wal-dump", str(REPO / "README.md"))
    assert r.returncode == 1
    assert "README.md is not a sluice WAL segment or snapshot" in r.stderr, r.stderr
    assert "Some(" not in r.stderr and "Traceback" not in r.stderr
    vinyl = tmp_path / "00000000000000000000.run"
    vinyl.write_bytes(b"RUN\n0.13\nVersion: 2.6.0\nInstance: 1\nVClock: {}\n\n")
    r = run_cli("wal-dump", str(vinyl))
    assert r.returncode == 1 and "is a Tarantool RUN file (vinyl's), which sluice does not read" in r.stderr
    old = tmp_path / "00000000000000000000.xlog"
    old.write_bytes(b"XLOG\n0.11\nVersion: 1.5\nVClock: {}\n\n")
    r = run_cli("wal-dump", str(old))
    assert r.returncode == 1, r.stderr
    assert 'format version "0.11": this reader knows 0.12 and 0.13' in r.stderr, r.stderr


def test_config_example_shows_defaults_only():
    r = run_cli("config", "example")
    assert r.returncode == 0, r.stderr
    assert f'# data_dir = "{sluice._native.DEFAULTS["data_dir"]}"' in r.stdout
    set_keys = [line for line in r.stdout.splitlines() if line and not line.startswith(("#", "["))]
    assert set_keys == [], "config example sets keys although it shows defaults only"
    service = run_cli("config", "example", "--data-dir", "/var/lib/sluice")
    assert 'data_dir = "/var/lib/sluice"' in service.stdout.splitlines()


def _on_a_terminal(args: list[str], answers: list[str], timeout: float = 30) -> tuple[int, str]:
    """Runs the command with a pseudo-terminal as its controlling terminal, typing each answer
    after a prompt; returns the exit code and everything the terminal showed."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its stdin, stdout, stderr and /dev/tty
        os.execv(sys.executable, [sys.executable, "-m", "sluice", *args])
    shown = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                shown += chunk
                # A prompt ends what the child wrote; typing earlier would be flushed away.
                if answers and chunk.endswith(b": "):
                    os.write(fd, answers.pop(0).encode() + b"\n")
        else:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), shown.decode(errors="replace")


def test_user_hash_asks_twice_on_a_terminal():
    code, shown = _on_a_terminal(["user", "hash"], ["s3cret", "s3cert"])
    assert code == 2 and "password again:" in shown and "the passwords differ" in shown, shown
    assert "scram-sha" not in shown
    code, shown = _on_a_terminal(["user", "hash"], ["s3cret", "s3cret"])
    assert code == 0, shown
    line = next(line for line in shown.splitlines() if line.startswith("scram_sha512 = "))
    _, iterations, salt, stored, _server = line.split('"')[1].split(":")
    # RFC 5802: StoredKey = H(HMAC(SaltedPassword, "Client Key")).
    salted = hashlib.pbkdf2_hmac("sha512", b"s3cret", bytes.fromhex(salt), int(iterations))
    client_key = hmac.new(salted, b"Client Key", "sha512").digest()
    assert hashlib.sha512(client_key).hexdigest() == stored, "the keys printed are of the password typed"


def test_a_replica_node_explains_itself(tmp_path):
    """The replica's ready line names its active; `tail` on the replica streams what it
    replicates; `status` on the active names followers and explains `synced` in write mode."""
    active = start_node(tmp_path, "a")
    replica: Node | None = None
    try:
        replica = start_node(tmp_path, "r", "--replica-of", active.address)
        assert f"replica of {active.address};" in "".join(replica.lines), replica.lines
        keys = {f"k{i}": f"v{i}" for i in range(40)}
        client = bmemcached.Client([active.address])
        for k, v in keys.items():
            assert client.set(k, v)
        wait_converged(active, replica)
        r = run_cli("tail", "--address", replica.address, "--from", "beginning", "--until-now")
        assert r.returncode == 0, r.stderr
        assert f"{replica.address} has no active vbucket" in r.stderr and "it replicates" in r.stderr
        streamed = {json.loads(line)["key"] for line in r.stdout.splitlines()}
        assert streamed == set(keys), r.stdout[-2000:]
        r = run_cli("status", "--admin", active.admin)
        assert r.returncode == 0, r.stderr
        # Whatever the synced LSN is (0 until a segment closes or a write asks to persist), it
        # comes with what it means in this mode.
        assert re.search(r"synced \d+ \(wal\.mode=write syncs only writes asking to persist\)", r.stdout), (
            r.stdout
        )
        instance = replica.status()["instance"]
        assert f"replica {instance[:12]} at {replica.address} acked" in r.stdout, r.stdout
        assert "followers are named by replica instance id" in r.stdout
        # Caught up, the replica is behind by nothing, in seqnos and in time.
        deadline = time.monotonic() + 10
        while True:
            r = run_cli("status", "--admin", replica.admin)
            assert r.returncode == 0, r.stderr
            lags = re.findall(r"lag (\d+) seqnos, ([\d.]+) ms", r.stdout)
            if lags and all(s == "0" and float(ms) == 0 for s, ms in lags):
                break
            assert time.monotonic() < deadline, r.stdout
            time.sleep(0.2)
    finally:
        if replica is not None:
            replica.stop()
        active.stop()


def test_tail_on_an_active_node_is_unchanged(server):
    client = bmemcached.Client([server.address])
    assert client.set("x", "1")
    r = run_cli("tail", "--address", server.address, "--from", "beginning", "--until-now")
    assert r.returncode == 0 and '"key": "x"' in r.stdout and "replicates" not in r.stderr, r


def test_an_unreadable_etcd_password_file_is_named_not_a_traceback(tmp_path):
    missing = tmp_path / "etcd.pw"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[cluster]\netcd = "etcd://127.0.0.1:1/c1"\netcd_password_file = "{missing}"\n')
    r = run_cli("serve", "--config", str(cfg), "--data-dir", str(tmp_path / "d"), *NO_DEFAULT_PORTS)
    assert r.returncode == 2, r.stderr
    assert f"cluster.etcd_password_file: cannot read {missing}" in r.stderr and "Traceback" not in r.stderr
    url = "etcd://127.0.0.1:1/c1"
    r = run_cli("cluster", "status", "--cluster", url, "--etcd-password-file", str(missing))
    assert r.returncode == 2, r.stderr
    assert f"--etcd-password-file: cannot read {missing}" in r.stderr and "Traceback" not in r.stderr


def test_commands_pointed_at_the_wrong_port_say_so_at_once(server):
    """`sluice status` given the KV port, and `sluice topic list` given a port that is not a TANK
    listener, name the mistake in one line (no traceback, no wait for a timeout)."""
    r = run_cli("status", "--admin", server.address, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{server.address} is a KV port" in r.stderr and "admin_listen" in r.stderr, r.stderr
    took = time.monotonic()
    r = run_cli("topic", "list", "--address", server.address, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "not a TANK listener" in r.stderr and "tank_listen" in r.stderr, r.stderr
    assert time.monotonic() - took < 8
    r = run_cli("topic", "create", "t", "--settings", "log.retention.bytes=abc", "--address", server.tank)
    assert r.returncode == 2, r.stderr
    assert 'log.retention.bytes: "abc" is not a whole number' in r.stderr, r.stderr


def test_config_check_refuses_what_serve_refuses(tmp_path):
    """A file the configuration names that serve cannot use, and a data_dir that is a file, are
    refused by `sluice config check` and `serve` alike, naming the key."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = {
        '[replication]\nuser = "r"\npassword_file = "/nonexistent/pw"\n': "replication.password_file",
        '[tls]\ncertificate = "/nonexistent/c.pem"\nkey = "/nonexistent/k.pem"\n': "tls.certificate",
        f'[tls]\ncertificate = "{a_file}"\nkey = "{a_file}"\n': "tls.certificate",
        f'data_dir = "{a_file}"\n': "data_dir",
    }
    for text, key in cases.items():
        cfg = tmp_path / "c.toml"
        cfg.write_text(text)
        r = run_cli("config", "check", str(cfg))
        assert r.returncode == 2 and f"invalid config: {key}:" in r.stderr, (text, r.stderr)
        off = ("--admin-listen", "", *FRONTS_OFF)
        r = run_cli("serve", "--config", str(cfg), "--listen", "127.0.0.1:0", *off, timeout=60)
        assert r.returncode == 2 and f"invalid config: {key}:" in r.stderr, (text, r.stderr)


def test_tail_on_a_node_with_users_says_to_log_in(tmp_path):
    from test_permissions import users_config

    node = start_node(tmp_path, "n", extra=users_config({"reader": ["read"]}))
    try:
        r = run_cli("tail", "--address", node.address, "--until-now", timeout=60)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "pass --user NAME" in r.stderr and "stream permission" in r.stderr, r.stderr
    finally:
        node.stop()


# --- Every client command pointed at the wrong port or the wrong kind of server -------------

# What each kind of wrong target is called when a command reaches it.
REACHED = {
    "kv": "is a KV port (it answers the memcached protocol)",
    "admin": "is a node's admin endpoint (HTTP)",
    "iproto": "is an iproto port (it greets as Tarantool)",
    "tank": "is a TANK listener",
    "greenstack": "is a Greenstack listener",
    "closed": "nothing listens at",
    "silent": "accepted the connection and answered nothing within",
    "http": "is an HTTP server (HTTP/1.0 404",
}
ADMIN = "a node's admin endpoint (admin_listen, default 127.0.0.1:11280)"
KV = "a memcached port (a node's listen, default 127.0.0.1:11210)"
TANK = "a TANK listener (a node's tank_listen, default 127.0.0.1:11011)"
IPROTO = "an iproto port (a Tarantool's, or a node's iproto_listen, default 127.0.0.1:3301)"
GREENSTACK = "a Greenstack listener (a node's greenstack_listen, default 127.0.0.1:11220)"
TARANTOOL = "a Tarantool's iproto port"
ETCD = "an etcd client endpoint"
ONE_REQUEST = ("--count", "10", "--connections", "1", "--threads", "1", "--keys", "10")

# (the command given the target's address as {}, what it expects, the wrong targets tried).
WRONG_TARGETS = [
    (("status", "--admin", "{}", "--timeout", "3"), ADMIN, REACHED.keys() - {"admin"}),
    (("promote", "--admin", "{}", "--timeout", "3"), ADMIN, ["kv", "greenstack", "http"]),
    (("move-vbucket", "--vb", "0", "--from", "{}", "--to", "{admin}"), ADMIN, ["tank", "closed"]),
    (("move-vbucket", "--vb", "0", "--from", "{admin}", "--to", "{}"), ADMIN, ["iproto", "http"]),
    (("tail", "--address", "{}", "--until-now"), KV, ["admin", "iproto", "tank", "greenstack", "closed"]),
    (("tail", "--topic", "t", "--address", "{}", "--until-now"), TANK, ["kv", "admin", "silent"]),
    (("topic", "list", "--address", "{}"), TANK, ["kv", "greenstack", "closed", "http"]),
    (("topic", "create", "t", "--address", "{}"), TANK, ["iproto", "admin"]),
    (("bench", "--server", "{}", *ONE_REQUEST), KV, ["admin", "iproto", "tank", "silent", "closed"]),
    (("bench", "--protocol", "iproto", "--server", "{}", *ONE_REQUEST), IPROTO, ["kv", "greenstack"]),
    (("bench", "--protocol", "greenstack", "--server", "{}", *ONE_REQUEST), GREENSTACK, ["kv", "tank"]),
    (("cluster", "status", "--cluster", "etcd://{}/c1"), ETCD, ["kv", "admin", "closed"]),
    (
        ("tarantool-tail", "{}", "--timeout", "3", "--idle", "3", "--max", "1"),
        TARANTOOL,
        ["kv", "admin", "tank", "greenstack", "closed", "silent"],
    ),
]
CASES = [
    (command, expected, target) for command, expected, targets in WRONG_TARGETS for target in sorted(targets)
]


class _NotHere(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_error(404, "not here")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def wrong_targets(tmp_path_factory):
    """A node's every port, a port that refuses connections (bound, not listening), one that
    accepts them and says nothing (listening, never accepting) and an HTTP server that is not
    a node's, by name."""
    node = Node(tmp_path_factory.mktemp("wrong") / "node")
    closed, silent = socket.socket(), socket.socket()
    closed.bind(("127.0.0.1", 0))
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _NotHere)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield {
        "kv": node.address,
        "admin": node.admin,
        "iproto": node.iproto,
        "tank": node.tank,
        "greenstack": node.greenstack,
        "closed": f"127.0.0.1:{closed.getsockname()[1]}",
        "silent": f"127.0.0.1:{silent.getsockname()[1]}",
        "http": f"127.0.0.1:{httpd.server_address[1]}",
    }
    httpd.shutdown()
    closed.close()
    silent.close()
    assert node.stop() == 0, node.log()[-2000:]


@pytest.mark.parametrize(
    ("command", "expected", "target"), CASES, ids=[f"{' '.join(c[:2])}-{t}" for c, _, t in CASES]
)
def test_a_command_at_the_wrong_port_says_what_it_reached_and_expected(
    wrong_targets, command, expected, target
):
    address = wrong_targets[target]
    args = [a.format(address, admin=wrong_targets["admin"]) for a in command]
    r = run_cli(*args, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    said = [line for line in r.stderr.splitlines() if line.startswith("sluice")]
    assert len(said) == 1, r.stderr
    assert REACHED[target] in said[0] and expected in said[0], said[0]
    if target != "closed":
        assert address in said[0], said[0]


def test_tarantool_tail_at_a_nodes_iproto_port_says_it_does_not_replicate(wrong_targets):
    r = run_cli("tarantool-tail", wrong_targets["iproto"], "--timeout", "3", "--max", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert f"{wrong_targets['iproto']} speaks iproto but does not replicate" in last, last
    assert TARANTOOL in last


def test_a_data_dir_that_is_a_file_needs_a_directory(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for data_dir, said in (
        (a_file, f"data_dir: {a_file} is a file, not a directory"),
        (a_file / "d", f"data_dir: {a_file / 'd'}: {a_file} is a file, not a directory"),
    ):
        r = run_cli("serve", "--data-dir", str(data_dir), *NO_DEFAULT_PORTS)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1] == f"sluice: invalid config: {said}", r.stderr
