"""Typed surface of the native module (rust/sluice-py). Checked against the built module by
tests/test_lint.py (mypy's stubtest)."""

import os
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, TypeVar, final, overload

__all__ = [
    "BucketSettings",
    "ClosedError",
    "ConfigError",
    "CorruptionError",
    "DEFAULTS",
    "FRONTS",
    "DcpConsumer",
    "DurabilityImpossibleError",
    "SyncWriteAmbiguousError",
    "EmbeddedEngine",
    "EngineSettings",
    "GreenstackWarmup",
    "ExistsError",
    "InvalidKeyError",
    "ItemView",
    "Mutation",
    "NoSuchBucketError",
    "NotFoundError",
    "NotMyVbucketError",
    "NotNumericError",
    "NotStoredError",
    "PolicyCall",
    "RawBatch",
    "Server",
    "SluiceError",
    "TempFailError",
    "TooBigError",
    "WalFailedError",
    "__version__",
    "bench",
    "check_server_settings",
    "check_topic_settings",
    "errinj_enable",
    "errinj_set",
    "errinj_values",
    "flush_logs",
    "greenstack_decode",
    "greenstack_frame",
    "msgpack_json",
    "tank_consume_answer",
    "tank_consume_frame",
    "tank_produce_frame",
    "tap_drain",
    "tarantool_schema",
    "tarantool_tail",
    "tls_issue",
    "tuple_columns",
    "vbucket_of",
    "vbucket_positions",
    "wal_dump",
]

__version__: str

_Message = TypeVar("_Message", bound=tuple[Any, ...])
_Row = TypeVar("_Row", bound=tuple[Any, ...])

# The default of every configuration key with a Rust counterpart, by config.py's dotted key
# name (bucket keys as "buckets.KEY"); read-only. The keyword defaults below are these values.
DEFAULTS: Mapping[str, Any]
FRONTS: list[dict[str, Any]]

class SluiceError(Exception): ...
class InvalidKeyError(SluiceError): ...
class TooBigError(SluiceError): ...
class NotFoundError(SluiceError): ...
class ExistsError(SluiceError): ...
class NotStoredError(SluiceError): ...
class NotNumericError(SluiceError): ...
class NotMyVbucketError(SluiceError): ...
class TempFailError(SluiceError): ...
class WalFailedError(SluiceError): ...
class DurabilityImpossibleError(SluiceError): ...
class SyncWriteAmbiguousError(SluiceError): ...
class NoSuchBucketError(SluiceError): ...
class ConfigError(SluiceError): ...
class CorruptionError(SluiceError): ...
class ClosedError(SluiceError): ...

@final
class BucketSettings:
    """One bucket's settings."""

    def __new__(
        cls,
        name: str,
        *,
        num_vbuckets: int = ...,
        memory_quota: int = ...,
        high_watermark: float = ...,
        max_item_size: int = ...,
        checkpoint_memory_ratio: float = ...,
        durability: str = ...,
        replicas: int = ...,
        durability_timeout: float = ...,
        eviction: str = ...,
        ordered_keys: bool = False,
    ) -> BucketSettings: ...
    @property
    def name(self) -> str: ...
    @property
    def num_vbuckets(self) -> int: ...

@final
class EngineSettings:
    """The engine's settings: one native object built from the validated TOML."""

    def __new__(
        cls,
        data_dir: str | os.PathLike[str],
        *,
        wal_mode: str = ...,
        wal_segment_size: int = ...,
        snapshot_count: int = ...,
        snapshot_interval: float = ...,
        checkpoint_max_items: int = ...,
        checkpoint_period: float = ...,
        tombstone_purge_age: float = ...,
        expiry_pager_interval: float = ...,
        force_recovery: bool = ...,
        replica: bool = ...,
        buckets: list[BucketSettings] | None = None,
    ) -> EngineSettings: ...
    @property
    def data_dir(self) -> str: ...
    @property
    def wal_mode(self) -> str: ...
    @property
    def bucket_names(self) -> list[str]: ...

@final
class Mutation:
    """The result of a mutation."""

    @property
    def cas(self) -> int: ...
    @property
    def vbucket(self) -> int: ...
    @property
    def seqno(self) -> int: ...
    @property
    def lsn(self) -> int: ...

@final
class ItemView:
    """A stored item as read back; `expiry` holds the delete time of a tombstone."""

    @property
    def key(self) -> bytes: ...
    @property
    def value(self) -> bytes: ...
    @property
    def flags(self) -> int: ...
    @property
    def expiry(self) -> int: ...
    @property
    def cas(self) -> int: ...
    @property
    def rev_seqno(self) -> int: ...
    @property
    def seqno(self) -> int: ...
    @property
    def datatype(self) -> int: ...
    @property
    def deleted(self) -> bool: ...

@final
class EmbeddedEngine:
    """An open data directory: the storage engine embedded in this process."""

    def __new__(cls, settings: EngineSettings) -> EmbeddedEngine: ...
    def set(
        self,
        key: bytes,
        value: bytes,
        *,
        bucket: str = "default",
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
        cas: int = 0,
        mode: str = "set",
        durability: str | None = None,
    ) -> Mutation: ...
    def set_many(
        self,
        items: list[tuple[bytes, bytes]],
        *,
        bucket: str = "default",
        flags: int = 0,
        expiry: int = 0,
        durability: str | None = None,
    ) -> int: ...
    def delete(
        self, key: bytes, *, bucket: str = "default", cas: int = 0, durability: str | None = None
    ) -> Mutation: ...
    def append(
        self, key: bytes, data: bytes, *, bucket: str = "default", cas: int = 0, durability: str | None = None
    ) -> Mutation: ...
    def prepend(
        self, key: bytes, data: bytes, *, bucket: str = "default", cas: int = 0, durability: str | None = None
    ) -> Mutation: ...
    def incr(
        self,
        key: bytes,
        delta: int = 1,
        *,
        initial: int = 0,
        expiry: int = 0,
        bucket: str = "default",
        cas: int = 0,
        durability: str | None = None,
    ) -> tuple[Mutation, int]: ...
    def decr(
        self,
        key: bytes,
        delta: int = 1,
        *,
        initial: int = 0,
        expiry: int = 0,
        bucket: str = "default",
        cas: int = 0,
        durability: str | None = None,
    ) -> tuple[Mutation, int]: ...
    def touch(self, key: bytes, expiry: int, *, bucket: str = "default") -> Mutation: ...
    def gat(self, key: bytes, expiry: int, *, bucket: str = "default") -> tuple[Mutation, ItemView]: ...
    def flush(self, *, bucket: str = "default") -> int: ...
    def get(self, key: bytes, *, bucket: str = "default") -> ItemView | None: ...
    def get_meta(self, key: bytes, *, bucket: str = "default") -> ItemView | None: ...
    def vbucket_of(self, key: bytes, *, bucket: str = "default") -> int: ...
    def high_seqnos(self, *, bucket: str = "default") -> list[int]: ...
    def persisted_seqnos(self, *, bucket: str = "default") -> list[int]: ...
    def failover_log(self, vbucket: int, *, bucket: str = "default") -> list[tuple[int, int]]: ...
    def vbucket_state(self, vbucket: int, *, bucket: str = "default") -> str: ...
    def set_vbucket_state(self, vbucket: int, state: str, *, bucket: str = "default") -> None: ...
    def snapshot(self) -> str: ...
    def run_expiry_pager(self) -> int: ...
    def set_wal_failpoint(self, name: str) -> None: ...
    def stats(self, *, bucket: str = "default") -> dict[str, int | bool]: ...
    def create_topic(self, name: str, partitions: int, settings: str) -> None: ...
    def topics(self) -> list[tuple[str, int, str]]: ...
    def topic_high_water_marks(self, name: str) -> list[int]: ...
    def topic_branches(self, name: str) -> list[int]: ...
    def recovery_report(self) -> dict[str, object]: ...
    @property
    def instance(self) -> str: ...
    def close(self) -> None: ...
    def __enter__(self) -> EmbeddedEngine: ...
    def __exit__(
        self,
        t: type[BaseException] | None,
        v: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

@final
class GreenstackWarmup:
    """The Greenstack port while the engine opens: connections say HELLO and are told the
    server is warming up; a Server given it takes them over and tells them warm-up is done."""

    def __new__(cls, address: str) -> GreenstackWarmup: ...
    @property
    def address(self) -> str: ...

@final
class Server:
    """The memcached binary protocol server over an open engine."""

    def __new__(
        cls, engine: EmbeddedEngine, settings: str, *, greenstack_warmup: GreenstackWarmup | None = None
    ) -> Server: ...
    @property
    def address(self) -> str: ...
    @property
    def admin_address(self) -> str | None: ...
    @property
    def tls_address(self) -> str | None: ...
    @property
    def fronts(self) -> dict[str, str]: ...
    @property
    def tls_fronts(self) -> dict[str, str]: ...
    def reload_tls(self) -> bool: ...
    def set_users(
        self, users: list[tuple[str, dict[str, str], dict[str, list[str]], dict[str, list[str]]]]
    ) -> None: ...
    def promote(self) -> dict[str, list[int]]: ...
    def converge(
        self, rev: int, servers: list[str], this: int | None, chains: list[list[int]]
    ) -> dict[str, list[Any]]: ...
    def followers(self, bucket: str) -> list[list[str]]: ...
    def accept_connections(self) -> None: ...
    def take_over(
        self, bucket: str, vbucket: int, source: str, timeout: float = 60.0
    ) -> dict[str, float | int]: ...
    def report_cluster(self, report: str) -> None: ...
    def take_cluster_requests(self) -> list[str]: ...
    def place_topics(
        self,
        cluster: str,
        bucket: str,
        topics: dict[str, list[tuple[str, int, int, str, bool]]],
        nodes: list[tuple[str, bool, int]],
    ) -> None: ...
    def route(self, this: int | None, nodes: list[tuple[str, str]], actives: list[int]) -> None: ...
    def stop(self, grace: float = 5.0) -> None: ...
    def policy_install(self, kind: str, installed: bool) -> None: ...
    def policy_set_timeout(self, seconds: float) -> None: ...
    def policy_next(self, kind: str, wait: float = 0.5) -> PolicyCall | None: ...

@final
class PolicyCall:
    """One question from the server to a policy plugin (see sluice.policy)."""

    @property
    def kind(self) -> str: ...
    def question(self) -> dict[str, Any]: ...
    def filter_keys(self) -> tuple[bytes, bytes, bytes]: ...
    @property
    def age(self) -> float: ...
    def answer(self, value: Any) -> None: ...
    def fail(self) -> None: ...

@final
class RawBatch:
    """One batch of DCP documents in columns (native byte order)."""

    @property
    def num_rows(self) -> int: ...
    def buffers(self) -> dict[str, bytes]: ...
    def spark_buffers(self, include_deletes: bool, xattrs: bool = False) -> dict[str, Any]: ...
    @overload
    def rows(
        self, row_type: None = None
    ) -> list[tuple[int, int, str, bytes, bytes, int, int, int, int, int]]: ...
    @overload
    def rows(self, row_type: type[_Row]) -> list[_Row]: ...
    @property
    def ended(self) -> list[tuple[int, int]]: ...
    @property
    def rollbacks(self) -> list[tuple[int, int]]: ...

@final
class DcpConsumer:
    """DCP streams on native threads (a connection per node streamed from); with
    ``follow_moves``, each vbucket streams from the active the cluster map names and follows
    it when it moves, failing after ``move_timeout`` seconds without a node."""

    def __new__(
        cls,
        address: str,
        *,
        bucket: str = "default",
        username: str | None = None,
        password: str | None = None,
        name: str = "sluice:consumer",
        vbuckets: list[int] | None = None,
        from_now: bool = False,
        to_latest: bool = False,
        end_seqnos: dict[int, int] | None = None,
        state: str | None = None,
        rollback: str = "ask",
        batch_size: int = 8192,
        buffer_size: int = 16777216,
        noop_interval: int = 20,
        include_values: bool = True,
        include_xattrs: bool = False,
        cursor_dropping: bool = False,
        setup_timeout: float | None = None,
        topic: str | None = None,
        follow_moves: bool = True,
        move_timeout: float = 60.0,
        cafile: str | None = None,
    ) -> DcpConsumer: ...
    def next_event(
        self, timeout: float
    ) -> tuple[str] | tuple[str, RawBatch] | tuple[str, int, int] | None: ...
    def resume(self, vbucket: int) -> None: ...
    def state_json(self) -> str: ...
    def positions(self) -> list[tuple[int, int, int, int, bool]]: ...
    def close(self) -> None: ...

def bench(
    target: str,
    *,
    connections: int = 16,
    pipeline: int = 32,
    duration: float = 10.0,
    count: int = 0,
    keys: int = 100000,
    key_size: int = 16,
    value_size: int = 100,
    get_ratio: float = 0.9,
    prefill: bool = True,
    threads: int = 2,
    user: str | None = None,
    password: str | None = None,
    cacert: str | None = None,
    protocol: str = "memcached",
    space: int = 512,
    durability: str | None = None,
    unordered: bool = False,
) -> dict[str, object]: ...
def vbucket_positions(
    address: str,
    *,
    bucket: str = "default",
    username: str | None = None,
    password: str | None = None,
    state: str = "active",
    timeout: float = 10.0,
    topic: str | None = None,
) -> list[tuple[int, int, list[tuple[int, int]]]]: ...
def flush_logs(timeout: float = 1.0) -> bool: ...
def wal_dump(path: str | os.PathLike[str], fd: int) -> int: ...
def vbucket_of(key: bytes, num_vbuckets: int) -> int: ...
def msgpack_json(data: bytes) -> str: ...
def tuple_columns(
    batch: RawBatch, kinds: list[str], primary_key: list[int], include_deletes: bool
) -> dict[str, Any]: ...
def tarantool_tail(
    address: str,
    fd: int,
    *,
    user: str | None = None,
    password: str | None = None,
    snapshot: bool = False,
    max_rows: int = 0,
    timeout: float = 10.0,
    idle: float = 10.0,
    state: str | os.PathLike[str] | None = None,
) -> int: ...
def tarantool_schema(
    address: str,
    *,
    user: str | None = None,
    password: str | None = None,
    timeout: float = 10.0,
) -> tuple[list[str], list[str]]: ...
def errinj_set(name: str, value: int) -> None: ...
def errinj_enable(spec: str) -> None: ...
def errinj_values() -> dict[str, int]: ...
def greenstack_frame(
    opaque: int,
    opcode: int,
    payload: Mapping[str, Any] | None = None,
    *,
    flags: int = 0,
    status: int | None = None,
    flex: list[tuple[int, bytes]] = ...,
) -> bytes: ...
def greenstack_decode(
    body: bytes,
) -> tuple[int, int, int, int | None, dict[int, bytes], dict[str, Any]]: ...
def check_topic_settings(text: str) -> None: ...
def check_server_settings(settings: str, max_item: int, replica: bool) -> None: ...
def tank_produce_frame(
    request_id: int,
    topic: str,
    partition: int,
    messages: Iterable[bytes | bytearray | memoryview | tuple[bytes | None, bytes]],
    *,
    ts_ms: int,
    snappy: bool = False,
    base_seq: int | None = None,
    required_acks: int = 0,
    ack_timeout_ms: int = 0,
) -> bytes: ...
def tank_consume_frame(
    request_id: int,
    topic: str,
    partitions: list[tuple[int, int, int]],
    *,
    max_wait_ms: int,
    min_bytes: int,
) -> bytes: ...
def tank_consume_answer(
    payload: bytes, seqs: list[tuple[int, int]], message: type[_Message]
) -> list[tuple[int, str, int, int, list[_Message], int, int]]: ...
def tap_drain(
    target: str,
    *,
    name: bytes | None = None,
    flags: int = 0,
    backfill_since: int | None = None,
    vbuckets: list[int] | None = None,
    count: int = 0,
    timeout: float = 60.0,
) -> dict[str, Any]: ...
def tls_issue(names: list[str], addresses: list[str], *, years: int = 2) -> tuple[str, str, str, str]: ...
