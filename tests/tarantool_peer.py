"""A real Tarantool 2.6 (the Debian `tarantool` binary) as a peer for comparisons with sluice's
iproto front: started in a temp dir from a generated init.lua that declares the same spaces, user
and grants as the sluice configuration `sluice_config` writes, on a free port.

Tests that use it skip when the binary is missing (`TARANTOOL_MISSING`); .ci/run installs it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

TARANTOOL = shutil.which("tarantool")
TARANTOOL_MISSING = "the tarantool binary is not installed (apt-get install tarantool; .ci/run installs it)"

USER = "app"
PASSWORD = "secret"
CDC_PASSWORD = "cdc secret"


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    type: str
    is_nullable: bool = False


@dataclasses.dataclass(frozen=True)
class Space:
    name: str
    id: int
    format: tuple[Field, ...]
    primary_key: tuple[str, ...]  # field names, in key order

    def part(self, name: str) -> tuple[int, str]:
        """(1-based field number, type) of the field `name`."""
        for no, f in enumerate(self.format, 1):
            if f.name == name:
                return no, f.type
        raise KeyError(name)


# `users` as in the captures (shared/reference/tarantool-captures), and a space whose primary key
# has two parts, for partial-key reads.
USERS = Space(
    "users",
    512,
    (Field("id", "unsigned"), Field("name", "string"), Field("age", "unsigned")),
    ("id",),
)
EVENTS = Space(
    "events",
    513,
    (
        Field("user_id", "unsigned"),
        Field("seq", "unsigned"),
        Field("kind", "string"),
        Field("note", "string", True),
    ),
    ("user_id", "seq"),
)
SPACES = (USERS, EVENTS)


def _lua(value: object) -> str:
    """A Lua literal for a str, bool, int or a list/dict of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid Lua string for what we write
    if isinstance(value, (list, tuple)):
        return "{" + ", ".join(_lua(v) for v in value) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_lua(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def _field_dict(f: Field) -> dict:
    d: dict = {"name": f.name, "type": f.type}
    if f.is_nullable:
        d["is_nullable"] = True
    return d


def init_lua(
    work_dir: Path,
    ready_file: Path,
    spaces: tuple[Space, ...],
    wal_mode: str,
    extra_lua: str = "",
    listen: str = "127.0.0.1:0",
) -> str:
    """The init script: box.cfg on `listen` (a free loopback port), then once per data
    directory the spaces with a TREE primary index named `primary`, user USER with read and
    write on each space and execute on universe (sluice lets any user CALL its built-in set:
    `box.session.user`, `box.space.NAME:count` ...) and the `extra_lua`; then the bound address
    written to `ready_file` (so a reader never sees a half-made schema)."""
    lines = [
        "box.cfg{",
        f"    listen = {_lua(listen)},",
        f"    work_dir = {_lua(str(work_dir))},",
        "    log = 'tarantool.log',",
        f"    wal_mode = {_lua(wal_mode)},",
        "    memtx_memory = 1024 * 1024 * 1024,",
        "    checkpoint_interval = 0,",
        "}",
        "box.once('sluice-tests-schema', function()",
        f"box.schema.user.create({_lua(USER)}, {{password = {_lua(PASSWORD)}}})",
    ]
    for s in spaces:
        fmt = _lua([_field_dict(f) for f in s.format])
        parts = _lua([{"field": s.part(n)[0], "type": s.part(n)[1]} for n in s.primary_key])
        lines += [
            f"local {s.name} = box.schema.space.create({_lua(s.name)}, {{id = {s.id}, format = {fmt}}})",
            f"{s.name}:create_index('primary', {{type = 'TREE', parts = {parts}}})",
            f"box.schema.user.grant({_lua(USER)}, 'read,write', 'space', {_lua(s.name)})",
        ]
    lines += [
        f"box.schema.user.grant({_lua(USER)}, 'execute', 'universe')",
        extra_lua,
        "end)",
        f"local f = io.open({_lua(str(ready_file))} .. '.tmp', 'w')",
        "f:write(box.info.listen)",
        "f:close()",
        f"os.rename({_lua(str(ready_file))} .. '.tmp', {_lua(str(ready_file))})",
    ]
    return "\n".join(lines) + "\n"


def chap_sha1_hex(password: str) -> str:
    """What Tarantool stores for chap-sha1 (and sluice's `chap_sha1`): sha1(sha1(password))."""
    return hashlib.sha1(hashlib.sha1(password.encode()).digest()).hexdigest()


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, str)):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def sluice_config(path: Path, spaces: tuple[Space, ...] = SPACES, wal_mode: str = "write") -> Path:
    """A sluice configuration declaring `spaces` as init_lua does, with user USER (chap-sha1 of
    PASSWORD) allowed to read and write each space's bucket, iproto on a free loopback port."""
    out = [
        'iproto_listen = "127.0.0.1:0"',
        'tank_listen = "127.0.0.1:0"',
        'greenstack_listen = "127.0.0.1:0"',
        "[snapshot]",
        "interval = 0",
        "[wal]",
        f"mode = {_toml(wal_mode)}",
    ]
    for s in spaces:
        out += [
            f"[spaces.{s.name}]",
            f"id = {s.id}",
            f"format = {_toml([_field_dict(f) for f in s.format])}",
            f"primary_key = {_toml(list(s.primary_key))}",
        ]
    grants = {s.name: ["read", "write"] for s in spaces}
    out += [f"[users.{USER}]", f"chap_sha1 = {_toml(chap_sha1_hex(PASSWORD))}", f"buckets = {_toml(grants)}"]
    path.write_text("\n".join(out) + "\n")
    return path


class TarantoolPeer:
    """A `tarantool` process serving `spaces` on a free loopback port, in `work_dir`."""

    def __init__(
        self,
        work_dir: Path,
        spaces: tuple[Space, ...] = SPACES,
        wal_mode: str = "write",
        timeout: float = 30,
        extra_lua: str = "",
    ) -> None:
        assert TARANTOOL is not None, TARANTOOL_MISSING
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.work_dir / "tarantool.log"
        self._config = (spaces, wal_mode, extra_lua, timeout)
        self._start("127.0.0.1:0")

    def restart(self) -> None:
        """Stops it (SIGTERM) and starts it again on the same data and the same address."""
        self.stop()
        self._start(self.address)

    def _start(self, listen: str) -> None:
        spaces, wal_mode, extra_lua, timeout = self._config
        ready = self.work_dir / "listen.addr"
        ready.unlink(missing_ok=True)
        script = self.work_dir / "init.lua"
        script.write_text(init_lua(self.work_dir, ready, spaces, wal_mode, extra_lua, listen))
        self._out = open(self.work_dir / "stdout.log", "ab")
        self.proc = subprocess.Popen(
            [TARANTOOL, str(script)], cwd=self.work_dir, stdout=self._out, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"tarantool did not start (exit {self.proc.returncode}): {self.log()}")
            time.sleep(0.02)
        self.address = ready.read_text().strip()
        host, _, port = self.address.rpartition(":")
        self.host, self.port = host, int(port)

    def log(self) -> str:
        text = ""
        for p in (self.work_dir / "stdout.log", self.log_path):
            if p.exists():
                text += p.read_text(errors="replace")[-3000:]
        return text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._out.close()

    def __enter__(self) -> TarantoolPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def follower_config(tmp_path: Path, peer: TarantoolPeer, address: str | None = None) -> Path:
    """`sluice_config` plus `[tarantool_upstream]` following `peer` (or `address`, a proxy in
    front of it) as USER, and a user `cdc` (password CDC_PASSWORD) who may read and stream the
    spaces' buckets."""
    config = sluice_config(tmp_path / "sluice.toml")
    secret = tmp_path / "tarantool.password"
    secret.write_text(PASSWORD + "\n")
    keys = subprocess.run(
        [sys.executable, "-m", "sluice", "user", "hash"], input=CDC_PASSWORD, capture_output=True, text=True
    ).stdout
    with config.open("a") as f:
        f.write(
            f'[users.cdc]\n{keys}buckets = {{ users = ["read", "stream"], events = ["read", "stream"] }}\n'
        )
        f.write(
            f'[tarantool_upstream]\naddress = "{address or peer.address}"\nuser = "{USER}"\n'
            f'password_file = "{secret}"\n'
        )
    return config


def start_follower(tmp_path: Path, config: Path):
    """`sluice serve` with `config` (a helpers.Node), once it follows (after its copy, or
    resumed)."""
    from helpers import Node

    node = Node(tmp_path / "data", "--config", str(config))
    # The follower may log it before the node's ready line, which Node waited for.
    if not any("following the Tarantool at" in line for line in node.lines):
        node.wait_for("following the Tarantool at")
    return node
