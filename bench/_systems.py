"""sluice, Redis and Tarantool as a primary and a replica on this machine, behind one interface
(start, load, catch-up, durable writes), each in fresh processes on a temp dir."""

from __future__ import annotations

import shutil
import string
import time
from contextlib import ExitStack
from pathlib import Path

from _common import Proc, SluiceNode, free_port, log, wait_until
from _load import KEY, RESP_WAIT_1, VALUE, Conn, run_load, set_request

try:
    import redis
except ImportError:  # the Redis peer is skipped
    redis = None
try:
    import msgpack
except ImportError:  # the Tarantool peer is skipped
    msgpack = None


class System:
    kind = ""
    space = 0  # Tarantool: the space writes go to
    primary_addr = ""
    replica_addr = ""

    def __init__(self, work: Path, stack: ExitStack, items: int, majority: bool = False) -> None:
        self.work = work
        self.stack = stack
        self.items = items
        self.majority = majority

    def start_primary(self) -> None:
        raise NotImplementedError

    def start_replica(self) -> float:
        """Spawns the replica; returns its spawn time (perf_counter)."""
        raise NotImplementedError

    def load(self, n: int) -> None:
        raise NotImplementedError

    def caught_up(self, n: int) -> bool:
        raise NotImplementedError

    def wait_following(self, timeout: float = 120.0) -> None:
        """Waits until the replica follows the primary (connected and streaming)."""

    def settle(self, timeout: float = 120.0) -> None:
        """Waits until the replica has every write so far (the primary is idle): a probe written
        now is visible on the replica (Redis and Tarantool replicate one ordered stream)."""
        self.wait_following(timeout)
        key = b"settle:%09d" % (time.monotonic_ns() % 10**9)
        w, r = Conn(self.kind, self.primary_addr), Conn(self.kind, self.replica_addr)
        try:
            if not w.set(key, self.space):
                raise RuntimeError(f"{self.kind}: settle write failed")
            wait_until(lambda: r.replica_has(key, self.space), timeout, f"{self.kind} settle", 0.005)
        finally:
            w.close()
            r.close()

    def durable_write(self, conn: Conn, key: bytes) -> bool:
        """One write acknowledged by the replica too."""
        return conn.set(key, self.space)

    def extra(self) -> dict:
        return {}


class Sluice(System):
    kind = "sluice"

    def config(self) -> Path:
        path = self.work / ("majority.toml" if self.majority else "sluice.toml")
        text = '[wal]\nmode = "write"\n\n[buckets.default]\nmemory_quota = "4GiB"\n'
        if self.majority:
            text += 'durability = "majority"\nreplicas = 1\n'
        path.write_text(text)
        return path

    def start_primary(self) -> None:
        self.active = SluiceNode(self.work / "active", self.config())
        self.stack.callback(self.active.stop)
        self.primary_addr = self.active.address

    def start_replica(self) -> float:
        self.replica = SluiceNode(self.work / "replica", self.config(), replica_of=self.active.address)
        self.stack.callback(self.replica.stop)
        self.replica_addr = self.replica.address
        return self.replica.spawned

    def load(self, n: int) -> None:
        r = run_load("sluice", self.primary_addr, 0, 0, 3600, n, depth=512, sequential=True)
        if r["errors"] or r["ops"] != n:
            raise RuntimeError(f"sluice load: {r}")
        log(f"  sluice: loaded {n:,} items in {r['seconds']:.1f} s")
        self.target = self.active.seqnos("active")[0]

    def caught_up(self, n: int) -> bool:
        if self.replica.proc.poll() is not None:
            raise RuntimeError(f"sluice replica exited: {''.join(self.replica.lines)[-3000:]}")
        seq, items = self.replica.seqnos("replica")
        return seq == self.target and items >= n

    def settle(self, timeout: float = 120.0) -> None:
        super().settle(timeout)  # the replica follows
        target = self.active.seqnos("active")[0]
        wait_until(lambda: self.replica.seqnos("replica")[0] >= target, timeout, "sluice settle")

    def durable_write(self, conn: Conn, key: bytes) -> bool:
        return conn.set(key)

    def extra(self) -> dict:
        return {"replica_ready_after_spawn_s": self.replica.ready_at - self.replica.spawned}


class Redis(System):
    kind = "redis"

    def _server(self, name: str, extra: list[str]) -> tuple[Proc, int]:
        port = free_port()
        d = self.work / name
        d.mkdir()
        cmd = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", str(d)]
        cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", ""]
        cmd += ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        p = Proc(cmd + extra, d / "redis.log")
        self.stack.callback(p.stop)
        return p, port

    def _client(self, port: int) -> redis.Redis:
        c = redis.Redis(host="127.0.0.1", port=port, socket_timeout=30, socket_connect_timeout=5)
        self.stack.callback(c.close)
        return c

    @staticmethod
    def _ping(c: redis.Redis) -> bool:
        try:
            return bool(c.ping())
        except redis.exceptions.RedisError:
            return False

    def start_primary(self) -> None:
        self.pproc, port = self._server("primary", [])
        self.primary_addr = f"127.0.0.1:{port}"
        self.pcli = self._client(port)
        wait_until(lambda: self.pproc.check() or self._ping(self.pcli), 30, "redis primary")

    def start_replica(self) -> float:
        port = free_port()
        t = time.perf_counter()
        d = self.work / "replica"
        d.mkdir()
        cmd = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", str(d)]
        cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", ""]
        cmd += [
            "--repl-diskless-load",
            "on-empty-db",
            "--replicaof",
            "127.0.0.1",
            self.primary_addr.split(":")[1],
        ]
        self.rproc = Proc(cmd, d / "redis.log")
        self.stack.callback(self.rproc.stop)
        self.replica_addr = f"127.0.0.1:{port}"
        self.rcli = self._client(port)
        return t

    def load(self, n: int) -> None:
        t = time.perf_counter()
        for start in range(0, n, 10_000):
            pipe = self.pcli.pipeline(transaction=False)
            for i in range(start, min(start + 10_000, n)):
                pipe.set(KEY % i, VALUE)
            pipe.execute()
        if self.pcli.dbsize() != n:
            raise RuntimeError(f"redis load: dbsize {self.pcli.dbsize()} != {n}")
        log(f"  redis: loaded {n:,} items in {time.perf_counter() - t:.1f} s")

    def caught_up(self, n: int) -> bool:
        self.rproc.check()
        try:
            info = self.rcli.info("replication")
            return info.get("master_link_status") == "up" and self.rcli.dbsize() == n
        except redis.exceptions.RedisError:  # not listening yet, or LOADING
            return False

    def wait_following(self, timeout: float = 120.0) -> None:
        wait_until(lambda: self.rproc.check() or self.link_up(), timeout, "redis replica link", 0.02)

    def link_up(self) -> bool:
        try:
            return self.rcli.info("replication").get("master_link_status") == "up"
        except redis.exceptions.RedisError:
            return False

    def durable_write(self, conn: Conn, key: bytes) -> bool:
        conn.send(set_request("redis", key) + RESP_WAIT_1)
        ok, _ = conn.reply()
        acked, n = conn.reply()
        return ok and acked and isinstance(n, int) and n >= 1


TARANTOOL_MASTER = string.Template(
    """
box.cfg{
    listen = '127.0.0.1:$port',
    work_dir = '$dir',
    memtx_memory = $memtx,
    log = '$dir/tarantool.log',
    replication_synchro_quorum = 2,
    replication_synchro_timeout = 5,
}
box.once('bench', function()
    box.schema.user.grant('guest', 'read,write,execute,create,drop', 'universe')
    box.schema.user.grant('guest', 'replication')
    box.schema.space.create('kv'):create_index('pk', {type = 'hash', parts = {1, 'string'}})
    box.schema.space.create('kvsync', {is_sync = true}):create_index(
        'pk', {type = 'hash', parts = {1, 'string'}})
end)
function bench_load(n, value)
    local s = box.space.kv
    for i = 0, n - 1, 1000 do
        box.begin()
        for j = i, math.min(i + 999, n - 1) do
            s:replace{string.format('key:%012d', j), value}
        end
        box.commit()
    end
    return s:len()
end
"""
)
TARANTOOL_REPLICA = string.Template(
    """
box.cfg{
    listen = '127.0.0.1:$port',
    work_dir = '$dir',
    memtx_memory = $memtx,
    log = '$dir/tarantool.log',
    replication = {'$master'},
    replication_connect_timeout = 60,
    read_only = true,
}
"""
)


class Tarantool(System):
    kind = "tarantool"

    def _start(self, name: str, template: string.Template, **kw: object) -> tuple[Proc, str]:
        port = free_port()
        d = self.work / name
        d.mkdir()
        memtx = max(1 << 30, self.items * 512)
        script = d / "init.lua"
        script.write_text(template.substitute(port=port, dir=str(d), memtx=memtx, **kw))
        p = Proc(["tarantool", str(script)], d / "stdout.log", cwd=d)
        self.stack.callback(p.stop)
        return p, f"127.0.0.1:{port}"

    def _eval(self, address: str, expr: str, *args: object, timeout: float = 30) -> list | None:
        """Lua on a server; None while it cannot answer (starting, bootstrapping)."""
        try:
            c = Conn("tarantool", address, timeout=timeout)
        except OSError:
            return None
        try:
            return c.eval(expr, *args)
        except (OSError, RuntimeError):
            return None
        finally:
            c.close()

    def start_primary(self) -> None:
        self.mproc, self.primary_addr = self._start("master", TARANTOOL_MASTER)

        def ready() -> bool:
            self.mproc.check()
            return self._eval(self.primary_addr, "return box.space.kvsync ~= nil") == [True]

        wait_until(ready, 30, "tarantool master")
        ids = self._eval(self.primary_addr, "return box.space.kv.id, box.space.kvsync.id")
        assert ids is not None
        self.space = ids[1] if self.majority else ids[0]

    def start_replica(self) -> float:
        t = time.perf_counter()
        self.rproc, self.replica_addr = self._start("replica", TARANTOOL_REPLICA, master=self.primary_addr)
        return t

    def load(self, n: int) -> None:
        t = time.perf_counter()
        got = self._eval(self.primary_addr, "return bench_load(...)", n, VALUE.decode(), timeout=600)
        if got != [n]:
            raise RuntimeError(f"tarantool load: {got}")
        log(f"  tarantool: loaded {n:,} items in {time.perf_counter() - t:.1f} s")

    def caught_up(self, n: int) -> bool:
        self.rproc.check()
        got = self._eval(self.replica_addr, "return box.space.kv and box.space.kv:len() or -1", timeout=10)
        return got == [n]

    def wait_following(self, timeout: float = 120.0) -> None:
        """The replica has bootstrapped and the master streams to it. With 2.6.0, a replica that
        joins while a sync write waits for its quorum aborts its bootstrap (ER_SYNC_ROLLBACK on
        the timed-out write) and never follows, so no durable write may come before this."""
        expr = (
            "for _, r in pairs(box.info.replication) do "
            "if r.downstream and r.downstream.status == 'follow' then return true end end "
            "return false"
        )

        def following() -> bool:
            self.rproc.check()
            running = self._eval(self.replica_addr, "return box.info.status", timeout=10) == ["running"]
            return running and self._eval(self.primary_addr, expr, timeout=10) == [True]

        wait_until(following, timeout, "tarantool replica following", 0.02)


SYSTEM_CLASSES = {"sluice": Sluice, "redis": Redis, "tarantool": Tarantool}


def peer_problem(kind: str) -> str | None:
    """Why a peer cannot run here, or None."""
    if kind == "redis":
        if shutil.which("redis-server") is None:
            return "redis-server is not installed (apt-get install redis-server)"
        if redis is None:
            return "the redis Python package is missing (pip install redis)"
    if kind == "tarantool":
        if shutil.which("tarantool") is None:
            return "tarantool is not installed (apt-get install tarantool)"
        if msgpack is None:
            return "the msgpack Python package is missing (pip install msgpack)"
    return None
