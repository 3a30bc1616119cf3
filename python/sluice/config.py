"""Configuration: one definition of every key, TOML validation with the key path and the
reason in every error, and the conversion into the engine's native settings object.

A bad value raises ``ConfigError`` naming the key, e.g.
``invalid config: buckets.default.num_vbuckets: 0 is not in 1..1024``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sluice._native import DEFAULTS, FRONTS, BucketSettings, ConfigError, EngineSettings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on older interpreters only
    import tomli as tomllib

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _fail(path: str, reason: str) -> ConfigError:
    return ConfigError(f"invalid config: {path}: {reason}")


# The native settings hold counts and sizes as 64-bit integers; anything larger must fail here,
# with the key path, rather than as an OverflowError when the settings are built.
_MAX_INT = 2**63 - 1


def _int(path: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(path, f"expected an integer, got {type(v).__name__} {v!r}")
    if v > _MAX_INT:
        raise _fail(path, f"{v} is too large (at most {_MAX_INT})")
    return v


def _float(path: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(path, f"expected a number, got {type(v).__name__} {v!r}")
    try:
        return float(v)
    except OverflowError:
        raise _fail(path, f"{v} is too large") from None


def _bool(path: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _fail(path, f"expected true or false, got {type(v).__name__} {v!r}")
    return v


def _str(path: str, v: Any) -> str:
    if not isinstance(v, str):
        raise _fail(path, f"expected a string, got {type(v).__name__} {v!r}")
    return v


def _path(path: str, v: Any) -> Path:
    # Path("") is ".", which would hide an empty value from the native "must not be empty" check.
    if not _str(path, v):
        raise _fail(path, "must not be empty")
    return Path(v)


def _optional_path(path: str, v: Any) -> Path | str:
    """A path, or "" for none."""
    return _path(path, v) if _str(path, v) != "" else ""


def parse_size(path: str, v: Any) -> int:
    """Bytes from an integer or a string such as "64MiB" or "1GB"."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", v)
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise _fail(path, f'{v!r} is not a size (examples: 4096, "64MiB", "1GB")')
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
        if n > _MAX_INT:
            raise _fail(path, f"{v!r} is too large (at most {_MAX_INT} bytes)")
        return n
    n = _int(path, v)
    if n < 0:
        raise _fail(path, f"{n} is negative")
    return n


def parse_duration(path: str, v: Any) -> float:
    """Seconds from a number or a string such as "500ms", "5s", "10m", "3d"."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*", v)
        if not m:
            raise _fail(path, f'{v!r} is not a duration (examples: 5, "500ms", "10m", "3d")')
        return float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    s = _float(path, v)
    if s < 0:
        raise _fail(path, f"{s} is negative")
    return s


@dataclasses.dataclass(frozen=True)
class Key:
    """One configuration key: where it lives, how it parses, its default, what it does.

    A key with a Rust counterpart takes its default from ``DEFAULTS`` (sluice-py reads it from
    the Rust ``Default`` the native settings start from), so there is one definition of it;
    only keys that exist on the Python side alone spell their default here."""

    name: str
    parse: Callable[[str, Any], Any]
    default: Any
    doc: str
    type_name: str
    check: Callable[[Any], str | None] | None = None
    native: str | None = None  # keyword of the native settings object, when it differs
    server: bool = False  # a setting of the network server, not of the engine
    plugin: bool = False  # a policy plugin's import path, loaded on the Python side
    python_only: bool = False  # read by the Python side alone (the cluster's keys)

    def value(self, path: str, raw: Any) -> Any:
        v = self.parse(path, raw)
        if self.check is not None:
            why = self.check(v)
            if why:
                raise _fail(path, why)
        return v


def _choice(*options: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in options else f"{v!r} is not one of {', '.join(options)}"


def _between(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[Any], str | None]:
    shown = f"({lo}, {hi}]" if lo_open else f"{lo}..{hi}"

    def check(v: Any) -> str | None:
        ok = (v > lo if lo_open else v >= lo) and v <= hi
        return None if ok else f"{v} is not in {shown}"

    return check


def _at_least(lo: float) -> Callable[[Any], str | None]:
    return lambda v: None if v >= lo else f"{v} is below the minimum {lo}"


DURABILITY_LEVELS = ("none", "persist", "majority", "majority_and_persist_active", "persist_to_majority")
EVICTION_POLICIES = ("none", "lru")

# Top-level and section keys, by dotted path.
ENGINE_KEYS: list[Key] = [
    Key("data_dir", _path, Path(DEFAULTS["data_dir"]), "Directory holding wal/ and snap/.", "path"),
    Key(
        "force_recovery",
        _bool,
        DEFAULTS["force_recovery"],
        "Start even if WAL or snapshot files are damaged beyond a torn tail, skipping the damage.",
        "bool",
    ),
    Key(
        "expiry_pager_interval",
        parse_duration,
        DEFAULTS["expiry_pager_interval"],
        "How often expired items are turned into EXPIRATION changes and old tombstones purged.",
        "duration",
        _between(0.001, 86400 * 365),
    ),
    Key(
        "tombstone_purge_age",
        parse_duration,
        DEFAULTS["tombstone_purge_age"],
        "Tombstones older than this may be purged; streams starting below the purge seqno roll back to 0.",
        "duration",
    ),
    Key(
        "wal.mode",
        _str,
        DEFAULTS["wal.mode"],
        "none: nothing on disk (a pure cache); write: write() per batch (survives a process crash; "
        "`persist` writes are synced); fsync: write() and fdatasync() per batch (survives power loss).",
        "string",
        _choice("none", "write", "fsync"),
        native="wal_mode",
    ),
    Key(
        "wal.segment_size",
        parse_size,
        DEFAULTS["wal.segment_size"],
        "A WAL segment is closed and a new one started past this size.",
        "size",
        _at_least(4096),
        native="wal_segment_size",
    ),
    Key(
        "snapshot.count",
        _int,
        DEFAULTS["snapshot.count"],
        "How many snapshots to keep (with the WAL segments the oldest needs).",
        "integer",
        _at_least(1),
        native="snapshot_count",
    ),
    Key(
        "snapshot.interval",
        parse_duration,
        DEFAULTS["snapshot.interval"],
        "Seconds between automatic snapshots; 0 turns them off.",
        "duration",
        native="snapshot_interval",
    ),
    Key(
        "checkpoint.max_items",
        _int,
        DEFAULTS["checkpoint.max_items"],
        "A checkpoint closes after this many changes.",
        "integer",
        _at_least(1),
        native="checkpoint_max_items",
    ),
    Key(
        "checkpoint.period",
        parse_duration,
        DEFAULTS["checkpoint.period"],
        "A checkpoint closes after this long.",
        "duration",
        _between(0.001, 86400.0),
        native="checkpoint_period",
    ),
]


def parse_listen(path: str, v: Any) -> str:
    """HOST:PORT (IPv6 as [ADDR]:PORT); port 0 picks a free one."""
    text = _str(path, v)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise _fail(path, f"{text!r} is not HOST:PORT")
    return text


def listen_host(listen: str) -> str:
    return listen.rpartition(":")[0].strip("[]")


def is_loopback(listen: str) -> bool:
    host = listen_host(listen)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


ENGINE_KEYS += [
    Key(
        "listen",
        parse_listen,
        "127.0.0.1:11210",
        "Address of the memcached binary protocol listener. Beyond loopback, `sluice serve` needs "
        "--insecure until authentication is configured.",
        "HOST:PORT",
        server=True,
    ),
    Key(
        "admin_listen",
        lambda p, v: parse_listen(p, v) if v != "" else "",
        "127.0.0.1:11280",
        "Address of the admin HTTP endpoint: GET /metrics (Prometheus) and /status (JSON), POST "
        '/promote and /takeover (README "Admin endpoint"). "" turns it off. Beyond loopback it needs '
        "users (or --insecure).",
        "HOST:PORT",
        server=True,
    ),
    # Each registered front's listener, as the front declares it (sluice._native.FRONTS).
    *(
        Key(
            f"{front['name']}_listen",
            lambda p, v: parse_listen(p, v) if v != "" else "",
            front["default_listen"],
            front["doc"]
            + (
                ' "" turns it off. Beyond loopback it needs users (or --insecure).'
                if front["login"]
                else f' {front["title"]} has no login: beyond loopback it needs --insecure. "" turns it off.'
            ),
            "HOST:PORT",
            server=True,
        )
        for front in FRONTS
    ),
    Key(
        "max_connections",
        _int,
        DEFAULTS["max_connections"],
        "Connections served at once; more are closed at accept.",
        "integer",
        _at_least(1),
        server=True,
    ),
    Key(
        "idle_timeout",
        parse_duration,
        DEFAULTS["idle_timeout"],
        "A connection silent this long is closed; 0 never.",
        "duration",
        server=True,
    ),
    Key(
        "max_unauthenticated",
        _int,
        DEFAULTS["max_unauthenticated"],
        "With users configured: connections not yet logged in, at most; more are closed at accept "
        "(counted in /metrics) so that logged-in clients still get in.",
        "integer",
        _at_least(1),
        server=True,
    ),
    Key(
        "max_unauthenticated_per_ip",
        _int,
        DEFAULTS["max_unauthenticated_per_ip"],
        "The same, per client address.",
        "integer",
        _at_least(1),
        server=True,
    ),
    Key(
        "login_timeout",
        parse_duration,
        DEFAULTS["login_timeout"],
        "With users configured: a connection not logged in this long after accept is closed, "
        "whatever it sends meanwhile. Until it logs in, a request body over 4 KiB gets E2BIG.",
        "duration",
        _between(0, 3600, lo_open=True),
        server=True,
    ),
    Key(
        "io_threads",
        _int,
        DEFAULTS["io_threads"],
        "Threads serving client connections, each with its own event loop: a connection stays on "
        "the thread it was given, as in memcached. Replication and the admin endpoint run on as "
        "many threads beside them.",
        "integer",
        _between(1, 256),
        server=True,
    ),
    Key(
        "tls_listen",
        lambda p, v: parse_listen(p, v) if v not in ("", "auto") else v,
        "auto",
        'Address of the TLS memcached listener (Couchbase\'s convention: 11207 next to 11210). "auto" '
        '(the default): 127.0.0.1:11207 when tls.certificate is set, off otherwise; "" turns it off. '
        "Beyond loopback it needs users (or --insecure).",
        "HOST:PORT",
        server=True,
    ),
    Key(
        "tls.certificate",
        _optional_path,
        "",
        "PEM file with the server's certificate chain (leaf first) for the TLS listener and, with "
        "tls.admin, the admin endpoint. Read again on SIGHUP: new connections get the new one; a "
        "file that fails to load keeps the old certificate (logged).",
        "path",
        native="tls_certificate",
        server=True,
    ),
    Key(
        "tls.key",
        _optional_path,
        "",
        "PEM file with the private key of tls.certificate (PKCS#8, PKCS#1 or SEC1). Reloaded with it.",
        "path",
        native="tls_key",
        server=True,
    ),
    Key(
        "tls.client_ca",
        _optional_path,
        "",
        "PEM file of CAs: when set, clients of the TLS listener must present a certificate signed by "
        "one of them (SASL still decides who the user is).",
        "path",
        native="tls_client_ca",
        server=True,
    ),
    Key(
        "tls.admin",
        _bool,
        DEFAULTS["tls.admin"],
        "Serve admin_listen over HTTPS (same certificate) when tls.certificate is set, so HTTP Basic "
        "passwords never cross the network in clear text. `sluice status --admin https://HOST:PORT "
        "--cacert CA.pem` talks to it.",
        "boolean",
        native="tls_admin",
        server=True,
    ),
    Key(
        "replication.replica_of",
        lambda p, v: parse_listen(p, v) if v != "" else "",
        "",
        "HOST:PORT of the active node this one follows: every bucket's vbuckets are replicas fed "
        'by DCP from it (`sluice serve --replica-of`). "" (the default): this node is active.',
        "HOST:PORT",
        native="replica_of",
        server=True,
    ),
    Key(
        "replication.user",
        _str,
        "",
        "User this node authenticates as on its active (SASL PLAIN), and on a move's source; it needs "
        "the replication permission (or stream and admin) there.",
        "string",
        native="replication_user",
        server=True,
    ),
    Key(
        "replication.password_file",
        lambda p, v: _path(p, v) if v != "" else "",
        "",
        "File holding the replication user's password (the configuration never holds passwords).",
        "path",
        native="replication_password",
        server=True,
    ),
    Key(
        "replication.noop_interval",
        _int,
        DEFAULTS["replication.noop_interval"],
        "Seconds between NOOPs on the replication connection and on takeover streams this node "
        "runs; twice this long silent, it is dead (a replica reconnects, a takeover fails). A "
        "slow link needs it longer than the time to drain the 16 MiB flow-control window.",
        "integer",
        _between(1, 10800),
        native="replication_noop_interval",
        server=True,
    ),
    Key(
        "replication.tls",
        _bool,
        DEFAULTS["replication.tls"],
        "Connect to the active (and to a takeover's source) over TLS: replication.replica_of is then "
        "its TLS port (11207), and its certificate must chain to replication.ca and name the host "
        "of replica_of (an IP address must be in its IP SANs).",
        "boolean",
        native="replication_tls",
        server=True,
    ),
    Key(
        "replication.ca",
        _optional_path,
        "",
        "PEM file of the CAs the active's certificate must chain to (required with replication.tls).",
        "path",
        native="replication_ca",
        server=True,
    ),
    Key(
        "replication.certificate",
        _optional_path,
        "",
        "PEM file with this node's client certificate, for an active whose tls.client_ca asks for one.",
        "path",
        native="replication_certificate",
        server=True,
    ),
    Key(
        "replication.key",
        _optional_path,
        "",
        "PEM file with the private key of replication.certificate.",
        "path",
        native="replication_key",
        server=True,
    ),
    Key(
        "tarantool_upstream.address",
        lambda p, v: parse_listen(p, v) if v != "" else "",
        "",
        'HOST:PORT of a Tarantool this node follows as its replica (README "A node that follows a '
        'Tarantool into its spaces"): every row it writes to a space of the same name as one in '
        '[spaces.NAME] is applied here, read-only for iproto clients. "" (the default): nothing is '
        "followed.",
        "HOST:PORT",
        native="tarantool_upstream",
        server=True,
    ),
    Key(
        "tarantool_upstream.user",
        _str,
        "",
        'Tarantool user to log in as (chap-sha1); it needs the replication role there. "": guest.',
        "string",
        native="tarantool_upstream_user",
        server=True,
    ),
    Key(
        "tarantool_upstream.password_file",
        lambda p, v: _path(p, v) if v != "" else "",
        "",
        "File holding the Tarantool user's password.",
        "path",
        native="tarantool_upstream_password",
        server=True,
    ),
    Key(
        "tarantool_upstream.spaces",
        lambda p, v: _names(p, v),
        [],
        "Names of the spaces to follow; [] (the default): every [spaces.NAME], or every space of the "
        "Tarantool when none is declared. A name not under [spaces.NAME] is declared from the "
        "Tarantool's own schema at start.",
        "list of strings",
        native="tarantool_upstream_spaces",
        server=True,
    ),
    Key(
        "tarantool_upstream.anonymous",
        _bool,
        True,
        "Follow as an anonymous replica (FETCH_SNAPSHOT; nothing registered on the Tarantool). false: "
        "JOIN, registered in its _cluster, so the Tarantool keeps the WAL this node has not yet "
        "acknowledged (it takes a replica slot; remove it from _cluster when this node goes away).",
        "bool",
        native="tarantool_upstream_anonymous",
        server=True,
    ),
]


def _names(path: str, v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise _fail(path, f'expected a list of names such as ["accounts"], got {v!r}')
    return list(v)


def _plugin(kind: str) -> Callable[[str, Any], str]:
    def parse(path: str, v: Any) -> str:
        text = _str(path, v)
        if text:
            from sluice.policy import PluginError, load_plugin

            try:
                load_plugin(kind, text)
            except PluginError as e:
                raise _fail(path, str(e)) from None
        return text

    return parse


ENGINE_KEYS += [
    Key(
        "tap.ack_interval",
        _int,
        DEFAULTS["tap.ack_interval"],
        "A TAP connection with SUPPORT_ACK asks for an ACK every this many messages (and on the "
        "last one before it goes idle); an AckPolicy plugin may change it per connection.",
        "integer",
        _between(1, 1_000_000),
        native="tap_ack_interval",
        server=True,
    ),
    Key(
        "tap.ack_window",
        _int,
        DEFAULTS["tap.ack_window"],
        "A TAP connection pauses while this many messages are unacknowledged.",
        "integer",
        _between(1, 10_000_000),
        native="tap_ack_window",
        server=True,
    ),
    Key(
        "tap.grace_period",
        parse_duration,
        DEFAULTS["tap.grace_period"],
        "How long a named TAP session with SUPPORT_ACK (REGISTERED_CLIENT ones too) outlives its "
        "connection: a reconnect under the same name (and flags) within it gets every "
        "unacknowledged message again; later, it starts over. A RetransmitPolicy plugin may "
        "decide per session.",
        "duration",
        _between(0, 86400 * 7),
        native="tap_grace_period",
        server=True,
    ),
    Key(
        "tap.backoff",
        parse_duration,
        DEFAULTS["tap.backoff"],
        "How long a TAP connection waits before sending again after a TMPFAIL or BUSY answer.",
        "duration",
        _between(0, 3600),
        native="tap_backoff",
        server=True,
    ),
    Key(
        "tap.ttl",
        _int,
        DEFAULTS["tap.ttl"],
        "Hops a change written on this node is sent with over TAP. A node applying a TAP feed "
        "sends each change on with one hop less, and not at all at 0: this stops loops between "
        "nodes that tap each other.",
        "integer",
        _between(1, 31),
        native="tap_ttl",
        server=True,
    ),
    Key(
        "tap.max_sessions",
        _int,
        DEFAULTS["tap.max_sessions"],
        "Named TAP sessions (connected or within their grace period) at most; a TAP_CONNECT "
        "under a new name past it gets ETMPFAIL.",
        "integer",
        _between(1, 100_000),
        native="tap_max_sessions",
        server=True,
    ),
    Key(
        "tap.max_unacked_bytes",
        parse_size,
        DEFAULTS["tap.max_unacked_bytes"],
        "A TAP connection with SUPPORT_ACK pauses while it holds this many bytes unacknowledged "
        "(with tap.ack_window, this bounds what a parked session keeps).",
        "size",
        _between(64 * 1024, 1024**3),
        native="tap_max_unacked_bytes",
        server=True,
    ),
    Key(
        "policy.timeout",
        parse_duration,
        DEFAULTS["policy.timeout"],
        "How long the server waits for a policy plugin's answer before it uses the native default.",
        "duration",
        _between(0.001, 10),
        native="policy_timeout",
        server=True,
    ),
]
ENGINE_KEYS += [
    Key(
        f"policy.{kind}",
        _plugin(kind),
        "",
        f'Import path ("package.module:Class") of a {base} plugin (sluice.policy); "" uses the '
        f"native default. Loaded at start, reloaded on SIGHUP. {what}",
        "string",
        server=True,
        plugin=True,
    )
    for kind, base, what in [
        (
            "ack",
            "AckPolicy",
            "Decides TAP ACK interval and window per ACK, and a replica's DCP buffer size and "
            "acknowledgement interval per buffer acknowledgement.",
        ),
        (
            "retransmit",
            "RetransmitPolicy",
            "Decides a dropped TAP session's grace, whether it gets its messages again, and the "
            "back-off after TMPFAIL/BUSY.",
        ),
        (
            "slow_consumer",
            "SlowConsumerPolicy",
            "Decides which cursors (DCP and TAP streams) are dropped when checkpoint memory is over "
            "its quota.",
        ),
        (
            "filter",
            "StreamFilter",
            "Judges each batch of a TAP stream, or of a DCP stream other than replication: keep, "
            "drop or strip values.",
        ),
    ]
]


def _cluster_url(path: str, v: Any) -> str:
    text = _str(path, v)
    if text:
        from sluice.cluster.etcd import parse_cluster_url

        try:
            parse_cluster_url(text)
        except ValueError as e:
            raise _fail(path, str(e)) from None
    return text


# The cluster's keys: read on the Python side, which keeps the node's place in the cluster.
CLUSTER_KEYS: list[Key] = [
    Key(
        "cluster.etcd",
        _cluster_url,
        "",
        "etcd://HOST:PORT[,HOST:PORT]/CLUSTER_NAME (etcds:// for HTTPS): join the cluster of that "
        'name, coordinated on that etcd (`sluice serve --cluster`). "" (the default): a node on its own.',
        "URL",
        python_only=True,
    ),
    Key(
        "cluster.node_name",
        _str,
        "",
        'This node\'s name in the cluster; "" (the default): its advertised KV address.',
        "string",
        python_only=True,
    ),
    Key(
        "cluster.advertise",
        lambda p, v: parse_listen(p, v) if v != "" else "",
        "",
        'HOST:PORT other nodes and clients reach this node\'s KV port at; "" (the default): the '
        "listen address.",
        "HOST:PORT",
        python_only=True,
    ),
    Key(
        "cluster.group",
        _str,
        "",
        "Server group (rack, zone) of this node: a vbucket's copies go to different groups where "
        "there are enough.",
        "string",
        python_only=True,
    ),
    Key(
        "cluster.replicas",
        _int,
        1,
        "Replicas of every vbucket (each on another node); majority durability counts over this chain.",
        "integer",
        _between(0, 3),
        python_only=True,
    ),
    Key(
        "cluster.auto_failover_timeout",
        parse_duration,
        10.0,
        "How long a node may be gone (its etcd lease expired) before it is failed over.",
        "duration",
        _between(1, 3600),
        python_only=True,
    ),
    Key(
        "cluster.max_auto_failovers",
        _int,
        1,
        "Automatic failovers done before a person acknowledges them (`sluice cluster "
        "reset-failovers`); 0 turns automatic failover off.",
        "integer",
        _between(0, 100),
        python_only=True,
    ),
    Key(
        "cluster.etcd_user",
        _str,
        "",
        "User to authenticate to etcd as, if etcd has authentication on.",
        "string",
        python_only=True,
    ),
    Key(
        "cluster.etcd_password_file",
        lambda p, v: _path(p, v) if v != "" else "",
        "",
        "File holding the etcd user's password.",
        "path",
        python_only=True,
    ),
    Key(
        "cluster.etcd_ca",
        lambda p, v: _path(p, v) if v != "" else "",
        "",
        "CA certificate (PEM) to verify etcd's certificate by, for etcds:// URLs.",
        "path",
        python_only=True,
    ),
]

ENGINE_KEYS += CLUSTER_KEYS

BUCKET_KEYS: list[Key] = [
    Key(
        "num_vbuckets",
        _int,
        DEFAULTS["buckets.num_vbuckets"],
        "Number of vbuckets; fixed once the bucket has data.",
        "integer",
        _between(1, 1024),
    ),
    Key(
        "memory_quota",
        parse_size,
        DEFAULTS["buckets.memory_quota"],
        "Bytes of items and checkpoints the bucket may hold.",
        "size",
        _at_least(1024**2),
    ),
    Key(
        "high_watermark",
        _float,
        DEFAULTS["buckets.high_watermark"],
        "Fraction of the quota above which writes get a temporary failure.",
        "number",
        _between(0, 1, lo_open=True),
    ),
    Key(
        "max_item_size",
        parse_size,
        DEFAULTS["buckets.max_item_size"],
        "Largest value accepted, in bytes.",
        "size",
        _between(1, 64 * 1024**2),
    ),
    Key(
        "checkpoint_memory_ratio",
        _float,
        DEFAULTS["buckets.checkpoint_memory_ratio"],
        "Fraction of the quota checkpoints may use before the slowest cursors are dropped.",
        "number",
        _between(0, 1, lo_open=True),
    ),
    Key(
        "durability",
        _str,
        DEFAULTS["buckets.durability"],
        "Default durability level of writes: " + ", ".join(DURABILITY_LEVELS) + ".",
        "string",
        _choice(*DURABILITY_LEVELS),
    ),
    Key(
        "replicas",
        _int,
        DEFAULTS["buckets.replicas"],
        "Replicas each vbucket is meant to have: majority durability needs a majority of "
        "1 + replicas nodes, and fails with durability-impossible when fewer follow.",
        "integer",
        _between(0, 3),
    ),
    Key(
        "durability_timeout",
        parse_duration,
        DEFAULTS["buckets.durability_timeout"],
        "How long a durable write waits for its level when the request names no timeout; then "
        "it gets sync-write-ambiguous.",
        "duration",
        _between(0.001, 3600),
    ),
    Key(
        "eviction",
        _str,
        DEFAULTS["buckets.eviction"],
        "What a write finds when memory is above the high watermark: none (a temporary failure, "
        "the bucket is a store) or lru (least recently used items are evicted first, each a "
        "deletion that streams and replicas see; the bucket is a cache).",
        "string",
        _choice(*EVICTION_POLICIES),
    ),
]

_BUCKET_NAME = re.compile(r"[A-Za-z0-9_.%-]{1,100}")


@dataclasses.dataclass(frozen=True)
class Config:
    """A validated configuration. Build it with ``load_config`` or ``Config.from_dict``."""

    values: Mapping[str, Any]
    buckets: Mapping[str, Mapping[str, Any]]
    source: str = "<defaults>"
    users: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    spaces: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    topics: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], source: str = "<dict>") -> Config:
        values = {k.name: k.default for k in ENGINE_KEYS}
        by_name = {k.name: k for k in ENGINE_KEYS}
        sections = {k.name.split(".")[0] for k in ENGINE_KEYS if "." in k.name}
        buckets: dict[str, dict[str, Any]] = {}
        users: dict[str, dict[str, Any]] = {}
        spaces: dict[str, dict[str, Any]] = {}
        topics: dict[str, dict[str, Any]] = {}
        for top, raw in doc.items():
            if top == "users":
                if not isinstance(raw, dict):
                    raise _fail("users", "expected a table of users, e.g. [users.ada]")
                for name, table in raw.items():
                    users[name] = _user(name, table)
            elif top == "topics":
                if not isinstance(raw, dict):
                    raise _fail("topics", "expected a table of topics, e.g. [topics.events]")
                for name, table in raw.items():
                    topics[name] = _topic(name, table)
            elif top == "spaces":
                if not isinstance(raw, dict):
                    raise _fail("spaces", "expected a table of spaces, e.g. [spaces.users]")
                for name, table in raw.items():
                    spaces[name] = _space(name, table)
            elif top == "buckets":
                if not isinstance(raw, dict):
                    raise _fail("buckets", "expected a table of buckets, e.g. [buckets.default]")
                for name, table in raw.items():
                    buckets[name] = _bucket(name, table)
            elif top in sections:
                if not isinstance(raw, dict):
                    raise _fail(top, f"expected a table, got {type(raw).__name__}")
                for sub, v in raw.items():
                    path = f"{top}.{sub}"
                    if path not in by_name:
                        known = [k.name.split(".", 1)[1] for k in ENGINE_KEYS if k.name.startswith(top + ".")]
                        raise _fail(path, f"unknown key (known in [{top}]: {', '.join(known)})")
                    values[path] = by_name[path].value(path, v)
            elif top in by_name:
                values[top] = by_name[top].value(top, raw)
            else:
                raise _fail(top, "unknown key")
        buckets.setdefault("default", _bucket("default", {}))
        _check_spaces(spaces, buckets)
        for name, u in users.items():
            for b in u["buckets"]:
                if b != "*" and b not in buckets:
                    raise _fail(f"users.{name}.buckets.{b}", f"no bucket {b!r} is configured")
        return cls(values=values, buckets=buckets, source=source, users=users, spaces=spaces, topics=topics)

    def with_overrides(self, **overrides: Any) -> Config:
        """A copy with top-level keys replaced (command-line flags), validated the same way."""
        by_name = {k.name: k for k in ENGINE_KEYS}
        values = dict(self.values)
        for name, raw in overrides.items():
            path = name.replace("__", ".")
            if path not in by_name:
                raise _fail(path, "unknown key")
            values[path] = by_name[path].value(path, str(raw) if isinstance(raw, Path) else raw)
        return dataclasses.replace(self, values=values)

    def secret(self, key: str) -> str | None:
        """The password in the file the key names (its last newline dropped); None without one."""
        path = self.values[key]
        if not path:
            return None
        try:
            return Path(path).read_text().rstrip("\n")
        except OSError as e:
            raise _fail(key, f"cannot read {path}: {e.strerror}") from None

    def with_spaces(self, tables: Mapping[str, Any]) -> Config:
        """A copy with more [spaces.NAME] tables, validated as the file's are."""
        spaces = dict(self.spaces)
        for name, table in tables.items():
            if name in spaces:
                raise _fail(f"spaces.{name}", "is configured already")
            spaces[name] = _space(name, table)
        buckets = {name: dict(b) for name, b in self.buckets.items()}
        _check_spaces(spaces, buckets)
        return dataclasses.replace(self, spaces=spaces, buckets=buckets)

    def spaces_to_learn(self) -> list[str] | None:
        """Which followed spaces the configuration does not declare, to be declared from the
        followed Tarantool's own schema: the names of `tarantool_upstream.spaces` missing from
        [spaces.NAME], [] for every space of the Tarantool when both are empty, None when there
        is nothing to learn (nothing followed, or every followed space declared)."""
        if not self.values["tarantool_upstream.address"]:
            return None
        wanted = self.values["tarantool_upstream.spaces"]
        if not wanted:
            return None if self.spaces else []
        missing = [name for name in wanted if name not in self.spaces]
        return missing or None

    def user_list(self) -> list[tuple[str, dict[str, str], dict[str, list[str]]]]:
        """The users as `sluice._native.Server` takes them."""
        return [(n, dict(u["credentials"]), dict(u["buckets"])) for n, u in self.users.items()]

    def warnings(self) -> list[str]:
        """What the configuration allows but will likely not do what its users want, "key: reason"
        each: users without credentials for a SCRAM mechanism (a warning, not an error, so that
        configurations from before SCRAM keep serving PLAIN)."""
        return [w for name, u in self.users.items() if name != GUEST for w in _user_warnings(name, u)]

    def server_settings(self) -> dict[str, Any]:
        """The settings of `sluice._native.Server`, which it takes as JSON (`server_json`) and
        checks once: the server's keys by their native names, the users and spaces, and each
        registered front's listener under `listeners` ("" when it is off)."""
        fronts = {f"{f['name']}_listen": f["name"] for f in FRONTS}
        out: dict[str, Any] = {"listeners": {}}
        for k in ENGINE_KEYS:
            if not k.server or k.plugin:
                continue
            if k.name in fronts:
                out["listeners"][fronts[k.name]] = self.values[k.name]
            else:
                out[k.native or k.name] = self.values[k.name]
        out["users"] = self.user_list()
        out["replica_of"] = out["replica_of"] or None
        out["spaces"] = self.space_list()
        out["replication_user"] = out["replication_user"] or None
        for k in (
            "tls_certificate",
            "tls_key",
            "tls_client_ca",
            "replication_ca",
            "replication_certificate",
            "replication_key",
        ):
            out[k] = str(out[k]) if out[k] else None
        if out["tls_listen"] == "auto":
            out["tls_listen"] = "127.0.0.1:11207" if out["tls_certificate"] else None
        out["tls_listen"] = out["tls_listen"] or None
        for native, key in (
            ("replication_password", "replication.password_file"),
            ("tarantool_upstream_password", "tarantool_upstream.password_file"),
        ):
            del out[native]
            out[native] = self.secret(key)
        out["tarantool_upstream"] = out["tarantool_upstream"] or None
        for name in out["tarantool_upstream_spaces"]:
            if name not in self.spaces:
                raise _fail("tarantool_upstream.spaces", f"no space {name!r} is configured ([spaces.{name}])")
        # A node of a cluster takes clients once it has converged on the map.
        out["hold_connections"] = bool(self.values["cluster.etcd"])
        return out

    def server_json(self) -> str:
        """`server_settings` as the JSON `sluice._native.Server` takes."""
        return json.dumps(self.server_settings())

    def space_list(self) -> list[tuple[str, int, str, list[tuple[str, str, bool]], list[int]]]:
        """The spaces as `sluice._native.Server` takes them: (name, id, bucket, [(field name,
        type, is_nullable)], [0-based field numbers of the primary key])."""
        return [
            (
                name,
                sp["id"],
                sp["bucket"],
                [(f["name"], f["type"], f["is_nullable"]) for f in sp["format"]],
                list(sp["primary_key"]),
            )
            for name, sp in self.spaces.items()
        ]

    def plugins(self) -> dict[str, str]:
        """The configured policy plugins: {kind: import path}."""
        return {
            k.name.split(".", 1)[1]: self.values[k.name]
            for k in ENGINE_KEYS
            if k.plugin and self.values[k.name]
        }

    @property
    def data_dir(self) -> Path:
        return self.values["data_dir"]

    def to_native(self) -> EngineSettings:
        kwargs = {
            (k.native or k.name): self.values[k.name]
            for k in ENGINE_KEYS
            if k.name != "data_dir" and not k.server and not k.python_only
        }
        # A bucket that holds a space keeps its keys in order, for SELECT's iterators.
        ordered = {sp["bucket"] for sp in self.spaces.values()}
        buckets = {name: dict(b) for name, b in self.buckets.items()}
        if self.values["cluster.etcd"]:
            # Majorities count over each vbucket's chain in the cluster's map.
            for b in buckets.values():
                b["replicas"] = self.values["cluster.replicas"]
        buckets = [BucketSettings(name, **b, ordered_keys=name in ordered) for name, b in buckets.items()]
        return EngineSettings(
            str(self.values["data_dir"]),
            buckets=buckets,
            replica=bool(self.values["replication.replica_of"]),
            **kwargs,
        )


PERMISSIONS = ("read", "write", "stream", "admin", "replication")
_HASH = re.compile(r"pbkdf2-sha256:\d+:[0-9a-f]{16,}:[0-9a-f]{64}")
# SCRAM credentials per mechanism: [users.NAME] key -> (hashlib name, SASL name, key length).
SCRAM_MECHANISMS = {
    "scram_sha512": ("sha512", "SCRAM-SHA512", 64),
    "scram_sha256": ("sha256", "SCRAM-SHA256", 32),
    "scram_sha1": ("sha1", "SCRAM-SHA1", 20),
}
CREDENTIAL_KEYS = ("password_hash", *SCRAM_MECHANISMS, "chap_sha1")
# Tarantool's chap-sha1 (iproto AUTH) checks against sha1(sha1(password)), hex.
_CHAP_SHA1 = re.compile(r"[0-9a-f]{40}")
# The user an iproto session is before it authenticates: [users.guest] holds only its buckets.
GUEST = "guest"
DEFAULT_ITERATIONS = 100_000


def _scram_form(key: str) -> re.Pattern[str]:
    n = SCRAM_MECHANISMS[key][2] * 2
    return re.compile(rf"{key.replace('_', '-')}:\d+:[0-9a-f]{{16,}}:[0-9a-f]{{{n}}}:[0-9a-f]{{{n}}}")


def _user(name: str, table: Any) -> dict[str, Any]:
    """[users.NAME]: credentials (the output of `sluice user hash`: scram_sha512, scram_sha256,
    scram_sha1; from older configurations password_hash; never a password) and buckets, a table of
    bucket name (or "*") to a list of permissions among read, write, stream, admin, replication."""
    path = f"users.{name}"
    if not re.fullmatch(r"[A-Za-z0-9_.@-]{1,128}", name):
        raise _fail(path, f"user name {name!r} must be 1 to 128 of A-Z a-z 0-9 _ . @ -")
    if not isinstance(table, dict):
        raise _fail(path, f"expected a table, got {type(table).__name__}")
    if "password" in table:
        raise _fail(
            f"{path}.password",
            f"passwords are never stored; put the output of `sluice user hash` under [{path}]",
        )
    if name == GUEST:
        for key in table:
            if key != "buckets":
                raise _fail(
                    f"{path}.{key}",
                    "guest has no credentials: it is who an iproto session is before AUTH; "
                    "[users.guest] takes only buckets",
                )
    for key in table:
        if key not in (*CREDENTIAL_KEYS, "buckets"):
            raise _fail(f"{path}.{key}", f"unknown key (known: {', '.join(CREDENTIAL_KEYS)}, buckets)")
    credentials = {}
    for key in CREDENTIAL_KEYS:
        if key not in table:
            continue
        value = _str(f"{path}.{key}", table[key])
        if key == "password_hash" and not _HASH.fullmatch(value):
            raise _fail(
                f"{path}.{key}", "expected pbkdf2-sha256:ITERATIONS:SALT_HEX:HASH_HEX from `sluice user hash`"
            )
        if key == "chap_sha1" and not _CHAP_SHA1.fullmatch(value):
            raise _fail(
                f"{path}.{key}", "expected 40 hex digits, sha1(sha1(password)), from `sluice user hash`"
            )
        if key in SCRAM_MECHANISMS and not _scram_form(key).fullmatch(value):
            raise _fail(
                f"{path}.{key}",
                f"expected {key.replace('_', '-')}:ITERATIONS:SALT_HEX:STOREDKEY_HEX:SERVERKEY_HEX "
                "from `sluice user hash`",
            )
        credentials[key] = value
    if not credentials and name != GUEST:
        raise _fail(path, f"no credentials: put the output of `sluice user hash` under [{path}]")
    raw = table.get("buckets", {})
    if not isinstance(raw, dict):
        raise _fail(f"{path}.buckets", 'expected a table such as { default = ["read", "write"] }')
    buckets = {}
    for b, perms in raw.items():
        if not isinstance(perms, list) or not all(isinstance(p, str) for p in perms):
            raise _fail(f"{path}.buckets.{b}", "expected a list of permissions")
        bad = [p for p in perms if p not in PERMISSIONS]
        if bad:
            raise _fail(
                f"{path}.buckets.{b}", f"unknown permission {bad[0]!r} (known: {', '.join(PERMISSIONS)})"
            )
        buckets[b] = list(perms)
    return {"credentials": credentials, "buckets": buckets}


def _user_warnings(name: str, user: Mapping[str, Any]) -> list[str]:
    """What a user's credentials leave out: SCRAM mechanisms it cannot log in with."""
    missing = [SCRAM_MECHANISMS[k][1] for k in SCRAM_MECHANISMS if k not in user["credentials"]]
    if not missing:
        return []
    if "SCRAM-SHA512" in missing:
        why = "SDK logins with the default authenticator will fail"
    else:
        why = "clients that ask for them will fail"
    return [f"users.{name}: no {', '.join(missing)} credentials; {why}: run sluice user hash"]


def hash_password(password: str, iterations: int = DEFAULT_ITERATIONS) -> str:
    """A password_hash as configurations before SCRAM held it: PBKDF2-HMAC-SHA256 with a random
    16-byte salt (SASL PLAIN and the admin endpoint only)."""
    import hashlib
    import os

    salt = os.urandom(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"pbkdf2-sha256:{iterations}:{salt.hex()}:{digest.hex()}"


def user_credentials(password: str, iterations: int = DEFAULT_ITERATIONS) -> dict[str, str]:
    """What `sluice user hash` prints, [users.NAME] key -> value: per SCRAM mechanism
    `scram-shaN:ITERATIONS:SALT_HEX:STOREDKEY_HEX:SERVERKEY_HEX` (RFC 5802: StoredKey = H(ClientKey),
    ServerKey = HMAC(SaltedPassword, "Server Key"); neither the password nor the salted password),
    each with a random 16-byte salt of its own. PLAIN checks against the SCRAM-SHA512 keys. Then
    `chap_sha1`, the hex of sha1(sha1(password)), which Tarantool's chap-sha1 AUTH checks against
    (as Tarantool stores it: unsalted, so guessable offline by whoever reads the file)."""
    import hashlib
    import hmac
    import os

    out = {}
    for key, (hash_name, _, _) in SCRAM_MECHANISMS.items():
        salt = os.urandom(16)
        salted = hashlib.pbkdf2_hmac(hash_name, password.encode(), salt, iterations)
        stored = hashlib.new(hash_name, hmac.digest(salted, b"Client Key", hash_name)).digest()
        server = hmac.digest(salted, b"Server Key", hash_name)
        scheme = key.replace("_", "-")
        out[key] = f"{scheme}:{iterations}:{salt.hex()}:{stored.hex()}:{server.hex()}"
    out["chap_sha1"] = hashlib.sha1(hashlib.sha1(password.encode()).digest()).hexdigest()
    return out


def _bucket(name: str, table: Any) -> dict[str, Any]:
    path = f"buckets.{name}"
    if not _BUCKET_NAME.fullmatch(name):
        raise _fail(path, f"bucket name {name!r} must be 1 to 100 of A-Z a-z 0-9 _ . % -")
    if not isinstance(table, dict):
        raise _fail(path, f"expected a table, got {type(table).__name__}")
    by_name = {k.name: k for k in BUCKET_KEYS}
    out = {k.name: k.default for k in BUCKET_KEYS}
    for key, raw in table.items():
        if key not in by_name:
            raise _fail(f"{path}.{key}", f"unknown key (known: {', '.join(by_name)})")
        out[key] = by_name[key].value(f"{path}.{key}", raw)
    return out


# Tarantool's field types (those sluice checks; README "Tarantool's iproto").
FIELD_TYPES = (
    "unsigned",
    "integer",
    "number",
    "double",
    "string",
    "varbinary",
    "boolean",
    "scalar",
    "any",
    "array",
    "map",
    "uuid",
)
# Types a TREE index cannot order by (Tarantool refuses them in an index too).
_UNINDEXABLE = ("any", "array", "map")
MIN_SPACE_ID = 512  # below are Tarantool's system spaces
MAX_SPACE_ID = 0x7FFFFFFF  # Tarantool's box.schema.SPACE_MAX
_SPACE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


# [spaces.NAME]'s keys for the reference and the example: key, type, default, meaning.
SPACE_KEYS = [
    ("id", "integer", "(required)", f"The space's number, {MIN_SPACE_ID} or more, unique."),
    (
        "bucket",
        "string",
        "the space's name",
        "The bucket holding its tuples (key: the MessagePack array of the primary key's parts; "
        "value: the tuple). One space per bucket; a bucket not under [buckets] is created with "
        "the bucket defaults.",
    ),
    (
        "format",
        "list of tables",
        "(required)",
        "The fields in order: { name, type, is_nullable = false }; type is one of "
        + ", ".join(FIELD_TYPES)
        + ".",
    ),
    (
        "primary_key",
        "list",
        "the first field",
        "The primary key's fields, by name or 1-based number; not nullable, not any/array/map.",
    ),
]
SPACE_EXAMPLE = {
    "id": "512",
    "bucket": '"users"',
    "format": '[{ name = "id", type = "unsigned" }, { name = "name", type = "string", is_nullable = true }]',
    "primary_key": '["id"]',
}


def _space(name: str, table: Any) -> dict[str, Any]:
    """[spaces.NAME]: id (512 or more), bucket (default: the space's name), format (a list of
    { name, type, is_nullable }) and primary_key (field names or 1-based numbers; default the
    first field). The primary key's fields in 0-based numbers."""
    path = f"spaces.{name}"
    if not _SPACE_NAME.fullmatch(name):
        raise _fail(path, f"space name {name!r} must be a letter then up to 63 of A-Z a-z 0-9 _")
    if not isinstance(table, dict):
        raise _fail(path, f"expected a table, got {type(table).__name__}")
    known = ("id", "bucket", "format", "primary_key")
    for key in table:
        if key not in known:
            raise _fail(f"{path}.{key}", f"unknown key (known: {', '.join(known)})")
    if "id" not in table:
        raise _fail(f"{path}.id", f"missing: every space needs a number of its own, {MIN_SPACE_ID} or more")
    space_id = _int(f"{path}.id", table["id"])
    if not MIN_SPACE_ID <= space_id <= MAX_SPACE_ID:
        raise _fail(
            f"{path}.id", f"{space_id} is not in {MIN_SPACE_ID}..{MAX_SPACE_ID} (lower ids are system spaces)"
        )
    bucket = _str(f"{path}.bucket", table.get("bucket", name))
    if not _BUCKET_NAME.fullmatch(bucket):
        raise _fail(f"{path}.bucket", f"bucket name {bucket!r} must be 1 to 100 of A-Z a-z 0-9 _ . % -")
    raw_format = table.get("format")
    if not isinstance(raw_format, list) or not raw_format:
        raise _fail(
            f"{path}.format",
            'expected a list of fields such as [{ name = "id", type = "unsigned" }, ...], at least one',
        )
    fields: list[dict[str, Any]] = []
    for i, f in enumerate(raw_format, 1):
        fpath = f"{path}.format[{i}]"
        if not isinstance(f, dict):
            raise _fail(fpath, 'expected a table such as { name = "id", type = "unsigned" }')
        for key in f:
            if key not in ("name", "type", "is_nullable"):
                raise _fail(f"{fpath}.{key}", "unknown key (known: name, type, is_nullable)")
        if "name" not in f:
            raise _fail(f"{fpath}.name", "missing: every field has a name")
        fname = _str(f"{fpath}.name", f["name"])
        if not _FIELD_NAME.fullmatch(fname):
            raise _fail(
                f"{fpath}.name", f"field name {fname!r} must be up to 64 of A-Z a-z 0-9 _, not a digit first"
            )
        if any(g["name"] == fname for g in fields):
            raise _fail(f"{fpath}.name", f"field {fname!r} is declared twice")
        ftype = _str(f"{fpath}.type", f.get("type", "any"))
        if ftype not in FIELD_TYPES:
            raise _fail(f"{fpath}.type", f"{ftype!r} is not one of {', '.join(FIELD_TYPES)}")
        nullable = _bool(f"{fpath}.is_nullable", f.get("is_nullable", False))
        fields.append({"name": fname, "type": ftype, "is_nullable": nullable})
    raw_key = table.get("primary_key", [fields[0]["name"]])
    kpath = f"{path}.primary_key"
    if not isinstance(raw_key, list) or not raw_key:
        raise _fail(kpath, 'expected a list of field names or 1-based field numbers, e.g. ["id"]')
    parts: list[int] = []
    for part in raw_key:
        if isinstance(part, str):
            no = next((i for i, f in enumerate(fields) if f["name"] == part), None)
            if no is None:
                raise _fail(
                    kpath, f"no field {part!r} in format (fields: {', '.join(f['name'] for f in fields)})"
                )
        elif isinstance(part, int) and not isinstance(part, bool):
            if not 1 <= part <= len(fields):
                raise _fail(kpath, f"field number {part} is not in 1..{len(fields)} (numbers are 1-based)")
            no = part - 1
        else:
            raise _fail(kpath, f"expected a field name or a 1-based field number, got {part!r}")
        if no in parts:
            raise _fail(kpath, f"field {fields[no]['name']!r} is in the key twice")
        field = fields[no]
        if field["type"] in _UNINDEXABLE:
            raise _fail(
                kpath,
                f"field {field['name']!r} has type {field['type']!r}, which a primary key cannot order by",
            )
        if field["is_nullable"]:
            raise _fail(kpath, f"field {field['name']!r} is nullable; a primary key's fields cannot be")
        parts.append(no)
    return {"id": space_id, "bucket": bucket, "format": fields, "primary_key": parts}


# Tarantool's older names of field types, and the types sluice has no check for (kept as any).
_TARANTOOL_TYPE_ALIASES = {"num": "unsigned", "str": "string", "int": "integer"}


def spaces_from_tarantool(
    space_rows: list[list[Any]], index_rows: list[list[Any]], wanted: list[str]
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """[spaces.NAME] tables for the spaces of a Tarantool, from its `_vspace` tuples (id, owner,
    name, engine, field count, flags, format) and `_vindex` tuples (space id, index id, name,
    type, options, parts): those named in `wanted`, or every user space when it is empty.
    Returns the tables and, for each space left out, why. Fields past the format that the
    primary key uses are declared as `fieldN` with the key part's type; field types sluice
    does not check (decimal, datetime, ...) are declared `any`."""
    primaries = {row[0]: row[5] for row in index_rows if len(row) > 5 and row[1] == 0}
    tables: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for row in space_rows:
        if len(row) < 7 or not isinstance(row[0], int) or not isinstance(row[2], str):
            continue
        space_id, name, engine, flags, fmt = row[0], row[2], row[3], row[5], row[6]
        if space_id < MIN_SPACE_ID or (wanted and name not in wanted):
            continue
        flags = flags if isinstance(flags, dict) else {}
        if engine not in ("memtx", "vinyl"):
            skipped[name] = f"its engine {engine!r} keeps no rows to replicate"
        elif flags.get("temporary") or flags.get("group_id") == 1:
            skipped[name] = "it is temporary or local on the Tarantool, so its rows are not replicated"
        elif space_id not in primaries:
            skipped[name] = "it has no primary index"
        else:
            try:
                table = _space_from_tarantool(name, space_id, fmt, primaries[space_id])
                _space(name, table)
                tables[name] = table
            except ValueError as e:
                skipped[name] = str(e)
            except (TypeError, KeyError, IndexError) as e:
                skipped[name] = f"its format or primary index is not as Tarantool writes them ({e!r})"
            except ConfigError as e:
                skipped[name] = str(e).removeprefix("invalid config: ")
    for name in wanted:
        if name not in tables and name not in skipped:
            skipped[name] = "no space of this name on the Tarantool (or the user may not see it)"
    return tables, skipped


def _space_from_tarantool(name: str, space_id: int, fmt: Any, parts: Any) -> dict[str, Any]:
    if not _SPACE_NAME.fullmatch(name):
        raise ValueError(f"its name is not one sluice takes ({_SPACE_NAME.pattern})")
    fields: list[dict[str, Any]] = []
    for f in fmt if isinstance(fmt, list) else []:
        ftype = _TARANTOOL_TYPE_ALIASES.get(f.get("type", "any"), f.get("type", "any"))
        fields.append(
            {
                "name": f["name"],
                "type": ftype if ftype in FIELD_TYPES else "any",
                "is_nullable": bool(f.get("is_nullable", False)),
            }
        )
    key: list[int] = []
    for part in parts:
        no, ptype = (part[0], part[1]) if isinstance(part, list) else (part["field"], part.get("type", "any"))
        ptype = _TARANTOOL_TYPE_ALIASES.get(ptype, ptype)
        while len(fields) <= no:
            fields.append({"name": f"field{len(fields) + 1}", "type": "any", "is_nullable": False})
        if fields[no]["type"] == "any":
            fields[no]["type"] = ptype if ptype in FIELD_TYPES else "any"
        key.append(no + 1)
    return {"id": space_id, "format": fields, "primary_key": key}


# [topics.NAME]'s keys for the reference and the example: key, type, default, meaning, example.
TOPIC_KEYS = [
    ("partitions", "integer", "`1`", "How many partitions, 1 to 1024.", "4"),
    (
        "settings",
        "string",
        '`""`',
        "TANK's and Kafka's `key=value` lines: log.segment.bytes, log.index.interval.bytes, "
        "log.retention.bytes, log.retention.ms (or .secs, .hours).",
        '"log.retention.bytes = 1073741824"',
    ),
]


def _topic(name: str, table: Any) -> dict[str, Any]:
    """[topics.NAME]: partitions (1 to 1024, default 1) and settings (TANK's and Kafka's
    `key=value` lines, checked when the topic is created)."""
    path = f"topics.{name}"
    if not name or len(name.encode()) > 255:
        raise _fail(path, "a topic name is 1 to 255 bytes")
    if not isinstance(table, dict):
        raise _fail(path, f"expected a table, got {type(table).__name__}")
    for key in table:
        if key not in ("partitions", "settings"):
            raise _fail(f"{path}.{key}", "unknown key (known: partitions, settings)")
    partitions = _int(f"{path}.partitions", table.get("partitions", 1))
    if not 1 <= partitions <= 1024:
        raise _fail(f"{path}.partitions", f"{partitions} is not in 1..1024")
    return {"partitions": partitions, "settings": _str(f"{path}.settings", table.get("settings", ""))}


def _check_spaces(spaces: Mapping[str, dict[str, Any]], buckets: dict[str, dict[str, Any]]) -> None:
    """Ids and buckets are each a space's own; a space's bucket that is not configured is
    created with the bucket defaults."""
    ids: dict[int, str] = {}
    holders: dict[str, str] = {}
    for name, sp in spaces.items():
        if sp["id"] in ids:
            raise _fail(f"spaces.{name}.id", f"{sp['id']} is the id of space {ids[sp['id']]!r} too")
        ids[sp["id"]] = name
        if sp["bucket"] in holders:
            raise _fail(
                f"spaces.{name}.bucket",
                f"bucket {sp['bucket']!r} holds space {holders[sp['bucket']]!r} already "
                "(one space per bucket)",
            )
        holders[sp["bucket"]] = name
        buckets.setdefault(sp["bucket"], _bucket(sp["bucket"], {}))


def load_config(path: str | Path) -> Config:
    """Reads and validates a TOML file. Errors name the file, the key path and the reason."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not valid UTF-8 (byte offset {e.start}); TOML files are UTF-8") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    try:
        return Config.from_dict(doc, source=str(p))
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def reference() -> str:
    """Markdown reference of every key, generated from the definitions above."""
    lines = [
        "# sluice configuration reference",
        "",
        "Generated by `sluice config reference` from `python/sluice/config.py`.",
        "",
        'Sizes take bytes or a unit (`"64MiB"`, `"1GB"`); durations take seconds or a unit '
        '(`"500ms"`, `"10m"`, `"3d"`).',
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for k in ENGINE_KEYS:
        lines.append(f"| `{k.name}` | {k.type_name} | `{_show(k.default)}` | {k.doc} |")
    lines += [
        "",
        "Buckets are tables under `[buckets.NAME]`; `default` always exists.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for k in BUCKET_KEYS:
        lines.append(f"| `buckets.NAME.{k.name}` | {k.type_name} | `{_show(k.default)}` | {k.doc} |")
    lines += [
        "",
        "Spaces (Tarantool's iproto, served on `iproto_listen`) are tables under `[spaces.NAME]`.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for name, type_name, default, doc in SPACE_KEYS:
        lines.append(f"| `spaces.NAME.{name}` | {type_name} | {default} | {doc} |")
    lines += [
        "",
        "Topics (TANK's, served on `tank_listen`) are tables under `[topics.NAME]`, created at start "
        "when the data directory does not hold them (a topic that exists keeps what it was created with).",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for name, type_name, default, doc, _ in TOPIC_KEYS:
        lines.append(f"| `topics.NAME.{name}` | {type_name} | {default} | {doc} |")
    return "\n".join(lines) + "\n"


def example_toml(data_dir: str | None = None) -> str:
    """Every key with its default, commented, from the definitions above; with `data_dir`, that
    key set (uncommented), as deploy/sluice.toml has it for the packaged service."""
    command = "sluice config example" + (f" --data-dir {data_dir}" if data_dir else "")
    out = [
        "# sluice configuration: every key, commented out at its default"
        + (", but data_dir. Generated by" if data_dir else ". Generated by"),
        f"# `{command}`; see docs/config.md for the same as a table.",
        "",
    ]
    sections: dict[str, list[Key]] = {}
    for k in ENGINE_KEYS:
        sections.setdefault(k.name.split(".")[0] if "." in k.name else "", []).append(k)
    for section, keys in sorted(sections.items(), key=lambda s: s[0] != ""):
        if section:
            out.append(f"[{section}]")
        for k in keys:
            name = k.name.split(".", 1)[1] if section else k.name
            out.append(f"# {k.doc}")
            if k.name == "data_dir" and data_dir:  # the one key a packaged service sets
                out.append(f"data_dir = {_toml(data_dir)}")
            else:
                out.append(f"# {name} = {_toml(k.default)}")
            out.append("")
    out.append("# One table per bucket; `default` always exists.")
    out.append("[buckets.default]")
    for k in BUCKET_KEYS:
        out.append(f"# {k.doc}")
        out.append(f"# {k.name} = {_toml(k.default)}")
        out.append("")
    out.append("# Spaces of Tarantool tuples served on iproto_listen, one table each; none by default.")
    out.append("# [spaces.users]")
    for name, _, _, doc in SPACE_KEYS:
        out.append(f"# {doc}")
        out.append(f"# {name} = {SPACE_EXAMPLE[name]}")
        out.append("")
    out.append("# Topics served on tank_listen, created at start, one table each; none by default.")
    out.append("# [topics.events]")
    for name, _, _, doc, example in TOPIC_KEYS:
        out.append(f"# {doc}")
        out.append(f"# {name} = {example}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (str, Path)):
        return '"' + str(v) + '"'
    return str(v)


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Path):
        return str(v)
    return repr(v) if isinstance(v, str) else str(v)
