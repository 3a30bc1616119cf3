"""A client of TANK's protocol (sluice's `tank_listen`, or TANK's own broker): produce,
consume with long-poll, topic creation and discovery, for `sluice topic`, `sluice tail --topic`
and scripts. Frames are `{msg id: u8, payload length: u32}`, little-endian; Produce and Consume
frames are built and decoded by `sluice_proto::tank` (through `sluice._native`), a bundle at a
time.

    with TankConnection("127.0.0.1:11011") as tank:
        tank.produce("events", [b"plain", (b"key", b"with a key")])
        got = tank.consume("events", seq=0, max_wait=1.0)
        for m in got.messages:
            print(m.seq, m.key, m.content)
        # next: tank.consume("events", seq=got.next_seq, ...)
"""

from __future__ import annotations

import ipaddress
import struct
import time
from collections.abc import Sequence
from typing import NamedTuple

from sluice import _native
from sluice.tls import connect

PRODUCE, CONSUME, PING, DISCOVER_PARTITIONS, CREATE_TOPIC, DISCOVER_TOPICS = (
    0x01,
    0x02,
    0x03,
    0x06,
    0x07,
    0x0B,
)

# Consume's sequence number for "the next message produced".
TAIL = 2**64 - 1

# TANK's message ids are small numbers, and no answer comes near 1 GiB: a frame head beyond
# either is a peer that does not speak TANK (an HTTP port reads as a 790 MB frame).
MAX_MSG_ID = 0x1F
# How long a new connection waits for the broker's greeting (a Ping) at most.
GREETING_WAIT = 2.0
MAX_FRAME_BYTES = 1 << 30

# Produce's error byte per partition.
PRODUCE_ERRORS = {
    0x01: "the topic has no such partition",
    0x02: "the broker could not store it (see its log: a full disk, a failing WAL)",
    0x03: "the leader stored it, but not as many copies as required_acks asks held it within "
    "ack_timeout (it may be read back, or lost if the leader fails now)",
    0x04: "the partition has fewer copies, or fewer in sync, than required_acks asks for",
    0x0A: "the request is not valid (a bad bundle, or a sequence number behind the partition's end)",
    0xFE: "the broker is read-only for the topic (a replica's copy: produce to its active; or, on a "
    "node with users, [users.guest] has no write permission on it: TANK clients have its grants)",
    0xFF: "the topic is unknown",
}

# A partition's answer from a broker that does not lead it: the leader's endpoint follows, or
# none leads it now.
OTHER_LEADER = 0xFC
NO_LEADER = 0xFD


def _endpoint(b: bytes) -> str:
    """TANK's endpoint (the IPv4 address's octets in order, the port u16 LE) as "HOST:PORT"."""
    return f"{ipaddress.IPv4Address(b[:4])}:{struct.unpack('<H', b[4:6])[0]}"


# CreateTopic's error byte.
CREATE_ERRORS = {
    1: "the topic exists",
    2: "the broker failed (system error)",
    4: "the settings are not valid",
    5: "the broker is read-only (on a node with users: [users.guest], whose grants TANK clients have, "
    "has no admin permission on the topic)",
    10: "the request is not valid",
}


class TankError(Exception):
    pass


class NotLeader(TankError):
    """The broker asked does not lead the partition (a sluice cluster places each partition on
    a node): `leader` is the "HOST:PORT" of the one that does, None while none does."""

    def __init__(self, topic: str, partition: int, leader: str | None):
        where = f"ask {leader}" if leader else "no node leads it now; ask again later"
        super().__init__(f"{topic}/{partition}: this broker does not lead the partition ({where})")
        self.partition = partition
        self.leader = leader


class OutOfRange(TankError):
    """A consume from a sequence number the partition does not hold: before the first one
    retention kept, or past the next one to be produced."""

    def __init__(self, topic: str, partition: int, seq: int, first_available: int, high_water_mark: int):
        super().__init__(
            f"{topic}/{partition}: sequence number {seq} is out of range (the partition holds "
            f"{first_available} to {high_water_mark})"
        )
        self.partition = partition
        self.first_available = first_available
        self.high_water_mark = high_water_mark


class Message(NamedTuple):
    seq: int
    # Milliseconds since the epoch, as the producer stamped it.
    ts: int
    key: bytes | None
    content: bytes


class Fetched(NamedTuple):
    """A partition's answer to a consume: its messages from the sequence number asked for,
    where to ask next, and the partition's high-water mark (its last message)."""

    partition: int
    messages: list[Message]
    next_seq: int
    high_water_mark: int


# What `produce` takes per message: its content, or (key, content).
Produced = bytes | tuple[bytes | None, bytes]


class TankConnection:
    """One connection to a TANK listener; each call sends a request and waits for its answer."""

    def __init__(
        self, address: str = "127.0.0.1:11011", timeout: float = 10.0, *, cafile: str | None = None
    ) -> None:
        """``cafile``: connect to the TLS listener (``tank_tls_listen``), whose certificate must
        chain to the CAs in that PEM file."""
        try:
            self._sock = connect(address, timeout, cafile)
        except OSError as e:
            raise TankError(f"cannot reach the TANK listener at {address}: {e}") from None
        self._address = address
        self._cafile = cafile
        self._buf = b""
        self._next_id = 1
        # A TANK broker greets a connection with a Ping; a port that says nothing (another
        # protocol's, waiting for its own request) is told apart in a second, not at the timeout.
        self._sock.settimeout(min(timeout, GREETING_WAIT))
        try:
            self._buf = self._sock.recv(1 << 16)
        except TimeoutError:
            self._sock.close()
            raise TankError(
                f"{address} sent no greeting within {min(timeout, GREETING_WAIT):g} s: it is not a TANK "
                f"listener (tank_listen, default 127.0.0.1:11011)"
            ) from None
        except OSError as e:
            self._sock.close()
            raise TankError(f"cannot reach the TANK listener at {address}: {e}") from None
        self._sock.settimeout(timeout)
        self._timeout = timeout

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> TankConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _frame(self) -> tuple[int, bytes]:
        while True:
            while len(self._buf) < 5:
                self._fill()
            n = 5 + struct.unpack_from("<I", self._buf, 1)[0]
            if self._buf[0] > MAX_MSG_ID or n > MAX_FRAME_BYTES:
                raise TankError(f"not a TANK listener: it sent {bytes(self._buf[:5])!r}")
            if len(self._buf) >= n:
                frame, self._buf = self._buf[:n], self._buf[n:]
            else:
                # The rest of a frame received straight into one buffer: appending chunks to
                # what came copied the whole of a 1 MiB consume answer once per 64 KiB read.
                buf = bytearray(n)
                buf[: len(self._buf)] = self._buf
                view = memoryview(buf)[len(self._buf) :]
                self._buf = b""
                while view:
                    got = self._sock.recv_into(view)
                    if not got:
                        raise TankError("the TANK listener closed the connection")
                    view = view[got:]
                frame = memoryview(buf)
            if frame[0] != PING:  # the broker's greeting, and nothing to answer
                return frame[0], bytes(frame[5:])

    def _fill(self) -> None:
        try:
            chunk = self._sock.recv(1 << 16)
        except TimeoutError:
            raise TankError(
                f"no answer from the TANK listener at {self._address} within {self._timeout:g} s"
            ) from None
        if not chunk:
            raise TankError("the TANK listener closed the connection")
        self._buf += chunk

    def _call(self, msg_id: int, payload: bytes) -> bytes:
        return self._exchange(msg_id, bytes([msg_id]) + struct.pack("<I", len(payload)) + payload)

    def _exchange(self, msg_id: int, frame: bytes) -> bytes:
        self._sock.sendall(frame)
        got, answer = self._frame()
        if got != msg_id:
            raise TankError(f"answer {got:#04x} to request {msg_id:#04x}")
        return answer

    def _next_request_id(self) -> int:
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        return self._next_id

    def _request_id(self) -> bytes:
        return struct.pack("<I", self._next_request_id())

    def produce(
        self,
        topic: str,
        messages: Sequence[Produced],
        partition: int = 0,
        *,
        snappy: bool = False,
        seq: int | None = None,
        ts_ms: int | None = None,
        required_acks: int = 0,
        ack_timeout: float = 0.0,
    ) -> None:
        """Publishes `messages` (contents, or (key, content) pairs) as one bundle, Snappy-
        compressed if `snappy`, and returns once the broker acknowledged it (sluice: once its WAL
        holds it). `seq` places the bundle's first message at that sequence number
        (ProduceWithSeqnum, for mirroring); it must not be behind the partition's end.

        In a cluster, the leader also waits for copies of the partition, as TANK's clustered
        broker counts them: `required_acks` 0 waits for every copy in sync, 255 for a majority
        of them, N for N copies; `ack_timeout` seconds at most (0: 8 s), after which it raises
        (the bundle stays stored on the leader). A node on its own ignores both."""
        try:
            frame = _native.tank_produce_frame(
                self._next_request_id(),
                topic,
                partition,
                messages,
                ts_ms=int(time.time() * 1000) if ts_ms is None else ts_ms,
                snappy=snappy,
                base_seq=seq,
                required_acks=required_acks,
                ack_timeout_ms=round(ack_timeout * 1000),
            )
        except ValueError as e:
            raise TankError(f"produce to {topic!r}: {e}") from None
        answer = self._exchange(PRODUCE, frame)
        error = answer[4] if len(answer) > 4 else 0
        if error == OTHER_LEADER and len(answer) >= 11:
            raise NotLeader(topic, partition, _endpoint(answer[5:11]))
        if error == NO_LEADER:
            raise NotLeader(topic, partition, None)
        if error:
            why = PRODUCE_ERRORS.get(error, f"the broker failed (error {error:#04x})")
            raise TankError(f"produce to {topic}/{partition}: {why}")

    def consume(
        self,
        topic: str,
        partition: int = 0,
        seq: int = 0,
        *,
        max_wait: float = 0.0,
        min_bytes: int = 0,
        fetch_size: int = 64 << 10,
    ) -> Fetched:
        """Messages of a partition from `seq` (0: the first available; TAIL: only those
        produced from now on). Waits up to `max_wait` seconds for `min_bytes` of them (at least
        one bundle) if fewer are there. A bundle larger than `fetch_size` is asked for again
        whole. OutOfRange when retention dropped `seq` or it is past the end."""
        return self.consume_partitions(
            topic, {partition: seq}, max_wait=max_wait, min_bytes=min_bytes, fetch_size=fetch_size
        )[0]

    def consume_partitions(
        self,
        topic: str,
        seqs: dict[int, int],
        *,
        max_wait: float = 0.0,
        min_bytes: int = 0,
        fetch_size: int = 64 << 10,
    ) -> list[Fetched]:
        """`consume` of several partitions in one request ({partition: seq}), in the order
        the broker answers them."""
        sizes = dict.fromkeys(seqs, fetch_size)
        wait_ms = int(max_wait * 1000)
        previous = self._sock.gettimeout()
        if previous is not None:
            self._sock.settimeout(previous + max_wait)
        try:
            while True:
                frame = _native.tank_consume_frame(
                    self._next_request_id(),
                    topic,
                    [(p, s, sizes[p]) for p, s in seqs.items()],
                    max_wait_ms=wait_ms,
                    min_bytes=min_bytes,
                )
                answer = self._exchange(CONSUME, frame)
                try:
                    results = _native.tank_consume_answer(answer, list(seqs.items()), Message)
                except ValueError as e:
                    raise TankError(str(e)) from None
                grow = {p: needed for p, _, _, _, _, _, needed in results if needed > sizes[p]}
                if grow and not any(msgs for _, _, _, _, msgs, _, _ in results):
                    # Nothing came but a bundle too large for the fetch size: ask for it whole.
                    sizes.update(grow)
                    wait_ms = 0
                    continue
                return [self._fetched(topic, seqs[r[0]], r) for r in results]
        finally:
            self._sock.settimeout(previous)

    @staticmethod
    def _fetched(topic: str, seq: int, r: tuple) -> Fetched:
        partition, kind, hwm, first, messages, next_seq, _ = r
        if kind == "unknown_topic":
            raise TankError(f"topic {topic!r} is unknown")
        if kind == "unknown_partition":
            raise TankError(f"topic {topic!r} has no partition {partition}")
        if kind == "boundary":
            raise OutOfRange(topic, partition, seq, first, hwm)
        if kind == "other_leader":
            raise NotLeader(topic, partition, f"{ipaddress.IPv4Address(hwm)}:{first}")
        if kind == "no_leader":
            raise NotLeader(topic, partition, None)
        return Fetched(partition, messages, next_seq, hwm)

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
        # A cluster-aware broker follows each topic with its replication factor.
        cluster_aware = answer[8] != 0
        at, out = 9, []
        for _ in range(count):
            n = answer[at]
            name = answer[at + 1 : at + 1 + n].decode(errors="replace")
            at += 1 + n + 1  # name, enabled
            (parts,) = struct.unpack_from("<H", answer, at)
            at += 2 + cluster_aware
            out.append((name, parts))
        return out

    def _discover(self, name: str, ids: Sequence[int] = ()) -> list[tuple[int, int] | str | None]:
        """DiscoverPartitions of every partition (or of `ids`, as TANK's client asks a leader it
        was sent to): per partition (first available, high-water mark), or the "HOST:PORT" of
        the broker that leads it, or None while none does."""
        topic = name.encode()
        ids_bytes = b"".join(struct.pack("<H", i) for i in ids)
        payload = self._request_id() + bytes([len(topic)]) + topic + ids_bytes
        answer = self._call(DISCOVER_PARTITIONS, payload)
        at = 4 + 1 + answer[4]
        (count,) = struct.unpack_from("<H", answer, at)
        at += 2
        out: list[tuple[int, int] | str | None] = []
        for _ in range(count):
            first, hwm = struct.unpack_from("<QQ", answer, at)
            at += 16
            if (first, hwm) != (2**64 - 1, 2**64 - 1):
                out.append((first, hwm))
            elif answer[at] == OTHER_LEADER:
                out.append(_endpoint(answer[at + 1 : at + 7]))
                at += 7
            else:
                out.append(None)
                at += 1
        return out

    def leaders(self, name: str) -> list[str | None]:
        """Per partition of a topic, the "HOST:PORT" of the broker that leads it: this one's
        address where it leads it itself, None while none does (a sluice cluster places each
        partition on a node; a broker on its own leads them all)."""
        return [self._address if isinstance(p, tuple) else p for p in self._discover(name)]

    def partitions(self, name: str) -> list[tuple[int, int]]:
        """Per partition of a topic: (first available sequence number, high-water mark), asked
        of each partition's leader (NotLeader for one no broker leads now)."""
        found = self.ranges(name)
        for p, f in enumerate(found):
            if f is None:
                raise NotLeader(name, p, None)
        return [f for f in found if f is not None]

    def ranges(self, name: str) -> list[tuple[int, int] | None]:
        """`partitions()`, with None for a partition no broker leads now (in a sluice cluster:
        its leader failed over, or the map places it nowhere yet)."""
        found = self._discover(name)
        elsewhere: dict[str, list[int]] = {}
        for p, f in enumerate(found):
            if isinstance(f, str):
                elsewhere.setdefault(f, []).append(p)
        for leader, ids in elsewhere.items():
            with TankConnection(leader, self._timeout, cafile=self._cafile) as t:
                # A leader that sends it on again is in the middle of a failover: none leads
                # it now, as far as this answer can tell.
                for p, f in zip(ids, t._discover(name, ids), strict=True):
                    found[p] = f
        return [f if isinstance(f, tuple) else None for f in found]


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
