"""TLS for sluice's Python clients: a connection to a front's TLS port, its certificate checked
against a CA file and the host connected to."""

from __future__ import annotations

import socket
import ssl


def client_context(cafile: str) -> ssl.SSLContext:
    """A client context that trusts the CAs in ``cafile`` (PEM) and checks the server's name."""
    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cafile {cafile}: cannot read the CA certificates: {e}") from None


def server_name(address: str) -> str:
    """The name a server's certificate must carry: the host of HOST:PORT."""
    return address.rpartition(":")[0].strip("[]")


def connect(address: str, timeout: float, cafile: str | None) -> socket.socket:
    """A TCP connection to HOST:PORT with TCP_NODELAY, inside TLS when ``cafile`` is given (the
    handshake done within ``timeout``)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if cafile is None:
        return sock
    try:
        return client_context(cafile).wrap_socket(sock, server_hostname=server_name(address))
    except BaseException:
        sock.close()
        raise
