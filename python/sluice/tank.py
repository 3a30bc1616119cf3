"""A small client of TANK's protocol (sluice's `tank_listen`, or TANK's own broker): topic
creation and discovery, for `sluice topic` and scripts. Frames are `{msg id: u8, payload
length: u32}`, little-endian, as `sluice_proto::tank` decodes them."""

from __future__ import annotations

import socket
import struct

PING, DISCOVER_PARTITIONS, CREATE_TOPIC, DISCOVER_TOPICS = 0x03, 0x06, 0x07, 0x0B

# CreateTopic's error byte.
CREATE_ERRORS = {
    1: "the topic exists",
    2: "the broker failed (system error)",
    4: "the settings are not valid",
    5: "the broker is read-only",
    10: "the request is not valid",
}


class TankError(Exception):
    pass


class TankConnection:
    """One connection to a TANK listener; each call sends a request and waits for its answer."""

    def __init__(self, address: str = "127.0.0.1:11011", timeout: float = 10.0) -> None:
        host, _, port = address.rpartition(":")
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=timeout)
        except OSError as e:
            raise TankError(f"cannot reach the TANK listener at {address}: {e}") from None
        self._buf = b""
        self._next_id = 1

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> TankConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _frame(self) -> tuple[int, bytes]:
        while True:
            if len(self._buf) >= 5:
                n = 5 + struct.unpack_from("<I", self._buf, 1)[0]
                if len(self._buf) >= n:
                    frame, self._buf = self._buf[:n], self._buf[n:]
                    if frame[0] != PING:  # the broker's greeting, and nothing to answer
                        return frame[0], frame[5:]
                    continue
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                raise TankError("the TANK listener closed the connection")
            self._buf += chunk

    def _call(self, msg_id: int, payload: bytes) -> bytes:
        self._sock.sendall(bytes([msg_id]) + struct.pack("<I", len(payload)) + payload)
        got, answer = self._frame()
        if got != msg_id:
            raise TankError(f"answer {got:#04x} to request {msg_id:#04x}")
        return answer

    def _request_id(self) -> bytes:
        self._next_id += 1
        return struct.pack("<I", self._next_id)

    def create_topic(self, name: str, partitions: int = 1, settings: str = "") -> None:
        """Creates a topic; TankError says why not (it exists, bad settings...)."""
        topic, config = name.encode(), settings.encode()
        if not 1 <= len(topic) <= 255 or not 1 <= partitions <= 0xFFFF:
            raise TankError("a topic has a name of 1 to 255 bytes and 1 to 65535 partitions")
        payload = self._request_id() + bytes([len(topic)]) + topic + struct.pack("<H", partitions)
        payload += _varint(len(config)) + config
        answer = self._call(CREATE_TOPIC, payload)
        error = answer[-1]
        if error:
            raise TankError(f"topic {name!r}: {CREATE_ERRORS.get(error, f'error {error}')}")

    def topics(self) -> list[tuple[str, int]]:
        """Every topic with its partition count."""
        answer = self._call(DISCOVER_TOPICS, self._request_id() + b"\x00")
        (count,) = struct.unpack_from("<I", answer, 4)
        at, out = 9, []
        for _ in range(count):
            n = answer[at]
            name = answer[at + 1 : at + 1 + n].decode(errors="replace")
            at += 1 + n + 1  # name, enabled
            (parts,) = struct.unpack_from("<H", answer, at)
            at += 2
            out.append((name, parts))
        return out

    def partitions(self, name: str) -> list[tuple[int, int]]:
        """Per partition of a topic: (first available sequence number, high-water mark)."""
        topic = name.encode()
        answer = self._call(DISCOVER_PARTITIONS, self._request_id() + bytes([len(topic)]) + topic)
        at = 4 + 1 + answer[4]
        (count,) = struct.unpack_from("<H", answer, at)
        return [struct.unpack_from("<QQ", answer, at + 2 + 16 * i) for i in range(count)]


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
