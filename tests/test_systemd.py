"""systemd integration: the sd_notify datagrams `sluice serve` sends to a socket the test binds
as NOTIFY_SOCKET, SIGHUP, and the deploy files."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers import NO_DEFAULT_PORTS, wait_or_dump

REPO = Path(__file__).resolve().parent.parent


def receive(sock: socket.socket, until: str, timeout: float = 30) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if until in got[-1]:
            return got
    raise AssertionError(f"no {until!r} in {got}")


def test_ready_status_watchdog_and_stopping(tmp_path):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="600000")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sluice",
                "serve",
                "--data-dir",
                str(tmp_path / "d"),
                *NO_DEFAULT_PORTS,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            msgs = receive(sock, "READY=1")
            assert msgs[0].startswith("STATUS=recovering"), "a status while recovering comes first"
            ready = msgs[-1].split("\n")
            assert "READY=1" in ready and any(m.startswith("STATUS=serving on 127.0.0.1:") for m in ready)
            assert f"MAINPID={proc.pid}" in ready
            pings = receive(sock, "WATCHDOG=1", timeout=5)
            assert pings[-1] == "WATCHDOG=1", "pinged at half of WatchdogSec"
            proc.send_signal(signal.SIGTERM)
            stopping = receive(sock, "STOPPING=1")
            assert "STATUS=finishing requests and flushing the WAL" in stopping[-1]
            assert wait_or_dump(proc, 60, proc.stderr.read) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def test_sighup_reports_what_changed(tmp_path):
    from helpers import Node

    cfg = tmp_path / "sluice.toml"
    cfg.write_text('[wal]\nmode = "write"\n')
    node = Node(tmp_path / "d", "--config", str(cfg))
    try:
        cfg.write_text('[wal]\nmode = "fsync"\n')
        node.proc.send_signal(signal.SIGHUP)
        assert "wal.mode changed; these take effect after a restart" in node.wait_for("reload:")
        cfg.write_text("[wal]\nmode = 3\n")
        node.proc.send_signal(signal.SIGHUP)
        line = node.wait_for("reload:")
        assert "not valid, keeping the running one" in line and "wal.mode" in line
    finally:
        assert node.stop() == 0


def test_deploy_files_match_the_configuration_definitions():
    example = subprocess.run(
        [sys.executable, "-m", "sluice", "config", "example", "--data-dir", "/var/lib/sluice"],
        capture_output=True,
        text=True,
    )
    assert (REPO / "deploy" / "sluice.toml").read_text() == example.stdout, (
        "regenerate: sluice config example --data-dir /var/lib/sluice > deploy/sluice.toml"
    )
    check = subprocess.run(
        [sys.executable, "-m", "sluice", "config", "check", str(REPO / "deploy" / "sluice.toml")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr
    unit = (REPO / "deploy" / "sluice.service").read_text()
    for line in (
        "Type=notify",
        "WatchdogSec=",
        "ProtectSystem=strict",
        "User=sluice",
        "ReadWritePaths=/var/lib/sluice",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "--config /etc/sluice/sluice.toml",
    ):
        assert line in unit
