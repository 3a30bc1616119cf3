"""The configuration's keys, each with its parser, default and documentation: the engine's and
the server's (a registered front's listener among them, as the front declares it), the policy
plugins', the cluster's, and a bucket's."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sluice._native import DEFAULTS, FRONTS
from sluice.config.values import (
    Key,
    _at_least,
    _between,
    _bool,
    _choice,
    _fail,
    _float,
    _int,
    _names,
    _optional_path,
    _path,
    _str,
    parse_duration,
    parse_listen,
    parse_size,
)

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised on older interpreters only
    pass


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


def _front_listen_doc(front: dict[str, Any]) -> str:
    """A front's listener key's documentation, from what it declares."""
    if front["kv_port"]:
        off = ""
    else:
        off = ' "" turns it off.'
    if front["login"]:
        return front["doc"] + off + " Beyond loopback it needs users (or --insecure)."
    return front["doc"] + f" {front['title']} has no login: beyond loopback it needs --insecure." + off


def _front_tls_listen_doc(front: dict[str, Any]) -> str:
    """A front's TLS listener key's documentation, from what it declares."""
    auto = (
        f'"auto" (the default): {front["default_tls_listen"]} when tls.certificate is set, off otherwise; '
        if front["default_tls_listen"]
        else ""
    )
    return (
        f"Address of the {front['title']} listener inside TLS (tls.certificate, tls.key, tls.client_ca): "
        f'the same protocol on a port of its own. {auto}"" turns it off. Beyond loopback it needs users '
        "(or --insecure)."
    )


def _parse_tls_listen(front: dict[str, Any]) -> Callable[[str, Any], str]:
    auto = ("", "auto") if front["default_tls_listen"] else ("",)
    return lambda p, v: parse_listen(p, v) if v not in auto else v


ENGINE_KEYS += [
    # Each registered front's listener, as the front declares it (sluice._native.FRONTS); the
    # memcached port's is `listen`.
    *(
        Key(
            front["listen_key"],
            (lambda p, v: parse_listen(p, v))
            if front["kv_port"]
            else (lambda p, v: parse_listen(p, v) if v != "" else ""),
            front["default_listen"],
            _front_listen_doc(front),
            "HOST:PORT",
            server=True,
        )
        for front in FRONTS
    ),
    Key(
        "admin_listen",
        lambda p, v: parse_listen(p, v) if v != "" else "",
        "127.0.0.1:11280",
        "Address of the admin HTTP endpoint: GET /metrics (Prometheus) and /status (JSON), POST "
        '/promote and /takeover (docs/admin.md). "" turns it off. Beyond loopback it needs '
        "users (or --insecure).",
        "HOST:PORT",
        server=True,
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
    # Each registered front's TLS listener (`tls_listen` is the memcached port's, 11207 by
    # Couchbase's convention).
    *(
        Key(
            front["tls_listen_key"],
            _parse_tls_listen(front),
            DEFAULTS[front["tls_listen_key"]],
            _front_tls_listen_doc(front),
            "HOST:PORT",
            server=True,
        )
        for front in FRONTS
    ),
    Key(
        "require_tls",
        _bool,
        DEFAULTS["require_tls"],
        "Refuse logins (SASL, iproto AUTH, Greenstack's) on plain-text connections from beyond "
        "loopback, so that no password or its proof crosses the network in clear: such clients log "
        "in on a TLS port. Without it, a listener beyond loopback that takes logins in plain text "
        "is named in a warning at start.",
        "bool",
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
        'HOST:PORT of a Tarantool this node follows as its replica (docs/iproto.md "A node that follows a '
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
