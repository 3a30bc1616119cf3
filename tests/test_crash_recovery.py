"""kill -9 in the middle of persist writes: nothing acknowledged is lost.

A child process writes random keys (sets, overwrites, deletes, the odd snapshot) with
durability "persist" and prints each change only after the call returned. The parent kills it
with SIGKILL at a random moment, reopens the data directory and checks every acknowledged
change. Several rounds run on the same directory, each continuing from the state before."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import open_engine

NUM_KEYS = 300

CHILD = r"""
import random, sys
import sluice

data_dir, mode, seed, round_no = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
engine = sluice.open_engine(data_dir=data_dir, wal__mode=mode, snapshot__interval=0,
                            expiry_pager_interval=3600)
out = sys.stdout


def say(line):
    out.write(line + "\n")
    out.flush()


say("ready")
n = 0
while True:
    n += 1
    key = "key%03d" % rng.randrange(NUM_KEYS)
    if n % 250 == 0:
        engine.snapshot()
    elif rng.random() < 0.25:
        say("try del " + key)
        try:
            engine.delete(key.encode(), durability="persist")
        except sluice.NotFoundError:
            say("miss " + key)
            continue
        say("del " + key)
    else:
        value = "r%d-%d-%08x" % (round_no, n, rng.getrandbits(32))
        say("try set %s %s" % (key, value))
        engine.set(key.encode(), value.encode(), durability="persist")
        say("set %s %s" % (key, value))
""".replace("NUM_KEYS", str(NUM_KEYS))


class Model:
    """What the parent knows: acknowledged state per key, every value ever tried per key."""

    def __init__(self) -> None:
        self.acked: dict[str, str | None] = {}
        self.tried: dict[str, set[str]] = {}
        self.inflight: tuple[str, str | None] | None = None
        self.acks = 0

    def feed(self, lines: list[str]) -> None:
        self.inflight = None
        for line in lines:
            parts = line.split(" ")
            if parts[0] == "try":
                key = parts[2]
                value = parts[3] if parts[1] == "set" else None
                if value is not None:
                    self.tried.setdefault(key, set()).add(value)
                self.inflight = (key, value)
            elif parts[0] == "set":
                self.acked[parts[1]] = parts[2]
                self.inflight = None
                self.acks += 1
            elif parts[0] == "del":
                self.acked[parts[1]] = None
                self.inflight = None
                self.acks += 1
            elif parts[0] == "miss":
                self.inflight = None


def _run_child_and_kill(
    data_dir: Path, mode: str, seed: int, round_no: int, delay: float, tmp: Path
) -> list[str]:
    stderr = open(tmp / f"child-{mode}-{round_no}.err", "w+")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(data_dir), mode, str(seed), str(round_no)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for raw in child.stdout:
            if not raw.endswith("\n"):
                break  # a line cut by the kill was never fully acknowledged
            line = raw[:-1]
            if line == "ready":
                ready.set()
            else:
                lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(30):
            stderr.seek(0)
            pytest.fail(f"child not ready within 30 s: {stderr.read()}")
        time.sleep(delay)
        if child.poll() is not None:
            stderr.seek(0)
            pytest.fail(f"the child died by itself ({child.returncode}): {stderr.read()}")
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        reader.join(timeout=30)
        stderr.close()
    assert not reader.is_alive()
    return lines


FailoverLogs = list[list[tuple[int, int]]]


def _check(data_dir: Path, model: Model, failover_before: FailoverLogs) -> FailoverLogs:
    """Reopens after a kill; checks every acknowledged change; returns the failover logs."""
    with open_engine(data_dir) as e:
        report = e.recovery_report()
        assert report["unclean_shutdown"] is True
        high = e.high_seqnos()
        logs = [e.failover_log(vb) for vb in range(64)]
        for vb in range(64):
            log = logs[vb]
            # Exactly one new entry, on top of the history as it was, at the recovered high seqno.
            assert log[1:] == failover_before[vb], f"vbucket {vb}"
            assert log[0][0] not in {uuid for uuid, _ in failover_before[vb]}
            assert log[0][1] == high[vb]
        for i in range(NUM_KEYS):
            key = f"key{i:03d}"
            it = e.get(key.encode())
            got = it.value.decode() if it is not None else None
            if it is not None:
                assert got in model.tried.get(key, ()), f"{key}: {got!r} was never written"
            want = model.acked.get(key)
            if model.inflight is not None and model.inflight[0] == key:
                # The change in flight at the kill may or may not have made it.
                assert got in (want, model.inflight[1]), f"{key}: {got!r}, acked {want!r}"
                model.acked[key] = got
            else:
                assert got == want, f"{key}: acknowledged {want!r}, recovered {got!r}"
    return logs


@pytest.mark.parametrize("mode", ["fsync", "write"])
def test_kill_9_loses_nothing_acknowledged(tmp_path, mode):
    data_dir = tmp_path / "data"
    rng = random.Random(f"crash-{mode}")
    with open_engine(data_dir, wal__mode=mode) as e:
        failover = [e.failover_log(vb) for vb in range(64)]
    model = Model()
    for round_no in range(4):
        seed, delay = rng.randrange(1 << 30), rng.uniform(0.3, 1.2)
        lines = _run_child_and_kill(data_dir, mode, seed, round_no, delay, tmp_path)
        before = model.acks
        model.feed(lines)
        assert model.acks > before, f"round {round_no}: no write was acknowledged before the kill"
        failover = _check(data_dir, model, failover)
    # A final clean restart sees the same state and reports a clean shutdown.
    with open_engine(data_dir) as e:
        assert e.recovery_report()["unclean_shutdown"] is False
        assert [e.failover_log(vb) for vb in range(64)] == failover
        for key, want in model.acked.items():
            it = e.get(key.encode())
            assert (it.value.decode() if it else None) == want
