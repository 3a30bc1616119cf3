"""A TCP proxy on 127.0.0.1 that injects network faults between two real processes: it cuts
connections, stalls them (bytes held, then delivered), throttles them (a slow link), slows
them (every chunk delayed), and drops them silently (bytes discarded, sockets left open, as
when a peer vanishes without a FIN)."""

from __future__ import annotations

import random
import select
import socket
import threading
import time


class FaultProxy:
    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._stalled_until = 0.0
        self._dropping = False
        self._rate = 0.0  # bytes per second per connection; 0: no limit
        self._latency = 0.0
        self._closed = False
        self.accepted = 0
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
                self.accepted += 1
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self._closed:
                if time.monotonic() < self._stalled_until:
                    time.sleep(0.005)
                    continue
                ready, _, _ = select.select([a, b], [], [], 0.05)
                for s in ready:
                    data = s.recv(4096 if self._rate else 65536)
                    if not data:
                        return
                    if self._dropping:
                        continue
                    if self._latency:
                        time.sleep(self._latency)
                    peers[s].sendall(data)
                    if self._rate:
                        time.sleep(len(data) / self._rate)
        except (OSError, ValueError):  # ValueError: cut() closed a socket under select()
            return
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass
            with self._lock:
                if (a, b) in self._pairs:
                    self._pairs.remove((a, b))

    def cut(self) -> None:
        """Closes every connection through the proxy now (both sides see a reset or EOF)."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self.cuts += len(pairs)
        for a, b in pairs:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass

    def stall(self, seconds: float) -> None:
        """Holds every byte for `seconds`, then delivers it."""
        self._stalled_until = time.monotonic() + seconds

    def throttle(self, bytes_per_second: float) -> None:
        """Limits each connection to `bytes_per_second` (0: no limit), both directions together,
        as a slow link does: bytes come late, none are lost."""
        self._rate = float(bytes_per_second)

    def slow(self, latency: float) -> None:
        """Holds every chunk read `latency` seconds before passing it on (a slow link: each
        request and answer waits, so every round trip takes at least twice as long)."""
        self._latency = latency

    def drop(self, on: bool) -> None:
        """While on, bytes are read and thrown away: both peers see silence, not a close."""
        self._dropping = on

    def chaos(self, rng: random.Random, seconds: float, stop: threading.Event | None = None) -> list[str]:
        """Random faults for `seconds`: stalls up to 1.5 s, silent drops up to 3 s followed by a
        cut (a connection that lost bytes cannot go on), and plain cuts. Returns what it did."""
        done: list[str] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (stop and stop.is_set()):
            time.sleep(rng.uniform(0.2, 1.0))
            kind = rng.choice(["stall", "drop", "cut"])
            if kind == "stall":
                t = rng.uniform(0.1, 1.5)
                self.stall(t)
                time.sleep(t)
            elif kind == "drop":
                t = rng.uniform(0.2, 3.0)
                self.drop(True)
                time.sleep(t)
                self.drop(False)
                self.cut()
            else:
                self.cut()
            done.append(kind)
        return done

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut()
