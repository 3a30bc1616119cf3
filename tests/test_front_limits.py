"""The bounds before login hold on every port alike, because one connection driver runs every
front's connections: anonymous connections to any front count against `max_unauthenticated`
(so they cannot fill `max_connections` and lock out a client that logs in, on any port), and a
frame over the pre-login limit closes the connection before its body is buffered. TANK has no
login: on a node with users its connections are anonymous unless `[users.guest]` exists."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import pytest
import sluice
import sluice.tank
from helpers import Node
from mcbp_wire import login

# max_connections is above max_unauthenticated: anonymous connections can never take the last
# slots.
LIMITS = "\n".join(
    [
        "max_connections = 12",
        "max_unauthenticated = 8",
        "max_unauthenticated_per_ip = 6",
        'login_timeout = "20s"',
    ]
)


def start(tmp_path: Path, *, guest: bool = False) -> Node:
    tmp_path.mkdir(parents=True, exist_ok=True)
    h = sluice.config.hash_password("ada-secret", iterations=1000)
    lines = [
        LIMITS,
        "[users.ada]",
        f'password_hash = "{h}"',
        'buckets = { "*" = ["read", "write", "stream"] }',
    ]
    if guest:
        lines += [
            "[users.guest]",
            'buckets = { "*" = ["read", "write"] }',
            'topics = { "*" = ["read", "write", "admin"] }',
        ]
    cfg = tmp_path / "sluice.toml"
    cfg.write_text("\n".join(lines) + "\n")
    return Node(tmp_path / "d", "--config", str(cfg))


def address(node: Node, front: str) -> tuple[str, int]:
    fronts = {"kv": node.address, "iproto": node.iproto, "tank": node.tank, "greenstack": node.greenstack}
    text = fronts[front]
    host, _, port = text.rpartition(":")
    return host, int(port)


def closed_by_server(s: socket.socket, within: float) -> bool:
    """Whether the server closes `s` within `within` seconds (what it sent first is read over)."""
    s.settimeout(within)
    try:
        while True:
            if s.recv(65536) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


# What each front's client sends first: a frame head that declares a body of `n` bytes.
def oversized(front: str, n: int) -> bytes:
    if front == "kv":
        # A SET whose total body length is n.
        return struct.pack(">BBHBBHIIQ", 0x80, 0x01, 1, 8, 0, 0, n, 0, 0)
    if front == "iproto":
        # A MessagePack uint32 length prefix.
        return b"\xce" + struct.pack(">I", n)
    if front == "tank":
        # A produce (message id 0x1) whose payload is n bytes (little-endian length).
        return b"\x01" + struct.pack("<I", n)
    # Greenstack: a 4-byte big-endian body length.
    return struct.pack(">I", n)


FRONTS = ["kv", "iproto", "tank", "greenstack"]


@pytest.mark.parametrize("front", FRONTS)
def test_anonymous_connections_to_a_front_cannot_lock_out_a_client_that_logs_in(tmp_path, front):
    node = start(tmp_path)
    try:
        held = [socket.create_connection(address(node, front), timeout=10) for _ in range(12)]
        # The first six hold their address's pre-login slots; the others are closed at accept.
        closed = [closed_by_server(s, 1.0) for s in held]
        assert closed.count(True) == 6, closed
        assert node.metric("sluice_prelogin_closed_total", reason="max_unauthenticated_per_ip") == 6
        # A client from another address still gets in and logs in, on the memcached port.
        member = socket.create_connection((node.host, node.port), timeout=10, source_address=("127.0.0.2", 0))
        assert login(member, "ada", "ada-secret") == 0
        member.close()
        for s in held:
            s.close()
    finally:
        node.stop()


@pytest.mark.parametrize("front", FRONTS)
def test_a_frame_over_the_prelogin_limit_closes_the_connection(tmp_path, front):
    node = start(tmp_path)
    try:
        s = socket.create_connection(address(node, front), timeout=10)
        s.sendall(oversized(front, 60 << 20))
        assert closed_by_server(s, 10), "the connection stayed open"
        assert node.metric("sluice_prelogin_closed_total", reason="frame_too_big") == 1
        assert node.rss_bytes() < 200 << 20
    finally:
        node.stop()


def test_with_a_guest_an_anonymous_iproto_connection_is_served_past_the_prelogin_limit(tmp_path):
    """Where anonymous clients are served as guest (iproto before AUTH), a node with
    `[users.guest]` holds them to the limits of a logged-in client: a packet over the pre-login
    limit is taken (and answered by the protocol), not a reason to close."""
    node = start(tmp_path, guest=True)
    try:
        s = socket.create_connection(address(node, "iproto"), timeout=10)
        # A request whose body does not decode: answered with an error, not closed.
        s.sendall(oversized("iproto", 8000) + b"\x00" * 8000)
        assert not closed_by_server(s, 1.5)
        assert node.metric("sluice_prelogin_closed_total", reason="frame_too_big") == 0
        assert node.metric("sluice_unauthenticated_connections") == 0
    finally:
        node.stop()


def test_tank_clients_are_anonymous_unless_the_node_has_a_guest(tmp_path):
    """TANK has no login: on a node with users and a guest, a TANK client produces and consumes
    bundles of any size as guest; without a guest it is held to the pre-login bounds, and a
    bundle over the pre-login limit closes its connection."""
    with_guest = start(tmp_path / "a", guest=True)
    try:
        with sluice.tank.TankConnection(with_guest.tank) as c:
            c.create_topic("t")
            c.produce("t", [b"x" * 8000])
            assert [m.content for m in c.consume("t").messages] == [b"x" * 8000]
        assert with_guest.metric("sluice_unauthenticated_connections") == 0
    finally:
        with_guest.stop()
    without = start(tmp_path / "b")
    try:
        with sluice.tank.TankConnection(without.tank) as c:
            with pytest.raises((sluice.tank.TankError, ConnectionError, OSError)):
                c.produce("t", [b"x" * 8000])
        assert without.metric("sluice_prelogin_closed_total", reason="frame_too_big") == 1
    finally:
        without.stop()


@pytest.mark.parametrize("front", ["kv", "iproto", "tank", "greenstack"])
def test_closed_connections_give_their_memory_back(tmp_path, front):
    """Hundreds of idle connections to a front, then closed: the node's resident memory comes
    back to where it was, rounds after rounds (what a connection holds is freed with it)."""
    node = Node(tmp_path / "d")
    try:
        host, port = address(node, front)
        before = node.rss_bytes()
        for _ in range(3):
            socks = [socket.create_connection((host, port), timeout=10) for _ in range(600)]
            for s in socks:
                s.close()
            time.sleep(2.5)  # freed pages go back to the OS after mimalloc's purge delay
        after = node.rss_bytes()
        assert after - before < 8 << 20, f"{front}: {before >> 20} MiB before, {after >> 20} MiB after"
    finally:
        assert node.stop() == 0
