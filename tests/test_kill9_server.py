"""kill -9 of `sluice serve` under a pipelined load from several processes: no write the server
acknowledged is lost, at durability `none`, in both WAL modes, with 4 KiB and 100-byte values.

Writer processes pipeline SETs of unique keys over several connections and report, after each
batch of replies, how far each connection's writes were acknowledged. The server is killed with
SIGKILL at a random moment; a new server on the same data directory must return every
acknowledged key with its value. Rounds continue on the same directory, so each restart also
recovers the damage of the kills before it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import Node
from mcbp_wire import get_many

WRITERS = 3  # processes
CONNECTIONS = 2  # per process
PIPELINE = 128

WRITER = r"""
import json, socket, sys, time
from mcbp_wire import SET, read_response, request, set_extras

TMPFAIL = 0x86

host, port, tag, value_size, connections, pipeline = (
    sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))

def value_of(key):
    return (key * (value_size // len(key) + 1))[:value_size]

def set_frame(key, opaque):
    return request(SET, key, value_of(key), set_extras(), opaque=opaque)

socks = [socket.create_connection((host, port)) for _ in range(connections)]
acked = [0] * connections
n = 0
try:
    while True:
        for c, s in enumerate(socks):
            first = acked[c]
            keys = [b"%s-%d-%08d" % (tag.encode(), c, first + i + 1) for i in range(pipeline)]
            s.sendall(b"".join(set_frame(k, i) for i, k in enumerate(keys)))
            statuses = [read_response(s)["status"] for _ in range(pipeline)]
            for i, status in enumerate(statuses):
                # TMPFAIL is the server's back-pressure (its WAL is behind): a memcached client
                # tries again, and so does this one, before counting anything after it.
                tries = 0
                while status == TMPFAIL and tries < 1000:  # 10 s of back-pressure at most
                    tries += 1
                    time.sleep(0.01)
                    s.sendall(set_frame(keys[i], i))
                    status = read_response(s)["status"]
                if status != 0:
                    raise SystemExit("status 0x%x" % status)
                acked[c] = first + i + 1
            print(json.dumps(acked), flush=True)
except (ConnectionError, OSError):
    pass
"""


def _value_of(key: bytes, size: int) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def _round(node: Node, tag: str, value_size: int, rng: random.Random, tmp: Path) -> dict[bytes, bytes]:
    """Runs the writers against `node`, kills it with SIGKILL, returns what was acknowledged."""
    writers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER,
                node.host,
                str(node.port),
                f"{tag}w{w}",
                str(value_size),
                str(CONNECTIONS),
                str(PIPELINE),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parent,  # the writer imports mcbp_wire
        )
        for w in range(WRITERS)
    ]
    # Every writer is connected and acknowledged before the kill is timed (a loaded machine can
    # take a while to start them).
    first = [p.stdout.readline() for p in writers if p.stdout is not None]
    assert all(first), [p.communicate(timeout=60)[1] for p in writers]
    time.sleep(rng.uniform(0.1, 0.8))
    node.stop(sig=9, timeout=30)
    acked: dict[bytes, bytes] = {}
    for w, p in enumerate(writers):
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        lines = [first[w], *out.splitlines()]
        for c, upto in enumerate(json.loads(lines[-1])):
            for i in range(1, upto + 1):
                key = b"%sw%d-%d-%08d" % (tag.encode(), w, c, i)
                acked[key] = _value_of(key, value_size)
    return acked


@pytest.mark.parametrize(
    ("mode", "value_size", "segment_size"),
    [
        ("write", 100, None),
        ("write", 4096, None),
        ("fsync", 100, None),
        ("fsync", 4096, None),
        # Segments full every few milliseconds: the kill lands while one is being closed
        # (synced on the writer thread while replies write the next one).
        ("write", 4096, "1MiB"),
    ],
)
def test_kill_9_under_pipelined_load_loses_no_acknowledged_write(tmp_path, mode, value_size, segment_size):
    config = tmp_path / "sluice.toml"
    segment = f'segment_size = "{segment_size}"\n' if segment_size else ""
    config.write_text(f'[wal]\nmode = "{mode}"\n{segment}')
    data_dir = tmp_path / "data"
    rng = random.Random(f"{mode}-{value_size}")
    acked: dict[bytes, bytes] = {}
    for round_no in range(5):
        node = Node(data_dir, "--config", str(config))
        # Everything acknowledged in earlier rounds came back.
        found = get_many(node.host, node.port, sorted(acked))
        lost = [k for k, v in acked.items() if found.get(k) != v]
        assert not lost, (
            f"round {round_no}: {len(lost)} of {len(acked)} acknowledged writes lost, e.g. {lost[:3]}"
        )
        acked.update(_round(node, f"r{round_no}", value_size, rng, tmp_path))
    node = Node(data_dir, "--config", str(config))
    try:
        found = get_many(node.host, node.port, sorted(acked))
        lost = [k for k, v in acked.items() if found.get(k) != v]
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged writes lost, e.g. {lost[:3]}"
    finally:
        assert node.stop() == 0
