"""The `sluice` command: help, serve (ready line, clean stop, the data-dir lock, unclean and
damaged restarts), wal-dump, and the configuration reference."""

from __future__ import annotations

import base64
import json
import queue
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from helpers import (
    NO_DEFAULT_PORTS,
    flip_byte,
    layout,
    open_engine,
    run_cli,
    segments,
    wait_or_dump,
    wal_dump,
)

REPO = Path(__file__).resolve().parent.parent


class Serve:
    """A `sluice serve` child whose stderr is read on a thread, so waits can be bounded."""

    def __init__(self, *args: str) -> None:
        # Free ports for every listener a test does not choose.
        if "--listen" not in args:
            args = (*args, "--listen", "127.0.0.1:0")
        if "--admin-listen" not in args:
            args = (*args, "--admin-listen", "127.0.0.1:0")
        if "--iproto-listen" not in args:
            args = (*args, "--iproto-listen", "127.0.0.1:0")
        if "--tank-listen" not in args:
            args = (*args, "--tank-listen", "127.0.0.1:0")
        if "--greenstack-listen" not in args:
            args = (*args, "--greenstack-listen", "127.0.0.1:0")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", "serve", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, text: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no {text!r} within {timeout} s; stderr so far: {self.lines}")
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                pytest.fail(f"serve exited ({self.proc.wait(timeout=30)}) before {text!r}: {self.lines}")
            self.lines.append(line)
            if text in line:
                return line

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> tuple[int, str]:
        """Sends `sig`, waits for the exit; returns the exit code and the whole stderr."""
        self.proc.send_signal(sig)
        code = wait_or_dump(self.proc, timeout, self._drain)
        return code, self._drain()

    def _drain(self) -> str:
        """Everything the child wrote to stderr (once it has exited: all of it)."""
        self._t.join(timeout=30)
        while True:
            try:
                line = self._q.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.lines.append(line)
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def serve():
    started: list[Serve] = []

    def start(*args: str) -> Serve:
        s = Serve(*args)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["serve"],
        ["wal-dump"],
        ["config"],
        ["config", "check"],
        ["config", "reference"],
    ],
    ids=lambda a: " ".join(a) or "sluice",
)
def test_help(args):
    r = run_cli(*args, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: sluice")
    assert r.stderr == ""


def test_help_via_the_entry_point():
    script = Path(sys.executable).parent / "sluice"
    if not script.exists():
        pytest.skip("no `sluice` script next to this interpreter")
    r = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "serve" in r.stdout and "wal-dump" in r.stdout


def test_serve_ready_then_sigterm_stops_cleanly(data_dir, serve):
    with open_engine(data_dir) as e:
        for i in range(25):
            e.set(b"k%d" % i, b"v")
    s = serve("--data-dir", str(data_dir))
    ready = s.wait_for("sluice ready")
    assert "25 items in 1 bucket(s) default" in ready
    assert "unclean" not in ready
    code, err = s.stop(signal.SIGTERM)
    assert code == 0, err
    assert "stopped cleanly" in err
    assert "Traceback" not in err
    wal = sorted((data_dir / "wal").iterdir())
    assert wal and all(p.name.endswith(".xlog") for p in wal), [p.name for p in wal]
    assert not (data_dir / "snap").exists() or all(p.suffix == ".snap" for p in (data_dir / "snap").iterdir())
    for p in wal:
        assert wal_dump(p)[-1] == {"end": "eof", "offset": p.stat().st_size - 4}
    with open_engine(data_dir) as e:
        assert e.recovery_report()["unclean_shutdown"] is False
        assert e.get(b"k24").value == b"v"


def test_serve_sigint_also_stops_cleanly(tmp_path, serve):
    s = serve("--data-dir", str(tmp_path / "d"))
    s.wait_for("sluice ready")
    code, err = s.stop(signal.SIGINT)
    assert code == 0 and "stopped cleanly" in err


def test_serve_uses_the_config_file(tmp_path, serve):
    cfg = tmp_path / "sluice.toml"
    cfg.write_text(
        f'data_dir = "{tmp_path / "from-config"}"\n[wal]\nmode = "fsync"\n'
        "[buckets.default]\n[buckets.users]\nnum_vbuckets = 8\n"
    )
    s = serve("--config", str(cfg))
    ready = s.wait_for("sluice ready")
    assert "2 bucket(s)" in ready and "users" in ready
    assert "wal.mode fsync" in "".join(s.lines)
    assert s.stop()[0] == 0
    assert (tmp_path / "from-config" / "wal").is_dir()


def test_second_serve_on_the_same_data_dir_exits_1(data_dir, serve):
    first = serve("--data-dir", str(data_dir))
    first.wait_for("sluice ready")
    r = run_cli(
        "serve",
        "--data-dir",
        str(data_dir),
        *NO_DEFAULT_PORTS,
        timeout=30,
    )
    assert r.returncode == 1
    assert "in use" in r.stderr and str(data_dir) in r.stderr
    assert "Traceback" not in r.stderr
    # The first one is unaffected and still stops cleanly.
    assert first.proc.poll() is None
    code, err = first.stop()
    assert code == 0 and "stopped cleanly" in err


def test_serve_after_kill_9_reports_the_unclean_shutdown(data_dir, serve):
    with open_engine(data_dir) as e:
        for i in range(10):
            e.set(b"k%d" % i, b"v", durability="persist")
    s = serve("--data-dir", str(data_dir))
    s.wait_for("sluice ready")
    assert s.stop(signal.SIGKILL)[0] == -signal.SIGKILL
    assert any(p.name.endswith(".xlog.inprogress") for p in (data_dir / "wal").iterdir())
    s = serve("--data-dir", str(data_dir))
    ready = s.wait_for("sluice ready")
    assert "10 items" in ready and "after an unclean shutdown" in ready
    assert s.stop()[0] == 0


def test_serve_refuses_damage_unless_forced(data_dir, serve):
    with open_engine(data_dir) as e:
        for i in range(5):
            e.set(b"k%d" % i, b"v", durability="persist")
    (seg,) = segments(data_dir)
    first = layout(seg).blocks[0]
    flip_byte(seg, first.payload_offset + 5)
    r = run_cli(
        "serve",
        "--data-dir",
        str(data_dir),
        *NO_DEFAULT_PORTS,
        timeout=30,
    )
    assert r.returncode == 1
    assert str(seg) in r.stderr and f"byte offset {first.offset}" in r.stderr
    assert "Traceback" not in r.stderr
    s = serve("--data-dir", str(data_dir), "--force-recovery")
    s.wait_for("sluice ready")
    assert s.stop()[0] == 0


def test_wal_dump_prints_what_was_written(data_dir):
    written = []
    with open_engine(data_dir) as e:
        written.append(("mutation", b"alpha", b"one", e.set(b"alpha", b"one", flags=5, durability="persist")))
        written.append(("mutation", b"beta", b"two", e.set(b"beta", b"two")))
        written.append(("mutation", b"alpha", b"uno", e.set(b"alpha", b"uno")))
        written.append(("deletion", b"beta", b"", e.delete(b"beta")))
        binary_key, binary_value = b"\xff\x00bin", b"\x80\x81\x82"
        written.append(("mutation", binary_key, binary_value, e.set(binary_key, binary_value)))
        past = int(time.time()) - 10
        m = e.set(b"gone", b"soon", expiry=past)
        written.append(("mutation", b"gone", b"soon", m))
        assert e.get(b"gone") is None
        tomb = e.get_meta(b"gone")
        assert tomb.deleted and tomb.seqno == m.seqno + 1
        written.append(
            (
                "expiration",
                b"gone",
                b"",
                types.SimpleNamespace(seqno=tomb.seqno, vbucket=m.vbucket, cas=tomb.cas),
            )
        )
        instance = e.instance
    (seg,) = segments(data_dir)
    r = run_cli("wal-dump", str(seg))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]  # every line is JSON
    header, records, end = lines[0], lines[1:-1], lines[-1]
    assert header == {"file": "xlog", "instance": instance, "lsn": 1}
    assert end == {"end": "eof", "offset": seg.stat().st_size - 4}
    assert [r["lsn"] for r in records] == list(range(1, len(records) + 1))
    assert records[0] == {
        "lsn": 1,
        "op": "bucket",
        "bucket": 0,
        "vbucket": 0,
        "name": "default",
        "num_vbuckets": 64,
    }
    changes = [r for r in records if r["op"] in ("mutation", "deletion", "expiration")]
    assert len(changes) == len(written)

    def key_of(rec: dict, field: str) -> bytes:
        if field in rec:
            return rec[field].encode()
        return base64.b64decode(rec[field + "_base64"])

    for rec, (op, key, value, m) in zip(changes, written, strict=True):
        assert rec["op"] == op
        assert key_of(rec, "key") == key and key_of(rec, "value") == value
        assert (rec["seqno"], rec["vbucket"], rec["cas"]) == (m.seqno, m.vbucket, m.cas)
    assert changes[0]["flags"] == 5 and changes[0]["rev_seqno"] == 1 and changes[2]["rev_seqno"] == 2
    assert "delete_time" in changes[3] and "expiry" not in changes[3]
    assert changes[5]["expiry"] == past


def test_wal_dump_reports_how_a_damaged_file_ends(data_dir, tmp_path):
    with open_engine(data_dir) as e:
        for i in range(4):
            e.set(b"k%d" % i, b"v", durability="persist")
    (seg,) = segments(data_dir)
    lay = layout(seg)
    good = seg.read_bytes()

    # A segment still being written (`.inprogress`) can end in a torn write, or at a block.
    torn = tmp_path / "torn.xlog.inprogress"
    torn.write_bytes(good[: lay.blocks[-1].end - 3])
    assert wal_dump(torn)[-1]["end"] == "torn" and wal_dump(torn)[-1]["offset"] == lay.blocks[-1].offset

    open_end = tmp_path / "open.xlog.inprogress"
    open_end.write_bytes(good[: lay.eof_offset])
    assert wal_dump(open_end)[-1] == {"end": "no-eof-marker", "offset": lay.eof_offset}

    # A closed one cut the same ways has lost its end: damage.
    for name, cut in (("cut.xlog", lay.blocks[-1].end - 3), ("noeof.xlog", lay.eof_offset)):
        (tmp_path / name).write_bytes(good[:cut])
        end = wal_dump(tmp_path / name)[-1]
        assert end["end"] == "corrupt" and "closed cleanly" in end["reason"], end

    corrupt = tmp_path / "corrupt.xlog"
    corrupt.write_bytes(good)
    flip_byte(corrupt, lay.blocks[1].payload_offset)
    lines = wal_dump(corrupt)
    assert lines[-1]["end"] == "corrupt" and lines[-1]["offset"] == lay.blocks[1].offset
    # Everything readable before the damage is still printed.
    assert len(lines) - 2 == len(wal_dump(seg)) - 2 - (len(lay.blocks) - 1)


def test_wal_dump_of_missing_or_foreign_files(tmp_path):
    r = run_cli("wal-dump", str(tmp_path / "nope.xlog"))
    assert r.returncode == 1 and "no such file" in r.stderr
    text = tmp_path / "notes.txt"
    text.write_text("hello\nworld\n\n")
    r = run_cli("wal-dump", str(text))
    assert r.returncode == 1 and str(text) in r.stderr and "Traceback" not in r.stderr


def test_config_reference_matches_the_docs():
    r = run_cli("config", "reference")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (REPO / "docs" / "config.md").read_text(encoding="utf-8"), (
        "docs/config.md is stale: regenerate it with `python -m sluice config reference > docs/config.md`"
    )
    for key in ["data_dir", "wal.mode", "snapshot.count", "buckets.NAME.num_vbuckets"]:
        assert f"`{key}`" in r.stdout


def test_wal_dump_into_a_closed_pipe_ends_quietly(tmp_path):
    with open_engine(tmp_path / "d") as e:
        e.set_many([(b"k%05d" % i, b"v" * 200) for i in range(20000)])
    seg = sorted((tmp_path / "d" / "wal").glob("*.xlog"))[0]
    r = subprocess.run(
        f"{sys.executable} -m sluice wal-dump {seg} | head -n 2; exit ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2
    assert "Broken pipe" not in r.stderr and "Traceback" not in r.stderr


def test_a_stop_that_times_out_shows_the_server_log(tmp_path):
    from helpers import Node

    node = Node(tmp_path / "d")
    node.proc.send_signal(signal.SIGSTOP)  # a server that cannot act on SIGTERM
    with pytest.raises(AssertionError) as info:
        node.stop(timeout=1)
    assert "did not exit within 1 s" in str(info.value) and "sluice ready" in str(info.value)
    assert node.proc.poll() is not None, "the stuck server was killed"
