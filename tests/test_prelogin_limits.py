"""What a client costs before it logs in, on a real `sluice serve` with users configured: the
login deadline (a trickle does not extend it), the small pre-login frame limit (RSS stays flat),
caps on unauthenticated connections (in total and per address), SASL failures slowed down,
counted and alike for unknown users; and named TAP sessions capped in number and bytes and
expired on their grace period, REGISTERED_CLIENT ones too."""

from __future__ import annotations

import re
import socket
import struct
import time
from pathlib import Path

import pytest
import sluice
from helpers import Node, send_without_reading
from mcbp_wire import HEADER, NOOP, SET, connect, login, read_response, request, sasl_plain, set_extras
from tap_wire import BACKFILL, MUTATION, REGISTERED_CLIENT, SUPPORT_ACK, TapClient, ack

AUTH_ERROR, E2BIG, ETMPFAIL = 0x20, 0x03, 0x86


def start(
    tmp_path: Path, settings: str = "", *, users: tuple[str, ...] = ("ada",), iterations: int = 1000
) -> Node:
    """A node with users (each one's password is NAME-secret) and the given top-level settings."""
    cfg = tmp_path / "sluice.toml"
    lines = [settings]
    for name in users:
        h = sluice.config.hash_password(f"{name}-secret", iterations=iterations)
        lines += [
            f"[users.{name}]",
            f'password_hash = "{h}"',
            'buckets = { "*" = ["read", "write", "stream"] }',
        ]
    cfg.write_text("\n".join(lines) + "\n")
    return Node(tmp_path / "d", "--config", str(cfg))


def connect_from(node: Node, source: str) -> socket.socket:
    """A connection from another loopback address (Linux routes all of 127/8 to lo)."""
    return socket.create_connection((node.host, node.port), timeout=10, source_address=(source, 0))


def closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_silent_or_trickling_connection_is_closed_at_the_login_deadline(tmp_path):
    node = start(tmp_path, 'login_timeout = "1s"')
    try:
        silent, trickle, member = connect(node), connect(node), connect(node)
        assert login(member, "ada", "ada-secret") == 0
        start_at = time.monotonic()
        # A SET announcing 100 bytes of body, sent a byte at a time: each byte is activity, but
        # the deadline runs from accept.
        frame = request(SET, b"k", b"v" * 89, set_extras())
        trickle.settimeout(0.2)
        closed_at = None
        for b in frame:
            try:
                trickle.send(bytes([b]))
                if trickle.recv(1) == b"":
                    closed_at = time.monotonic()
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic()
                break
        assert closed_at is not None, "the trickle was closed before its frame was complete"
        assert 0.8 < closed_at - start_at < 5
        assert closed_by_server(silent, 5)
        member.sendall(request(NOOP))
        assert read_response(member)["status"] == 0, "a logged-in connection has no login deadline"
        assert node.metric("sluice_prelogin_closed_total", reason="login_timeout") == 2
        assert node.metric("sluice_unauthenticated_connections") == 0
        node.wait_for("not logged in within")
        for s in (silent, trickle, member):
            s.close()
    finally:
        assert node.stop() == 0


def test_a_connection_that_never_reads_its_replies_is_closed_at_the_login_deadline(tmp_path):
    """Before login, a client pipelining requests without reading the replies cannot keep its
    slot by keeping the server's send blocked: the deadline bounds sending too."""
    node = start(tmp_path, 'login_timeout = "1s"')
    try:
        s = connect(node)
        s.settimeout(1.0)
        send_without_reading(s, request(NOOP) * 20_000)
        deadline = time.monotonic() + 10
        while node.metric("sluice_unauthenticated_connections") != 0:
            assert time.monotonic() < deadline, "the connection kept its pre-login slot"
            time.sleep(0.1)
        assert node.metric("sluice_prelogin_closed_total", reason="login_timeout") == 1
        s.close()
    finally:
        assert node.stop() == 0


def test_a_big_frame_before_login_gets_e2big_and_memory_stays_flat(tmp_path):
    node = start(tmp_path, "max_unauthenticated_per_ip = 64")
    try:
        before = node.rss_bytes()
        socks = []
        # 50 connections, each announcing a 19 MiB SET and sending 4 MiB of it: buffered, that
        # would be 200 MiB; refused at the header, it is nothing.
        head = HEADER.pack(0x80, SET, 1, 8, 0, 0, 19 << 20, 7, 0)
        chunk = b"x" * (1 << 20)
        for _ in range(50):
            s = connect(node)
            try:
                s.sendall(head + set_extras() + b"k")
                for _ in range(4):
                    s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            socks.append(s)
        grown = node.rss_bytes() - before
        assert grown < 48 << 20, f"RSS grew by {grown >> 20} MiB"
        for s in socks:
            try:
                r = read_response(s)
                assert (r["status"], r["opaque"]) == (E2BIG, 7)
            except ConnectionResetError:
                pass  # the reply was lost to the reset our unread bytes caused
            assert closed_by_server(s, 5)
            s.close()
        assert node.metric("sluice_prelogin_closed_total", reason="frame_too_big") == 50
        # After login, the normal limit applies.
        with connect(node) as s:
            assert login(s, "ada", "ada-secret") == 0
            s.sendall(request(SET, b"big", b"v" * 100_000, set_extras()))
            assert read_response(s)["status"] == 0
    finally:
        assert node.stop() == 0


def test_unauthenticated_connections_are_capped_per_address_and_in_total(tmp_path):
    node = start(tmp_path, "max_unauthenticated = 5\nmax_unauthenticated_per_ip = 3")
    try:
        mine = [connect_from(node, "127.0.0.1") for _ in range(3)]
        for s in mine:
            s.sendall(request(NOOP))
            assert read_response(s)["status"] == 0
        over_ip = connect_from(node, "127.0.0.1")
        assert closed_by_server(over_ip, 5), "a 4th from one address is closed at once"
        # Another address still gets in and logs in: the guesser's address does not lock it out.
        other = connect_from(node, "127.0.0.2")
        assert login(other, "ada", "ada-secret") == 0
        more = [connect_from(node, "127.0.0.3") for _ in range(2)]
        for s in more:
            s.sendall(request(NOOP))
            assert read_response(s)["status"] == 0
        over_total = connect_from(node, "127.0.0.4")
        assert closed_by_server(over_total, 5), "past 5 unauthenticated in total, closed at once"
        # Logging in frees the slot.
        assert login(mine[0], "ada", "ada-secret") == 0
        again = connect_from(node, "127.0.0.4")
        again.sendall(request(NOOP))
        assert read_response(again)["status"] == 0
        assert node.metric("sluice_prelogin_closed_total", reason="max_unauthenticated_per_ip") == 1
        assert node.metric("sluice_prelogin_closed_total", reason="max_unauthenticated") == 1
        assert node.metric("sluice_unauthenticated_connections") == 5
        node.wait_for("connections are not logged in")
        for s in [*mine, *more, over_ip, other, over_total, again]:
            s.close()
    finally:
        assert node.stop() == 0


def test_wrong_passwords_are_slowed_down_counted_and_logged_once(tmp_path):
    node = start(tmp_path)
    try:
        with connect(node) as s:
            took = []
            for _ in range(4):
                t = time.monotonic()
                assert login(s, "ada", "wrong") == AUTH_ERROR
                took.append(time.monotonic() - t)
            # 0, then 100, 200, 400 ms before the password is checked.
            assert took[3] > 0.3 and took[3] > took[1] * 1.5, took
            assert node.metric("sluice_auth_failures_total") == 4
            # The right password, after its turn, still logs in.
            assert login(s, "ada", "ada-secret") == 0
        # Parallel guesses take their turns one after the other, each waiting on the failures
        # before it (the address's: 800 ms, 1.6 s, 3.2 s), rather than multiplying the rate.
        socks = [connect(node) for _ in range(3)]
        t = time.monotonic()
        for c in socks:
            c.sendall(sasl_plain("ada", "guess"))
        for c in socks:
            assert read_response(c)["status"] == AUTH_ERROR
            c.close()
        assert time.monotonic() - t > 4.0
        assert node.metric("sluice_auth_failures_total") == 7
        node.wait_for('failed SASL login for user "ada" from 127.0.0.1')
        with pytest.raises(AssertionError, match="no 'failed SASL login'"):
            node.wait_for("failed SASL login", timeout=0.5)  # one line per 10 s for all 7
    finally:
        assert node.stop() == 0


def test_an_unknown_user_takes_as_long_as_a_wrong_password(tmp_path):
    # A costly hash, so that checking one (or not) shows; each attempt from a fresh address and
    # for a fresh name, so that no backoff is in the way.
    users = ("u1", "u2", "u3", "u4", "u5")
    node = start(tmp_path, users=users, iterations=200_000)
    try:

        def attempt(source: str, user: str) -> float:
            with connect_from(node, source) as s:
                s.sendall(request(NOOP))
                read_response(s)
                t = time.monotonic()
                assert login(s, user, "wrong") == AUTH_ERROR
                return time.monotonic() - t

        known = sorted(attempt(f"127.0.1.{i}", u) for i, u in enumerate(users))
        unknown = sorted(attempt(f"127.0.2.{i}", f"nobody{i}") for i in range(len(users)))
        ratio = unknown[2] / known[2]
        assert 1 / 3 < ratio < 3, (known, unknown)
        assert node.metric("sluice_auth_failures_total") == 10
    finally:
        assert node.stop() == 0


def tap_start(tmp_path: Path, tap: str) -> Node:
    cfg = tmp_path / "tap.toml"
    cfg.write_text("[snapshot]\ninterval = 0\n[tap]\n" + tap + "\n")
    return Node(tmp_path / "d", "--config", str(cfg))


def tap_answer(c: TapClient) -> tuple[int, int, bytes]:
    """(magic, status, body) of what the server sends first after TAP_CONNECT."""
    c.sock.settimeout(10)
    r = read_response(c.sock)
    return r["magic"], r["status"], r["raw"][24:]


def test_named_tap_sessions_are_capped_and_registered_ones_expire(tmp_path):
    node = tap_start(tmp_path, 'max_sessions = 3\ngrace_period = "1s"')
    flags = BACKFILL | SUPPORT_ACK | REGISTERED_CLIENT
    since = struct.pack(">Q", 0)
    addr = (node.host, node.port)
    try:
        with connect(node) as s:  # something for each stream to send
            s.sendall(request(SET, b"k", b"v", set_extras()))
            assert read_response(s)["status"] == 0
        for i in range(3):
            c = TapClient(addr, f"reg-{i}".encode(), flags, since)
            assert tap_answer(c)[0] == 0x80, "a TAP stream starts"
            c.close()
        time.sleep(0.3)
        assert node.metric("sluice_tap_sessions_parked") == 3
        c = TapClient(addr, b"reg-new", flags, since)
        magic, st, why = tap_answer(c)
        assert (magic, st) == (0x81, ETMPFAIL) and b"tap.max_sessions" in why, why
        c.close()
        assert node.metric("sluice_tap_sessions_refused_total") == 1
        # An existing name may come back while its session is kept.
        c = TapClient(addr, b"reg-0", flags, since)
        assert tap_answer(c)[0] == 0x80
        c.close()
        # Registered sessions expire after the grace period like others; then new names fit.
        deadline = time.monotonic() + 10
        while node.metric("sluice_tap_sessions_parked") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert node.metric("sluice_tap_sessions_parked") == 0
        assert node.metric("sluice_tap_sessions_expired_total") == 3
        c = TapClient(addr, b"reg-new", flags, since)
        assert tap_answer(c)[0] == 0x80
        c.close()
    finally:
        assert node.stop() == 0


def test_a_tap_session_holds_at_most_max_unacked_bytes(tmp_path):
    node = tap_start(tmp_path, 'max_unacked_bytes = "64KiB"\nack_interval = 100000\nack_window = 100000')
    try:
        mc_sock = connect(node)
        for i in range(100):
            mc_sock.sendall(request(SET, f"k{i:03d}".encode(), b"v" * 4096, set_extras()))
            assert read_response(mc_sock)["status"] == 0
        mc_sock.close()
        c = TapClient((node.host, node.port), b"bytes", BACKFILL | SUPPORT_ACK, struct.pack(">Q", 0))
        got = c.drain(quiet=0.5)
        docs = [m for m in got if m.opcode == MUTATION]
        assert 10 <= len(docs) <= 20, f"paused at 64 KiB (16 values of 4 KiB), got {len(docs)}"
        assert got[-1].wants_ack, "the message that fills the window asks for an ACK"
        ack(c.sock, got[-1])
        more = [m for m in c.drain(quiet=0.5) if m.opcode == MUTATION]
        assert more, "an ACK opens the window again"
        c.close()
    finally:
        assert node.stop() == 0


@pytest.mark.parametrize(
    "setting, message",
    [
        ("max_unauthenticated = 0", "max_unauthenticated: 0 is below the minimum 1"),
        ('login_timeout = "0s"', "login_timeout: 0.0 is not in (0, 3600]"),
        ("[tap]\nmax_sessions = 0", "tap.max_sessions: 0 is not in 1..100000"),
    ],
)
def test_bad_limits_are_config_errors(tmp_path, setting, message):
    cfg = tmp_path / "c.toml"
    cfg.write_text(setting + "\n")
    with pytest.raises(sluice.ConfigError, match=re.escape(message)):
        sluice.config.load_config(cfg)
