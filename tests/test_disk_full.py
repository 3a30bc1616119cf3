"""A WAL that cannot write: the failpoint in the WAL writer, and a real full tmpfs.

What a user must see: writes refused with a temporary failure (or WalFailedError for the
write whose block failed), reads still served, nothing acknowledged lost, and writes resuming
by themselves once the disk has room again."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sluice
from helpers import open_engine

WAL_ERRORS = (sluice.WalFailedError, sluice.TempFailError)


def _write_until_it_works(e: sluice.EmbeddedEngine, key: bytes, value: bytes, bound: float = 10.0) -> float:
    """Retries a persist write as a client would; returns how long the outage lasted."""
    start = time.monotonic()
    while True:
        try:
            e.set(key, value, durability="persist")
            return time.monotonic() - start
        except WAL_ERRORS:
            if time.monotonic() - start > bound:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize("failpoint", ["enospc", "eio"])
def test_wal_failpoint(data_dir, failpoint):
    acked: dict[bytes, bytes | None] = {}
    with open_engine(data_dir, wal__mode="fsync") as e:
        for i in range(50):
            e.set(b"k%d" % i, b"v%d" % i, durability="persist")
            acked[b"k%d" % i] = b"v%d" % i
        e.delete(b"k0", durability="persist")
        acked[b"k0"] = None
        assert e.stats()["wal_failing"] is False

        e.set_wal_failpoint(failpoint)
        # The write whose block fails learns it; later writes are refused up front.
        with pytest.raises(sluice.WalFailedError) as first:
            e.set(b"in-failed-block", b"x", durability="persist")
        assert "WAL" in str(first.value)
        assert ("No space left" if failpoint == "enospc" else "Input/output error") in str(first.value)
        assert e.stats()["wal_failing"] is True
        for call in [
            lambda: e.set(b"k1", b"new", durability="persist"),
            lambda: e.set(b"other", b"x"),  # even without durability
            lambda: e.delete(b"k2"),
            lambda: e.set_many([(b"m", b"v")]),
        ]:
            with pytest.raises(WAL_ERRORS) as info:
                call()
            assert "WAL" in str(info.value)
        assert e.stats()["tmp_failures"] >= 4
        # Reads are served meanwhile, and the refused writes changed nothing.
        for k, v in acked.items():
            assert (e.get(k).value if e.get(k) else None) == v
        assert e.get(b"other") is None and e.get(b"m") is None

        # Still failing a while later: the writer keeps retrying, it does not give up or skip.
        time.sleep(0.5)
        with pytest.raises(WAL_ERRORS):
            e.set(b"still", b"x", durability="persist")

        e.set_wal_failpoint("off")
        outage = _write_until_it_works(e, b"after", b"recovered")
        assert outage < 10
        assert e.stats()["wal_failing"] is False
        acked[b"after"] = b"recovered"
        e.set(b"k1", b"new", durability="persist")
        acked[b"k1"] = b"new"
        # The change whose block failed was kept in memory and written by the retry.
        assert e.get(b"in-failed-block").value == b"x"
    with open_engine(data_dir) as e:
        assert e.recovery_report()["unclean_shutdown"] is False
        for k, v in acked.items():
            assert (e.get(k).value if e.get(k) else None) == v, k
        assert e.get(b"in-failed-block").value == b"x"
        assert e.get(b"still") is None


def test_a_failed_sync_stops_writes_until_a_restart(data_dir):
    """Write mode: after a sync fails, Linux may have dropped the pages it could not write, so
    a later sync that succeeds proves nothing. No write is acknowledged as synced again, and
    none taken, until a restart; what was written is still served, and kept over the restart."""
    with open_engine(data_dir, wal__mode="write") as e:
        for i in range(20):
            e.set(b"k%d" % i, b"v%d" % i, durability="persist")
        e.set(b"written", b"w")  # level none: written, not synced
        e.set_wal_failpoint("sync_eio")
        with pytest.raises(sluice.WalFailedError) as failed:
            e.set(b"unsynced", b"x", durability="persist")
        assert "syncing" in str(failed.value) and "until sluice restarts" in str(failed.value)
        # The device answers again: still nothing is taken, the refusal says why.
        e.set_wal_failpoint("off")
        time.sleep(0.3)
        for call in [
            lambda: e.set(b"k1", b"new", durability="persist"),
            lambda: e.set(b"other", b"x"),
        ]:
            with pytest.raises(WAL_ERRORS) as info:
                call()
            assert "until sluice restarts" in str(info.value)
        assert e.stats()["wal_failing"] is True
        assert e.get(b"k1").value == b"v1" and e.get(b"written").value == b"w"
        # A snapshot closes the WAL segment, which syncs it and succeeds: still nothing more
        # counts as synced.
        synced = e.stats()["wal_synced_lsn"]
        e.snapshot()
        time.sleep(0.5)
        assert e.stats()["wal_synced_lsn"] == synced
    with open_engine(data_dir, wal__mode="write") as e:
        for i in range(20):
            assert e.get(b"k%d" % i).value == b"v%d" % i
        assert e.get(b"written").value == b"w"
        assert e.get(b"other") is None
        e.set(b"after", b"restart", durability="persist")
        assert e.stats()["wal_failing"] is False


def test_close_while_the_wal_is_failing_is_bounded(data_dir):
    with open_engine(data_dir, wal__mode="write") as e:
        for i in range(20):
            e.set(b"k%d" % i, b"v", durability="persist")
        e.set_wal_failpoint("enospc")
        with pytest.raises(WAL_ERRORS):
            e.set(b"lost", b"x", durability="persist")
        start = time.monotonic()
        e.close()  # must not hang on a disk that stays full
        assert time.monotonic() - start < 15
    with open_engine(data_dir) as e:
        for i in range(20):
            assert e.get(b"k%d" % i).value == b"v"


def _mount_tmpfs(where: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def _umount(where: Path) -> None:
    r = subprocess.run(["umount", str(where)], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_real_full_disk(tmp_path):
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "3m")
    try:
        filler = mnt / "filler"
        filler.write_bytes(b"\0" * (_free_bytes(mnt) - 600 * 1024))
        assert 500 * 1024 <= _free_bytes(mnt) <= 700 * 1024
        data = mnt / "data"
        acked: dict[bytes, bytes] = {}
        failed_key = None
        with open_engine(data, wal__mode="write") as e:
            for i in range(1000):  # ~150 writes of 4 KiB fill 600 KiB; 1000 is the bound
                key, value = b"k%04d" % i, os.urandom(2048).hex().encode()
                try:
                    e.set(key, value, durability="persist")
                except WAL_ERRORS as err:
                    assert "No space left on device" in str(err)
                    failed_key = key
                    break
                acked[key] = value
            else:
                pytest.fail("1000 writes of 4 KiB fitted into 600 KiB")
            assert len(acked) >= 50
            assert e.stats()["wal_failing"] is True
            with pytest.raises(WAL_ERRORS):
                e.set(b"refused", b"x" * 4096, durability="persist")
            for k, v in acked.items():
                assert e.get(k).value == v

            filler.unlink()
            _write_until_it_works(e, b"after", b"room again")
            assert e.stats()["wal_failing"] is False
            for i in range(20):
                e.set(b"more%d" % i, b"x" * 4096, durability="persist")
        with open_engine(data, wal__mode="write") as e:
            assert e.recovery_report()["unclean_shutdown"] is False
            assert e.recovery_report()["truncated"] is None
            for k, v in acked.items():
                assert e.get(k).value == v, k
            assert e.get(b"after").value == b"room again"
            assert all(e.get(b"more%d" % i) is not None for i in range(20))
            assert e.get(failed_key) is not None, "the failed write was retried once there was room"
            assert e.get(b"refused") is None
    finally:
        _umount(mnt)


def test_dropping_an_unclosed_engine_while_the_wal_fails_does_not_hang(tmp_path):
    # The engine's threads log through Python; dropping it must not hold the GIL while they
    # are joined.
    code = f"""
import gc, logging, sluice
logging.basicConfig(level=logging.INFO)
e = sluice.open_engine(data_dir={str(tmp_path / "d")!r})
e.set(b"k", b"v", durability="persist")
e.set_wal_failpoint("enospc")
try:
    e.set(b"k2", b"v", durability="persist")
except sluice.SluiceError:
    pass
del e
gc.collect()
print("dropped")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "dropped" in r.stdout, r.stderr[-2000:]


def _fill(path: Path) -> None:
    """Writes zeros into `path` until the file system has no room left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (256 << 10, 4096, 1):
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)


def test_every_front_answers_a_full_disk_at_once(tmp_path):
    """`sluice serve` on a tmpfs that fills up: the write caught in the failed WAL block gets
    its connection closed within a second (its outcome unknown, as the README says), and from
    then on every front answers a write at once with its protocol's temporary error naming the
    cause; reads go on; writes resume by themselves when there is room; nothing acknowledged is
    lost; and a restart on the full disk names the path and the cause."""
    import socket

    tarantool = pytest.importorskip("tarantool")
    from helpers import NO_DEFAULT_PORTS, Node
    from iproto_helpers import SPACES, host_port
    from mcbp_wire import GET, SET, connect, read_response, request, set_extras
    from sluice import GreenstackClient
    from sluice.tank import TankConnection, TankError

    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "16m")
    node = None
    try:
        cfg = tmp_path / "n.toml"
        cfg.write_text(
            '[wal]\nmode = "write"\n[snapshot]\ninterval = 0\n[buckets.default]\nnum_vbuckets = 4\n'
            "[topics.events]\npartitions = 1\n" + SPACES
        )
        node = Node(mnt / "data", "--config", str(cfg))
        acked = {}
        with connect(node) as s:
            for i in range(20):
                s.sendall(request(SET, b"k%d" % i, b"v%d" % i, set_extras()))
                assert read_response(s)["status"] == 0
                acked[b"k%d" % i] = b"v%d" % i
        _fill(mnt / "filler")

        # The write whose WAL block fails: closed within a second, or refused if another
        # write found the disk full first.
        with connect(node) as s:
            took = time.monotonic()
            s.sendall(request(SET, b"caught", b"x" * 65536, set_extras()))
            try:
                r = read_response(s)
                assert r["status"] == 0x86, r
            except (ConnectionError, OSError, AssertionError) as e:
                if isinstance(e, AssertionError) and "status" in str(e):
                    raise
            assert time.monotonic() - took < 3
        node.wait_for("No space left on device")

        def at_once(what, call, check):
            took = time.monotonic()
            outcome = call()
            assert time.monotonic() - took < 3, what
            assert check(outcome), (what, outcome)

        def mcbp_set():
            with connect(node) as s:
                s.sendall(request(SET, b"refused", b"y", set_extras()))
                return read_response(s)

        at_once("memcached", mcbp_set, lambda r: r["status"] == 0x86 and b"No space left" in r["value"])

        def text_set():
            with socket.create_connection((node.host, node.port), timeout=10) as s:
                s.sendall(b"set refused 0 0 1\r\nz\r\n")
                return s.recv(4096)

        at_once("text", text_set, lambda r: r.startswith(b"SERVER_ERROR") and b"No space left" in r)

        def iproto_insert():
            host, port = host_port(node.iproto)
            conn = tarantool.Connection(host, port)
            try:
                conn.insert("users", (7, "ada", 1))
            except tarantool.error.DatabaseError as e:
                return str(e)
            finally:
                conn.close()
            return "inserted"

        at_once("iproto", iproto_insert, lambda m: "No space left" in m)

        def tank_produce():
            with TankConnection(node.tank) as t:
                try:
                    t.produce("events", [b"m"])
                except TankError as e:
                    return str(e)
            return "produced"

        at_once("TANK", tank_produce, lambda m: m != "produced")

        def greenstack_set():
            with GreenstackClient(node.greenstack) as g:
                try:
                    g.set(b"refused", b"w")
                except sluice.SluiceError as e:
                    return e
            return None

        at_once(
            "Greenstack",
            greenstack_set,
            lambda e: e is not None and e.status == 0x0404 and "No space left" in e.message,
        )
        node.wait_for('a TANK produce to "events"')
        # Reads are served meanwhile.
        with connect(node) as s:
            s.sendall(request(GET, b"k3"))
            assert read_response(s)["value"] == b"v3"

        # Room again: writes resume by themselves.
        (mnt / "filler").unlink()
        deadline = time.monotonic() + 20
        while True:
            r = mcbp_set()
            if r["status"] == 0:
                break
            assert time.monotonic() < deadline, r
            time.sleep(0.1)
        assert node.stop() == 0, node.log()[-3000:]

        # A start on a full disk names what it could not write and why.
        _fill(mnt / "filler")
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "sluice",
                "serve",
                "--config",
                str(cfg),
                "--data-dir",
                str(mnt / "data"),
                *NO_DEFAULT_PORTS,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode != 0
        last = r.stderr.strip().splitlines()[-1]
        assert str(mnt) in last and "No space left" in last, r.stderr[-2000:]
        assert "cannot listen" not in last, last
        (mnt / "filler").unlink()

        node = Node(mnt / "data", "--config", str(cfg))
        with connect(node) as s:
            for k, v in acked.items():
                s.sendall(request(GET, k))
                assert read_response(s)["value"] == v, k
    finally:
        if node is not None and node.proc.poll() is None:
            node.stop()
        _umount(mnt)


def test_a_segment_file_that_cannot_grow_refuses_the_produce_at_once(tmp_path):
    """A full disk found by a topic's segment file (the WAL still has room): the produce is
    answered at once with TANK's error, nothing of it is kept or numbered, and produces resume
    when there is room, numbered on from the last acknowledged one."""
    from helpers import Node
    from sluice.tank import TankConnection, TankError

    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "16m")
    node = None
    try:
        cfg = tmp_path / "n.toml"
        cfg.write_text('[wal]\nmode = "write"\n[snapshot]\ninterval = 0\n[topics.events]\npartitions = 1\n')
        node = Node(mnt / "data", "--config", str(cfg))
        with TankConnection(node.tank) as t:
            for i in range(10):
                t.produce("events", [b"kept %d" % i])
            _fill(mnt / "filler")
            took = time.monotonic()
            with pytest.raises(TankError):
                t.produce("events", [os.urandom(256 << 10)])
            assert time.monotonic() - took < 3
        node.wait_for("cannot write the segment file")
        (mnt / "filler").unlink()
        with TankConnection(node.tank) as t:
            t.produce("events", [b"after"])
            got = [(m.seq, m.content) for m in t.consume("events", 0, 1, fetch_size=1 << 20).messages]
        assert got == [(i + 1, b"kept %d" % i) for i in range(10)] + [(11, b"after")]
        assert node.stop() == 0, node.log()[-3000:]
        node = Node(mnt / "data", "--config", str(cfg))
        with TankConnection(node.tank) as t:
            got = [(m.seq, m.content) for m in t.consume("events", 0, 1, fetch_size=1 << 20).messages]
        assert got == [(i + 1, b"kept %d" % i) for i in range(10)] + [(11, b"after")]
    finally:
        if node:
            node.stop()
        _umount(mnt)
