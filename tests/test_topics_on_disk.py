"""A topic partition is its segment files, bounded by the disk and not by the server's memory:
`sluice serve` held to 512 MiB by a memory cgroup takes 2 GiB into one partition and gives
every message back, and kill -9 in the middle of producing loses nothing acknowledged."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import NO_DEFAULT_PORTS, Node
from sluice.tank import TankConnection, TankError

LIMIT = 512 << 20
TOTAL = 2 << 30
BUNDLE = 100  # messages of 1000 bytes


class MemoryCgroup:
    """A memory cgroup (v2's memory.max, else v1's memory.limit_in_bytes) a process is put in."""

    def __init__(self, limit: int) -> None:
        name = f"sluice-test-{os.getpid()}-{time.monotonic_ns()}"
        v2 = Path("/sys/fs/cgroup")
        v1 = Path("/sys/fs/cgroup/memory")
        try:
            if (v2 / "cgroup.controllers").exists() and "memory" in (
                v2 / "cgroup.subtree_control"
            ).read_text():
                self.path = v2 / name
                self.path.mkdir()
                (self.path / "memory.max").write_text(str(limit))
            elif (v1 / "memory.limit_in_bytes").exists():
                self.path = v1 / name
                self.path.mkdir()
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
            else:
                pytest.skip("no memory cgroup here")
        except OSError as e:
            pytest.skip(f"cannot make a memory cgroup here: {e}")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def message(i: int) -> bytes:
    return i.to_bytes(8, "little") + bytes(992)


def read_all(address: str, check) -> int:
    """Consumes the partition from its start, checking each message; returns how many."""
    n, seq = 0, 0
    with TankConnection(address, timeout=60) as t:
        while True:
            f = t.consume("big", 0, seq, fetch_size=4 << 20)
            for m in f.messages:
                check(n, m.content)
                n += 1
            if f.next_seq > f.high_water_mark:
                return n
            seq = f.next_seq


def start(data: Path, cgroup: MemoryCgroup | None) -> Node:
    node = Node(data, *NO_DEFAULT_PORTS[:4], "--tank-listen", "127.0.0.1:0")
    if cgroup is not None:
        cgroup.add(node.proc.pid)
    return node


def test_a_topic_larger_than_the_servers_memory(tmp_path):
    cgroup = MemoryCgroup(LIMIT)
    node = start(tmp_path / "d", cgroup)
    try:
        with TankConnection(node.tank, timeout=60) as t:
            t.create_topic("big", 1)
            for b in range(TOTAL // (BUNDLE * 1000)):
                t.produce("big", [message(b * BUNDLE + j) for j in range(BUNDLE)])
        produced = TOTAL // (BUNDLE * 1000) * BUNDLE

        def same(n: int, content: bytes) -> None:
            assert content == message(n), n

        assert read_all(node.tank, same) == produced
        assert node.proc.poll() is None, "the server died under its memory limit"
        anon = next(
            int(line.split()[1]) << 10
            for line in Path(f"/proc/{node.proc.pid}/status").read_text().splitlines()
            if line.startswith("RssAnon:")
        )
        assert anon < 256 << 20, f"{anon >> 20} MiB of anonymous memory"
    finally:
        node.stop()
        cgroup.remove()


def test_kill9_while_producing_loses_nothing_acknowledged(tmp_path):
    cgroup = MemoryCgroup(LIMIT)
    node = start(tmp_path / "d", cgroup)
    acked = 0
    try:
        with TankConnection(node.tank, timeout=60) as t:
            t.create_topic("big", 1)
            threading.Timer(3.0, lambda: node.proc.send_signal(signal.SIGKILL)).start()
            deadline = time.monotonic() + 60
            try:
                while time.monotonic() < deadline:
                    t.produce("big", [message(acked * BUNDLE + j) for j in range(BUNDLE)])
                    acked += 1
            except (TankError, OSError):
                pass
        node.proc.wait()
        assert acked > 10, acked
    finally:
        cgroup.remove()
    node = start(tmp_path / "d", None)
    try:

        def same(n: int, content: bytes) -> None:
            assert content == message(n), n

        # Every acknowledged bundle, in order; a bundle caught by the kill may be there or not.
        assert read_all(node.tank, same) >= acked * BUNDLE
    finally:
        assert node.stop() == 0, node.log()[-3000:]
