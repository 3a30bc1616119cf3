"""sd_notify: readiness, status lines and watchdog pings for `Type=notify` units. A datagram to
$NOTIFY_SOCKET, no dependency; a no-op when the variable is unset (not under systemd)."""

from __future__ import annotations

import os
import socket


def notify(*lines: str) -> bool:
    """Sends `KEY=value` lines; returns whether there was a socket to send them to."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):  # abstract namespace
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall("\n".join(lines).encode())
    return True


def watchdog_interval() -> float | None:
    """Half the WatchdogSec systemd asked for (the recommended ping interval), if it asked."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
