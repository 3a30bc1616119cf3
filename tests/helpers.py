"""Helpers shared by the end-to-end tests: opening engines on a tmp data dir, running the CLI
in a subprocess, reading the WAL/snapshot file format directly (to damage it on purpose), and
`sluice serve` nodes with readers for their admin endpoint (/metrics, /status).

File format (docs/storage.md): a text header ending with a blank line, then blocks of
magic 0xd5ba0bab (u32 BE) | payload length (u32 BE) | crc32c (u32 BE) | payload, then the
EOF marker 0xd510aded on a clean close.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import sluice

BLOCK_MAGIC = 0xD5BA0BAB
EOF_MARKER = 0xD510ADED
BLOCK_HEADER_LEN = 12


def open_engine(data_dir: Path, **overrides: object) -> sluice.EmbeddedEngine:
    """The engine on `data_dir`, with no background snapshots or pager unless asked for."""
    overrides.setdefault("snapshot__interval", 0)
    overrides.setdefault("expiry_pager_interval", 3600)
    return sluice.open_engine(data_dir=str(data_dir), **overrides)


def run_cli(*args: str, timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def wal_dump(path: Path) -> list[dict]:
    """`sluice wal-dump FILE` as parsed JSON lines (header first, end line last)."""
    r = run_cli("wal-dump", str(path))
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


@dataclasses.dataclass
class Block:
    offset: int  # of the block header
    length: int  # of the payload

    @property
    def payload_offset(self) -> int:
        return self.offset + BLOCK_HEADER_LEN

    @property
    def end(self) -> int:
        return self.offset + BLOCK_HEADER_LEN + self.length


@dataclasses.dataclass
class Layout:
    header_end: int
    blocks: list[Block]
    eof_offset: int | None  # where the EOF marker sits, if the file has one
    size: int


def layout(path: Path) -> Layout:
    """Parses a .xlog/.snap file the way the format describes it (intact files only)."""
    data = Path(path).read_bytes()
    header_end = data.index(b"\n\n") + 2
    at, blocks, eof = header_end, [], None
    while at + 4 <= len(data):
        (magic,) = struct.unpack(">I", data[at : at + 4])
        if magic == EOF_MARKER:
            eof = at
            break
        assert magic == BLOCK_MAGIC, f"{path}: bad magic at {at}"
        length, _crc = struct.unpack(">II", data[at + 4 : at + 12])
        blocks.append(Block(at, length))
        at += BLOCK_HEADER_LEN + length
    return Layout(header_end, blocks, eof, len(data))


def flip_byte(path: Path, offset: int, mask: int = 0x40) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def as_crash_left_it(segment: Path) -> Path:
    """Turns a cleanly closed WAL segment into what a crash leaves: still `.inprogress`, without
    the EOF marker. Returns its new path."""
    lay = layout(segment)
    if lay.eof_offset is not None:
        os.truncate(segment, lay.eof_offset)
    open_path = segment.with_name(segment.name + ".inprogress")
    segment.rename(open_path)
    return open_path


def segments(data_dir: Path) -> list[Path]:
    """WAL segment files (closed and in progress), sorted by first LSN."""
    return sorted((Path(data_dir) / "wal").iterdir(), key=lambda p: p.name)


def snapshots(data_dir: Path) -> list[Path]:
    return sorted((Path(data_dir) / "snap").iterdir(), key=lambda p: p.name)


def first_lsn(path: Path) -> int:
    return int(path.name.split(".")[0])


def item_state(engine: sluice.EmbeddedEngine, key: bytes, bucket: str = "default") -> tuple | None:
    """Everything a reader can see of a key's current version, tombstones included."""
    it = engine.get_meta(key, bucket=bucket)
    if it is None:
        return None
    return (it.value, it.flags, it.expiry, it.cas, it.rev_seqno, it.seqno, it.datatype, it.deleted)


def admin_get(address: str, path: str) -> str:
    """GET `path` on the admin endpoint at `address` (reads are open on loopback): the body."""
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as r:
        return r.read().decode()


def admin_post(
    node: Node, path: str, headers: dict[str, str] | None = None, data: bytes = b""
) -> tuple[int, dict, str]:
    """POST to the admin endpoint: (status, headers, body), errors included."""
    req = urllib.request.Request(
        f"http://{node.admin}{path}", data=data, method="POST", headers=headers or {}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def basic_auth(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text format as (name, labels, value), one per sample line."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of the one series `name` with exactly `labels`; fails when there is none."""
    found = [v for n, ls, v in metric_samples(text) if n == name and ls == labels]
    assert found, f"{name}{labels or ''} not in /metrics"
    return found[0]


def write_users_config(path: Path, bob_perms: str) -> None:
    """Users ada (read, write), bob (`bob_perms` on the default bucket) and root (everything on
    every bucket); each one's password is NAME-secret."""
    ada = sluice.config.hash_password("ada-secret", iterations=1000)
    bob = sluice.config.hash_password("bob-secret", iterations=1000)
    root = sluice.config.hash_password("root-secret", iterations=1000)
    path.write_text(
        f'[users.ada]\npassword_hash = "{ada}"\nbuckets = {{ default = ["read", "write"] }}\n'
        f'[users.bob]\npassword_hash = "{bob}"\nbuckets = {{ default = {bob_perms} }}\n'
        f'[users.root]\npassword_hash = "{root}"\n'
        'buckets = { "*" = ["read", "write", "stream", "admin"] }\n'
    )


# `sluice serve` arguments that keep a node off every default port (tests run side by side):
# the client port and the admin endpoint on free ports, the other fronts off.
# `sluice serve` arguments that turn the fronts besides memcached's off.
FRONTS_OFF = ("--iproto-listen", "", "--tank-listen", "", "--greenstack-listen", "")
NO_DEFAULT_PORTS = ("--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", *FRONTS_OFF)


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def beside(listen_port: int) -> dict[str, int]:
    """The ports a node on `listen_port` gives the fronts no flag sets, by front name (README,
    `sluice serve --help`): each one's default port plus (listen_port - 11210)."""
    kv = next(f for f in sluice._native.FRONTS if f["kv_port"])
    shift = listen_port - int(kv["default_listen"].rpartition(":")[2])
    return {
        f["name"]: int(f["default_listen"].rpartition(":")[2]) + shift
        for f in sluice._native.FRONTS
        if not f["kv_port"]
    }


def listen_port_with_free_fronts() -> int:
    """A port for `--listen` that is free, and so are the ports its fronts are placed on beside
    it. Drawn below the ephemeral range (32768 and up), where the free ports other tests bind to
    come from; still checked just before the node starts, as another test may take one."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(12000, 28000)
        if is_free(port) and all(is_free(p) for p in beside(port).values()):
            return port
    raise AssertionError("no listen port with free fronts beside it")


class Watched:
    """A child process whose stderr is read on a thread, so that a wait for a line is bounded;
    `what` names it in failures."""

    what = "the process"

    def _watch(self, proc: subprocess.Popen) -> None:
        import queue
        import threading

        self.proc = proc
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, text: str, timeout: float = 30) -> str:
        import queue
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(
                    f"{self.what} exited ({self.proc.wait()}): {''.join(self.lines)[-3000:]}"
                )
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} within {timeout} s: {''.join(self.lines)[-3000:]}")


class Node(Watched):
    """A `sluice serve` process on a free port; stderr is read on a thread so waits are bounded.
    Every listener the `args` do not set gets a free port; with `free_fronts` False, iproto,
    TANK and Greenstack are left to the node, which places them beside `--listen`."""

    what = "sluice serve"

    def __init__(
        self, data_dir: Path, *args: str, env: dict[str, str] | None = None, free_fronts: bool = True
    ) -> None:
        cmd = [sys.executable, "-m", "sluice", "serve", "--data-dir", str(data_dir), *args]
        if "--listen" not in args:
            cmd += ["--listen", "127.0.0.1:0"]
        if "--admin-listen" not in args:
            cmd += ["--admin-listen", "127.0.0.1:0"]
        for flag in ("--iproto-listen", "--tank-listen", "--greenstack-listen"):
            if free_fronts and flag not in args:
                cmd += [flag, "127.0.0.1:0"]
        self.data_dir = data_dir
        self._watch(
            subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        )
        ready = self.wait_for("sluice ready")
        self.address = ready.split("listening on ")[1].split(" ")[0]
        self.admin = ready.split("(admin ")[1].split(")")[0]
        # "off" when the node serves no iproto; a front's TLS port follows its own: "(iproto
        # HOST:PORT, TLS HOST:PORT)".
        fronts = {
            title: ready.split(f"({title} ")[1].split(")")[0].split(", TLS ")
            for title in ("iproto", "TANK", "Greenstack")
        }
        self.iproto, self.tank, self.greenstack = (fronts[t][0] for t in ("iproto", "TANK", "Greenstack"))
        #: The TLS ports of the fronts that have one, by title.
        self.tls_fronts = {t: a[1] for t, a in fronts.items() if len(a) > 1}
        host, _, port = self.address.rpartition(":")
        self.host, self.port = host, int(port)

    def inject(self, name: str, value: int) -> dict[str, int]:
        """Sets a fault injection point (`POST /errinj`) of a node started with SLUICE_ERRINJ;
        answers every point's value."""
        token = (self.data_dir / "admin.token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}", "X-Sluice-Request": "1"}
        code, _, body = admin_post(self, f"/errinj?name={name}&value={value}", headers)
        assert code == 200, body
        return json.loads(body)

    def metrics(self) -> str:
        """GET /metrics: the Prometheus text."""
        return admin_get(self.admin, "/metrics")

    def metric(self, name: str, **labels: str) -> float:
        """The value of the series `name` with exactly `labels`; fails when it is not there."""
        return metric_value(self.metrics(), name, **labels)

    def metric_sum(self, name: str) -> float:
        """The sum over every series of `name`, whatever its labels (0 when there is none)."""
        return sum(v for n, _, v in metric_samples(self.metrics()) if n == name)

    def status(self) -> dict:
        """GET /status, parsed."""
        return json.loads(admin_get(self.admin, "/status"))

    def seqnos(self) -> list[int]:
        """The high seqno of each vbucket of the first bucket."""
        return [v["high_seqno"] for v in self.status()["buckets"][0]["vbuckets"]]

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def log(self) -> str:
        """Everything the server wrote to stderr so far (after it exits: all of it)."""
        import queue

        while True:
            try:
                line = self._q.get(timeout=5 if self.proc.poll() is not None else 0)
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
        return "".join(self.lines)

    def stop(self, sig: int = 15, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return wait_or_dump(self.proc, timeout, self.log)


def wait_or_dump(proc: subprocess.Popen, timeout: float, log: Callable[[], str]) -> int:
    """Waits for a `sluice serve` child to exit. If it does not within `timeout`, it is sent
    SIGABRT (serve enables faulthandler: every thread's Python stack goes to stderr), then
    killed, and the test fails with its whole stderr."""
    import signal

    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        raise AssertionError(
            f"sluice serve (pid {proc.pid}) did not exit within {timeout} s; its stderr:\n{log()}"
        ) from None


NUM_VBUCKETS = 16  # of the default bucket of a node from start_node (64 is the default)


def send_without_reading(sock: socket.socket, requests: bytes, rounds: int = 200) -> None:
    """Sends `requests` again and again and never reads, until the peer stops reading too (the
    socket buffers are full; `sock` needs a timeout), closes, or `rounds` are sent."""
    try:
        for _ in range(rounds):
            sock.sendall(requests)
    except (TimeoutError, ConnectionResetError, BrokenPipeError):
        pass


def fill_for_a_slow_recovery(node: Node) -> None:
    """Writes enough to `node` that recovering it takes a while (a million and a half WAL
    records: about half a second here), for tests of what clients see meanwhile."""
    n = 1_500_000
    r = sluice._native.bench(node.address, get_ratio=0.0, count=n, keys=n, prefill=False, pipeline=64)
    assert r["errors"] == 0, r


def node_config(tmp_path: Path, name: str, extra: str = "", **bucket: object) -> Path:
    """A node's configuration: the default bucket with `bucket`'s keys, then `extra` (TOML)."""
    vbuckets = bucket.pop("num_vbuckets", NUM_VBUCKETS)
    lines = ["[snapshot]", "interval = 0", "[buckets.default]", f"num_vbuckets = {vbuckets}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in bucket.items()]
    p = tmp_path / f"{name}.toml"
    p.write_text("\n".join(lines) + "\n" + extra)
    return p


def start_node(tmp_path: Path, name: str, *args: str, extra: str = "", **bucket: object) -> Node:
    """A node on tmp_path/name with node_config's configuration and the serve `args`."""
    return Node(tmp_path / name, "--config", str(node_config(tmp_path, name, extra, **bucket)), *args)


def wait_converged(active: Node, replica: Node, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if active.seqnos() == replica.seqnos():
            return
        time.sleep(0.05)
    raise AssertionError(f"no convergence in {timeout} s: {active.seqnos()} vs {replica.seqnos()}")


def contents(node: Node) -> dict[tuple[int, bytes], tuple]:
    """Every key's current version (tombstones included) as the node's DCP stream gives it."""
    out = {}
    client = sluice.Client(node.address, name=f"check-{random.random()}")
    with client.stream(list(range(NUM_VBUCKETS)), start="beginning", end="now", format="python") as s:
        for batch in s:
            for c in batch:
                out[(c.vbucket, c.key)] = (c.seqno, c.op, c.value, c.cas, c.rev_seqno, c.flags)
    return out
