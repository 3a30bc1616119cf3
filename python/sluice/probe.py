"""What answers at an address: a node's KV port, its admin endpoint, an iproto, TANK or Greenstack
listener, another HTTP server, a port that accepts and says nothing, or nothing at all. The
commands ask when a call fails (and `bench` and `tarantool-tail` before they start, as their
native loops would wait on a port that never answers), so that a command pointed at the wrong
port says in one line what it reached and what it expected."""

from __future__ import annotations

import dataclasses
import socket

from sluice import _native
from sluice.options import default_of

# One request that every kind answers differently: an HTTP server with a status line, a
# memcached port (sluice's KV port, which also speaks the text protocol) with ERROR or
# CLIENT_ERROR; iproto and TANK greet before reading anything; Greenstack and a port that
# accepts and says nothing stay silent, or close.
_HTTP_GET = b"GET /status HTTP/1.0\r\nHost: sluice\r\nX-Sluice-Request: 1\r\n\r\n"
_TANK_PING = b"\x03\x00\x00\x00\x00"  # TANK's greeting: a Ping frame (id 3, empty)
_MEMCACHED_TEXT_REPLIES = (b"ERROR", b"CLIENT_ERROR", b"SERVER_ERROR")


def _front_default(name: str) -> str:
    return next(f["default_listen"] for f in _native.FRONTS if f["name"] == name)


# What each kind is called when it is what a command reached.
REACHED = {
    "kv": "a KV port (it answers the memcached protocol)",
    "admin": "a node's admin endpoint (HTTP)",
    "http": "an HTTP server",
    "iproto": "an iproto port (it greets as Tarantool)",
    "tank": "a TANK listener (it greets with TANK's ping)",
    "greenstack": "a Greenstack listener (it answers Greenstack's HELLO)",
    "tls": "a TLS port (it answers plain text with a TLS alert)",
}

# What each kind is called when it is what a command expects: with where a node serves it.
EXPECTED = {
    "kv": f"a memcached port (a node's listen, default {_front_default('memcached')})",
    "admin": f"a node's admin endpoint (admin_listen, default {default_of('admin_listen')})",
    "iproto": "an iproto port (a Tarantool's, or a node's iproto_listen, default "
    f"{_front_default('iproto')})",
    "tank": f"a TANK listener (a node's tank_listen, default {_front_default('tank')})",
    "greenstack": "a Greenstack listener (a node's greenstack_listen, default "
    f"{_front_default('greenstack')})",
}


@dataclasses.dataclass(frozen=True)
class Reached:
    """What answered: a kind of REACHED, or "refused" (nothing listens), "unreachable" (no
    connection: `detail` says why), "silent" (accepted, said nothing), "closed" (accepted and
    closed without a word), "other" (`detail`: the first bytes it sent)."""

    kind: str
    detail: str = ""


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    return host.strip("[]"), int(port)


def _exchange(address: str, request: bytes, timeout: float, greeting_wait: float = 0.0) -> bytes | None:
    """Sends `request` and returns the first bytes answered (b"" when the peer closes without a
    word), None when nothing came within `timeout`; a greeting sent within `greeting_wait` is
    the answer, and nothing is sent. A failure to connect raises OSError."""
    with socket.create_connection(_split(address), timeout=timeout) as s:
        try:
            if greeting_wait:
                s.settimeout(greeting_wait)
                try:
                    return s.recv(4096)
                except TimeoutError:
                    s.settimeout(timeout)
            s.sendall(request)
            data = s.recv(4096)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return b""
        if data.startswith(b"HTTP/"):
            # The body tells a node's admin endpoint from another HTTP server: read on a little.
            try:
                while len(data) < 1 << 16 and (chunk := s.recv(4096)):
                    data += chunk
            except OSError:
                pass
        return data


def probe(address: str, timeout: float = 2.0, greeting_wait: float = 0.0) -> Reached:
    """What answers at HOST:PORT (an http:// or https:// prefix is ignored), waiting up to
    `timeout` seconds for each answer. With `greeting_wait`, a greeting (iproto's, TANK's) is
    waited for that long before anything is sent, which a Tarantool would log as a bad request."""
    try:
        data = _exchange(address, _HTTP_GET, timeout, greeting_wait)
    except ConnectionRefusedError:
        return Reached("refused")
    except (OSError, ValueError) as e:
        return Reached("unreachable", getattr(e, "strerror", None) or str(e))
    if data is None:
        return Reached("silent")
    if data.startswith(b"Tarantool"):
        return Reached("iproto")
    if data.startswith(_TANK_PING):
        return Reached("tank")
    if data.startswith(_MEMCACHED_TEXT_REPLIES):
        return Reached("kv")
    if data.startswith(b"\x15\x03"):  # a TLS record: an alert
        return Reached("tls")
    if data.startswith(b"HTTP/"):
        sluice_admin = b'"instance"' in data or b"/metrics or /status" in data
        return Reached(
            "admin" if sluice_admin else "http", data.split(b"\r\n", 1)[0].decode(errors="replace")
        )
    if data:
        return Reached("other", repr(data[:16]))
    # Greenstack closes on a request it cannot frame: asked its own HELLO, it answers.
    from sluice.greenstack import HELLO, ProtocolViolation, decode_frame, encode_frame

    try:
        reply = _exchange(address, encode_frame(1, HELLO, {"user_agent": "sluice-probe"}), timeout)
        if reply and decode_frame(reply[4:]).opcode == HELLO:
            return Reached("greenstack")
    except (OSError, ProtocolViolation):
        pass
    return Reached("closed")


def mismatch(address: str, expected: str, timeout: float = 2.0, wanted: str | None = None) -> str | None:
    """One line saying what answers at `address` when it is not what a command expects (a kind
    of EXPECTED; `wanted` says it otherwise), or None when it is (the command's own error then
    says what went wrong)."""
    # Sent nothing, a Tarantool's log shows no bad request for a command that expects one.
    reached = probe(address, timeout, greeting_wait=0.5 if expected == "iproto" else 0.0)
    wanted = wanted or EXPECTED[expected]
    if reached.kind == expected or (
        expected == "admin" and reached.kind == "http" and "401" in reached.detail
    ):
        return None
    if reached.kind == "refused":
        return f"nothing listens at {address} (connection refused); expected {wanted}"
    if reached.kind == "unreachable":
        return f"cannot reach {address} ({reached.detail}); expected {wanted}"
    if reached.kind == "silent":
        return (
            f"{address} accepted the connection and answered nothing within {timeout:g} s: it is not {wanted}"
        )
    if reached.kind == "closed":
        return f"{address} closed the connection without an answer: it is not {wanted}"
    if reached.kind == "other":
        return f"{address} answered {reached.detail}, which is not {wanted}"
    if reached.kind == "http":
        return f"{address} is an HTTP server ({reached.detail} for GET /status), not {wanted}"
    return f"{address} is {REACHED[reached.kind]}, not {wanted}"
