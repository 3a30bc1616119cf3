"""The `sluice` command: serve, status, tail, tarantool-tail, bench, user, wal-dump, config.

Exit codes: 0 ok, 1 failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import getpass
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from sluice import _native, systemd
from sluice.config import (
    ENGINE_KEYS,
    Config,
    example_toml,
    is_loopback,
    load_config,
    reference,
    spaces_from_tarantool,
    user_credentials,
)
from sluice.policy import PluginError, PluginRunner

log = logging.getLogger("sluice")

# The file a running node keeps its admin bearer token in, in its data directory (admin.rs).
TOKEN_FILE = "admin.token"

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _load(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config) if args.config else Config.from_dict({}, source="<embedded defaults>")
    overrides = {}
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = args.data_dir
    if getattr(args, "force_recovery", False):
        overrides["force_recovery"] = True
    if getattr(args, "listen", None):
        overrides["listen"] = args.listen
    if getattr(args, "admin_listen", None) is not None:
        overrides["admin_listen"] = args.admin_listen
    for front in _native.FRONTS:
        key = f"{front['name']}_listen"
        if getattr(args, key, None) is not None:
            overrides[key] = getattr(args, key)
    if getattr(args, "replica_of", None) is not None:
        overrides["replication__replica_of"] = args.replica_of
    if getattr(args, "cluster", None) is not None:
        overrides["cluster__etcd"] = args.cluster
    for flag, key in (
        ("follow_tarantool", "address"),
        ("follow_tarantool_user", "user"),
        ("follow_tarantool_password_file", "password_file"),
        ("follow_spaces", "spaces"),
    ):
        if getattr(args, flag, None) is not None:
            overrides[f"tarantool_upstream__{key}"] = getattr(args, flag)
    return cfg.with_overrides(**overrides) if overrides else cfg


def _declare_followed_spaces(cfg: Config) -> Config:
    """Declares the followed spaces the configuration leaves out from the Tarantool's own
    schema (`Config.spaces_to_learn`), read once at start."""
    wanted = cfg.spaces_to_learn()
    if wanted is None:
        return cfg
    address = cfg.values["tarantool_upstream.address"]
    user = cfg.values["tarantool_upstream.user"] or None
    try:
        space_rows, index_rows = _native.tarantool_schema(
            address, user=user, password=cfg.secret("tarantool_upstream.password_file")
        )
    except _native.SluiceError as e:
        raise _native.ConfigError(
            f"invalid config: tarantool_upstream: the spaces to follow are not declared ([spaces.NAME]) "
            f"and cannot be read from the Tarantool: {e}"
        ) from None
    tables, skipped = spaces_from_tarantool(
        [json.loads(t) for t in space_rows], [json.loads(t) for t in index_rows], wanted
    )
    for name, why in sorted(skipped.items()):
        if name in wanted:
            raise _native.ConfigError(f"invalid config: tarantool_upstream.spaces: space {name!r}: {why}")
        log.warning("the Tarantool's space %r is not followed: %s", name, why)
    if not tables:
        raise _native.ConfigError(
            f"invalid config: tarantool_upstream: the Tarantool at {address} has no space to follow"
        )
    for name, table in sorted(tables.items()):
        fields = ", ".join(f"{f['name']} {f['type']}" for f in table["format"])
        log.info("following the Tarantool's space %r (id %d): %s", name, table["id"], fields)
    return cfg.with_spaces(tables)


def _create_topics(engine: _native.EmbeddedEngine, cfg: Config) -> None:
    """Creates the [topics.NAME] the data directory does not hold yet. A topic that exists
    keeps what it was created with; a different partition count or settings get a warning."""
    have = {name: (partitions, settings) for name, partitions, settings in engine.topics()}
    for name, t in cfg.topics.items():
        if name in have:
            if have[name] != (t["partitions"], t["settings"]):
                log.warning(
                    "topic %r exists with %d partition(s) and settings %r; its [topics.%s] "
                    "(%d, %r) applies only to a new topic",
                    name,
                    *have[name],
                    name,
                    t["partitions"],
                    t["settings"],
                )
            continue
        try:
            engine.create_topic(name, t["partitions"], t["settings"])
        except _native.ConfigError as e:
            why = str(e).split(": ", 2)[-1]  # after "invalid argument: topic NAME: "
            raise _native.ConfigError(f"invalid config: topics.{name}.settings: {why}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    # Fault injection for tests (docs/architecture.md): points set at start, and changeable
    # through the admin endpoint's POST /errinj from then on. Off unless the variable is set.
    errinj = os.environ.get("SLUICE_ERRINJ")
    if errinj is not None:
        try:
            _native.errinj_enable(errinj)
        except ValueError as e:
            raise _native.ConfigError(f"invalid config: SLUICE_ERRINJ: {e}") from None
        log.warning("fault injection is on (SLUICE_ERRINJ): %s", _native.errinj_values())
    cfg = _declare_followed_spaces(_load(args))
    tls_listen = cfg.server_settings()["tls_listen"]
    logins = [f"{f['name']}_listen" for f in _native.FRONTS if f["login"]]
    for key in ("listen", "admin_listen", "tls_listen", *logins):
        address = tls_listen if key == "tls_listen" else cfg.values[key]
        if address and not is_loopback(address) and not cfg.users and not args.insecure:
            raise _native.ConfigError(
                f"invalid config: {key}: {address} is beyond loopback and no user is configured "
                "([users.NAME]); pass --insecure to serve it anyway"
            )
    for front in _native.FRONTS:
        key = f"{front['name']}_listen"
        address = cfg.values[key]
        if not front["login"] and address and not is_loopback(address) and not args.insecure:
            raise _native.ConfigError(
                f"invalid config: {key}: {address} is beyond loopback, and {front['title']} has no "
                "login; pass --insecure to serve it anyway"
            )
    settings = cfg.to_native()
    # Read before anything starts: a missing file is a config error naming its key.
    etcd_password = cfg.secret("cluster.etcd_password_file") if cfg.values["cluster.etcd"] else None
    for warning in cfg.warnings():
        log.warning("config: %s", warning)
    started = time.monotonic()
    # A fatal signal (SIGABRT from a supervisor or a test whose stop timed out, a crash) prints
    # every thread's Python stack to stderr: where a stop hangs shows in the log.
    faulthandler.enable(all_threads=True)
    # Handlers go in before anything is announced: a SIGTERM sent right after the ready line
    # (or during recovery) must still flush the WAL and exit 0, not kill the process.
    stop = threading.Event()

    def set_from_a_thread(event: threading.Event) -> None:
        # A handler runs on the main thread, which may be inside `stop.wait()` holding the
        # event's lock (it is not reentrant): setting it there can deadlock, so a thread does.
        threading.Thread(target=event.set, daemon=True).start()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, flushing the WAL and stopping", signal.Signals(signum).name)
        set_from_a_thread(stop)

    reload = threading.Event()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, lambda *_: set_from_a_thread(reload))
    systemd.notify(f"STATUS=recovering {cfg.data_dir}")
    # Greenstack clients may connect while the data is recovered: they are told the server is
    # warming up, and when it is done.
    greenstack = cfg.values["greenstack_listen"]
    warmup = _native.GreenstackWarmup(greenstack) if greenstack else None
    log.info("opening %s (config %s, wal.mode %s)", cfg.data_dir, cfg.source, settings.wal_mode)
    engine = _native.EmbeddedEngine(settings)
    try:
        _create_topics(engine, cfg)
    except _native.ConfigError:
        engine.close()
        raise
    try:
        # A node of a cluster takes clients once it has converged on the map (below).
        server = _native.Server(engine, cfg.server_json(), greenstack_warmup=warmup)
    except _native.SluiceError:
        engine.close()
        raise
    plugins = PluginRunner(server)
    try:
        plugins.apply(cfg.plugins())
    except PluginError as e:
        server.stop()
        engine.close()
        raise _native.ConfigError(f"invalid config: policy: {e}") from None
    member = None
    if cfg.values["cluster.etcd"]:
        from sluice.cluster.member import join

        member = join(
            cfg.values,
            etcd_password,
            server,
            engine,
            settings.bucket_names,
            max(b["num_vbuckets"] for b in cfg.buckets.values()),
        )
        # Not before: a node failed over while it was away would serve the actives it held.
        server.accept_connections()
    report = engine.recovery_report()
    for d in report["dropped"]:
        log.warning("--force-recovery dropped %s", d["text"])
    if report["moved_aside"]:
        log.warning("moved aside as damaged: %s", ", ".join(report["moved_aside"]))
    items = sum(engine.stats(bucket=b)["items"] for b in settings.bucket_names)
    fronts = "".join(f" ({f['title']} {server.fronts.get(f['name'], 'off')})" for f in _native.FRONTS)
    log.info(
        "sluice ready: listening on %s (admin %s) (TLS %s)%s%s; "
        "%d items in %d bucket(s) %s, recovered in %.3f s (snapshot LSN %d, %d WAL records%s), "
        "ready %.3f s after start",
        server.address,
        (
            f"https://{server.admin_address}"
            if cfg.values["tls.certificate"] and cfg.values["tls.admin"]
            else None
        )
        or server.admin_address
        or "off",
        server.tls_address or "off",
        fronts,
        f", replica of {cfg.values['replication.replica_of']}"
        if cfg.values["replication.replica_of"]
        else "",
        items,
        len(settings.bucket_names),
        ",".join(settings.bucket_names),
        report["seconds"],
        report["snapshot_lsn"],
        report["wal_records"],
        (", after an unclean shutdown" if report["unclean_shutdown"] else "")
        + (f", {len(report['dropped'])} damaged part(s) dropped" if report["dropped"] else ""),
        time.monotonic() - started,
    )
    systemd.notify("READY=1", f"STATUS=serving on {server.address}, {items} items", f"MAINPID={os.getpid()}")
    ping = systemd.watchdog_interval()
    while not stop.wait(min(ping or 1.0, 1.0)):
        if ping:
            engine.stats()  # a liveness check through the engine's locks before vouching for it
            systemd.notify("WATCHDOG=1")
        if reload.is_set():
            reload.clear()
            cfg = _reload(args, cfg, server, plugins)
    systemd.notify("STOPPING=1", "STATUS=finishing requests and flushing the WAL")
    if member is not None:
        member.stop()
    plugins.stop()
    server.stop()
    engine.close()
    log.info("stopped cleanly")
    return EXIT_OK


def _reload(
    args: argparse.Namespace, current: Config, server: _native.Server, plugins: PluginRunner
) -> Config:
    """SIGHUP: re-reads the configuration. Users and their permissions change at once, policy
    plugins are re-imported and replaced, policy.timeout applies, and the TLS certificate and
    key files are read again (a pair that fails to load keeps the one in use); every other
    change is logged as waiting for a restart; a file that no longer validates is reported and
    ignored."""
    try:
        new = _load(args)
        plugins.apply(new.plugins(), reload=True)
    except (_native.ConfigError, PluginError) as e:
        log.error("reload: the configuration is not valid, keeping the running one: %s", e)
        return current
    try:
        if server.reload_tls():
            log.warning("reload: TLS certificate and key read again; new connections get them")
    except _native.ConfigError as e:
        log.error("reload: keeping the TLS certificate in use: %s", e)
    live = {k.name for k in ENGINE_KEYS if k.plugin} | {"policy.timeout"}
    server.policy_set_timeout(new.values["policy.timeout"])
    current = dataclasses.replace(current, values={**current.values, **{k: new.values[k] for k in live}})
    if new.users != current.users:
        server.set_users(new.user_list())
        for warning in new.warnings():
            log.warning("reload: %s", warning)
        added, removed = (
            sorted(set(new.users) - set(current.users)),
            sorted(set(current.users) - set(new.users)),
        )
        changed = sorted(u for u in set(new.users) & set(current.users) if new.users[u] != current.users[u])
        log.warning(
            "reload: users updated now (added %s; removed %s; changed %s)",
            added or "none",
            removed or "none",
            changed or "none",
        )
        current = dataclasses.replace(current, users=new.users)
    changed = [k for k in new.values if new.values[k] != current.values.get(k)]
    changed += [
        f"buckets.{b}"
        for b in set(new.buckets) | set(current.buckets)
        if new.buckets.get(b) != current.buckets.get(b)
    ]
    if changed:
        log.warning("reload: %s changed; these take effect after a restart", ", ".join(sorted(changed)))
    else:
        log.info("reload: the configuration is unchanged")
    return current


def _admin_address(args: argparse.Namespace, command: str) -> str | None:
    """The admin endpoint's URL base: --admin as given (http:// unless it says https://), else
    admin_listen of the configuration, over HTTPS when the configuration serves it so."""
    admin = args.admin
    if not admin:
        cfg = _load(args)
        admin = cfg.values["admin_listen"]
        if admin and cfg.values["tls.certificate"] and cfg.values["tls.admin"]:
            admin = f"https://{admin}"
    if not admin:
        print(
            f"sluice {command}: admin_listen is off in the configuration; pass --admin HOST:PORT",
            file=sys.stderr,
        )
    return admin or None


class _UsageError(Exception):
    """A command-line mistake found while preparing a command (exit 2)."""


def _basic_auth(args: argparse.Namespace) -> str | None:
    """The Authorization header for --user: the password from SLUICE_PASSWORD, else a prompt
    on a terminal, else the first line of stdin."""
    import base64

    if not args.user:
        return None
    password = os.environ.get("SLUICE_PASSWORD")
    if password is None:
        if sys.stdin.isatty():
            password = getpass.getpass(f"password of {args.user}: ")
        else:
            password = sys.stdin.readline().rstrip("\n")
    raw = f"{args.user}:{password}".encode()
    return "Basic " + base64.b64encode(raw).decode("ascii")


def _admin_auth(args: argparse.Namespace) -> str | None:
    """The Authorization header for the node this command changes or reads: --user's password,
    else the bearer token the node keeps in its data directory (--token-file, else admin.token
    in --data-dir or the configuration's data_dir, when that file is there and readable)."""
    basic = _basic_auth(args)
    if basic or args.user:
        return basic
    if args.token_file:
        path = Path(args.token_file)
    else:
        path = Path(_load(args).data_dir) / TOKEN_FILE
    try:
        token = path.read_text().strip()
    except OSError as e:
        if args.token_file:
            raise _UsageError(f"--token-file: cannot read {path}: {e.strerror}") from None
        return None
    return f"Bearer {token}" if token else None


def _admin_call(
    admin: str,
    path: str,
    timeout: float,
    method: str = "GET",
    auth: str | None = None,
    cacert: str | None = None,
) -> dict:
    """JSON from the admin endpoint (HOST:PORT, http://HOST:PORT or https://HOST:PORT; HTTPS
    verifies the node's certificate against `cacert`, else the system's CAs); raises OSError
    (URLError) when the node cannot be reached or its certificate is not trusted, HTTPError when
    it answers with an error. Every request says it is no browser's (X-Sluice-Request), which
    POSTs need (README "Admin endpoint")."""
    import json
    import ssl
    import urllib.request

    body = b"" if method == "POST" else None
    headers = {"X-Sluice-Request": "1"}
    if auth:
        headers["Authorization"] = auth
    base = admin if "://" in admin else f"http://{admin}"
    context = ssl.create_default_context(cafile=cacert) if base.startswith("https://") else None
    req = urllib.request.Request(f"{base}{path}", method=method, data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
        return json.load(r)


def _refusal(e: Exception) -> str:
    """What the node said when it answered with an error, with a hint for a missing login."""
    why = e.read().decode(errors="replace").strip()
    if e.code == 401:
        why += (
            " (pass --user NAME with the password in SLUICE_PASSWORD or at the prompt, or "
            "--data-dir/--token-file to use the node's admin.token)"
        )
    return why


def _answers_binary_protocol(address: str, timeout: float = 3.0) -> bool:
    """Whether HOST:PORT answers a memcached binary NOOP: a KV port, not an admin endpoint."""
    import socket
    import struct

    host, _, port = address.removeprefix("http://").removeprefix("https://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
            s.sendall(struct.pack(">BBHBBHIIQ", 0x80, 0x0A, 0, 0, 0, 0, 0, 0, 0))  # NOOP
            reply = s.recv(24)
    except (OSError, ValueError):
        return False
    return reply[:2] == b"\x81\x0a"


def _unreachable(admin: str, e: Exception) -> str:
    """Why the admin endpoint at `admin` gave no answer, with a hint when it is a KV port."""
    why = getattr(e, "reason", e)
    if _answers_binary_protocol(admin):
        return (
            f"{admin} is a KV port (it answers the memcached binary protocol), not an admin endpoint: "
            f"pass the node's admin_listen address (default {_default('admin_listen')})"
        )
    return f"cannot reach the admin endpoint at {admin}: {why}"


def cmd_promote(args: argparse.Namespace) -> int:
    import http.client
    import urllib.error

    admin = _admin_address(args, "promote")
    if not admin:
        return EXIT_USAGE
    auth = _admin_auth(args)
    try:
        st = _admin_call(admin, "/status", args.timeout, auth=auth, cacert=args.cacert)
        # A node that follows no active and holds no replica vbucket has nothing to promote:
        # most likely --admin (or admin_listen of the configuration) names the active.
        replicas = [v for b in st["buckets"] for v in b["vbuckets"] if v["state"] == "replica"]
        if not st.get("replication") and not replicas:
            print(
                f"sluice promote: the node at {admin} (listening on {st['listen']}) follows no node "
                "and holds no replica vbucket: there is nothing to promote. Pass --admin with the "
                "replica's admin endpoint.",
                file=sys.stderr,
            )
            return EXIT_FAILURE
        done = _admin_call(admin, "/promote", args.timeout, method="POST", auth=auth, cacert=args.cacert)
    except urllib.error.HTTPError as e:
        print(f"sluice promote: the node refused: {_refusal(e)}", file=sys.stderr)
        return EXIT_FAILURE
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        print(f"sluice promote: {_unreachable(admin, e)}", file=sys.stderr)
        return EXIT_FAILURE
    for b in done["promoted"]:
        print(f"bucket {b['bucket']}: {len(b['vbuckets'])} vbucket(s) promoted to active")
    return EXIT_OK


def cmd_move_vbucket(args: argparse.Namespace) -> int:
    """Moves one vbucket between two running nodes with a takeover stream. The POST to the
    target waits as long as the move runs (up to --timeout, which the target applies too)."""
    import http.client
    import urllib.error
    import urllib.parse

    basic = _basic_auth(args)
    auth = basic or _admin_auth(args)
    status = {}
    # Both nodes are asked first: a KV port given by mistake is found before anything moves.
    for role, admin, login in (("source", args.source, basic), ("target", args.target, auth)):
        try:
            status[role] = _admin_call(admin, "/status", args.timeout, auth=login, cacert=args.cacert)
        except urllib.error.HTTPError as e:
            print(f"sluice move-vbucket: the {role} {admin} refused: {_refusal(e)}", file=sys.stderr)
            return EXIT_FAILURE
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            print(f"sluice move-vbucket: the {role}: {_unreachable(admin, e)}", file=sys.stderr)
            return EXIT_FAILURE
    source_kv = args.source_address or status["source"]["listen"]
    query = urllib.parse.urlencode(
        {"bucket": args.bucket, "vbucket": args.vb, "source": source_kv, "timeout": args.timeout}
    )
    try:
        # The target gives up at --timeout; the socket waits a little longer to hear it say so.
        r = _admin_call(
            args.target, f"/takeover?{query}", args.timeout + 10, method="POST", auth=auth, cacert=args.cacert
        )
    except urllib.error.HTTPError as e:
        print(f"sluice move-vbucket: the takeover failed: {_refusal(e)}", file=sys.stderr)
        return EXIT_FAILURE
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        print(f"sluice move-vbucket: the target: {_unreachable(args.target, e)}", file=sys.stderr)
        return EXIT_FAILURE
    print(
        f"vbucket {r['vbucket']} of bucket {r['bucket']} moved from the node at {source_kv} "
        f"(admin {args.source}) to the node at {status['target']['listen']} (admin {args.target}): "
        f"{r['items']:,} changes streamed in {r['seconds']:.2f} s, "
        f"high seqno {r['high_seqno']}; writes to it paused {r['writes_paused_ms']:.1f} ms"
    )
    return EXIT_OK


def cmd_topic_create(args: argparse.Namespace) -> int:
    from sluice.tank import TankConnection, TankError

    try:
        with TankConnection(args.address) as t:
            t.create_topic(args.name, args.partitions, args.settings)
    except TankError as e:
        print(f"sluice topic create: {e}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"created topic {args.name} with {args.partitions} partition(s) at {args.address}")
    return EXIT_OK


def cmd_topic_list(args: argparse.Namespace) -> int:
    from sluice.tank import TankConnection, TankError

    try:
        with TankConnection(args.address) as t:
            rows = [("topic", "partition", "first", "high-water mark")]
            for name, _ in t.topics():
                for p, (first, hwm) in enumerate(t.partitions(name)):
                    rows.append((name, str(p), f"{first:,}", f"{hwm:,}"))
    except TankError as e:
        print(f"sluice topic list: {e}", file=sys.stderr)
        return EXIT_FAILURE
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    """Prints the node's /status as tables a person can read."""
    import urllib.error

    admin = _admin_address(args, "status")
    if not admin:
        return EXIT_USAGE
    try:
        st = _admin_call(admin, "/status", args.timeout, auth=_admin_auth(args), cacert=args.cacert)
    except urllib.error.HTTPError as e:
        print(f"sluice status: the node refused: {_refusal(e)}", file=sys.stderr)
        return EXIT_FAILURE
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", e)
        print(f"sluice status: cannot reach the admin endpoint at {admin}: {why}", file=sys.stderr)
        return EXIT_FAILURE
    wal = st["wal"]
    # What the LSNs mean depends on the mode: `write` syncs only for writes that ask for it
    # (durability persist levels), `none` keeps nothing on disk; a synced LSN behind (or 0)
    # there is the mode, not a node falling behind.
    written, synced = wal["written_lsn"], wal["synced_lsn"]
    if wal["mode"] == "none":
        written, synced = "n/a", "n/a (wal.mode=none keeps nothing on disk)"
    elif wal["mode"] == "write":
        synced = f"{synced} (wal.mode=write syncs only writes asking to persist)"
    print(
        f"sluice {st['version']}  instance {st['instance']}  up {st['uptime_s']} s  "
        f"listening on {st['listen']}"
    )
    print(
        f"connections {st['connections']}  wal.mode {wal['mode']}  LSN last {wal['last_lsn']} "
        f"written {written} synced {synced}{'  WAL FAILING' if wal['failing'] else ''}"
    )
    rep = st.get("replication")
    lags: dict[tuple[str, int], dict] = {}
    cl = st.get("cluster")
    if cl:
        reb = cl.get("rebalance") or {}
        running = reb.get("state") == "running"
        print(
            f"cluster {cl['cluster']} as {cl['node']}: map rev {cl['map_revision']}, "
            f"{cl['nodes_up']} node(s) up, {cl['failed_over']} failed over, "
            f"orchestrator {cl['orchestrator'] or 'none'}"
            + (f"; rebalance {reb['done']}/{reb['total']}" if running else "")
        )
    if rep:
        print(
            f"role: replica of {rep['replica_of']}"
            if rep["replica_of"]
            else "role: replica of the vbuckets the cluster map gives it"
        )
        for rb in rep["buckets"]:
            state = "streaming" if rb["connected"] else f"disconnected ({rb['last_error'] or 'connecting'})"
            print(
                f"  bucket {rb['bucket']} from {rb['active']}: {state}; {rb['connects']} connection(s), "
                f"{rb['items']:,} changes applied, {rb['rollbacks']} rollback(s)"
            )
            for v in rb["vbuckets"]:
                lags[(rb["bucket"], v["vbucket"])] = v
    else:
        print("role: active (follows no node)")
    tt = st.get("tarantool_upstream")
    if tt:
        reason = f" ({tt['reason']})" if tt["reason"] else ""
        print(
            f"following the Tarantool at {tt['address']}: {tt['state']}{reason}; "
            f"{tt['rows_applied']:,} rows applied, {tt['rows_skipped']:,} skipped, lag "
            f"{tt['lag_rows']} rows, {tt['lag_seconds']:.3f} s; vclock {tt['vclock']} of "
            f"{tt['upstream_vclock']}; {tt['copies']} copy(ies), {tt['reconnects']} reconnect(s)"
        )
        for name, why in tt["stopped_spaces"].items():
            print(f"  space {name} not followed: {why}")
    followed = any(v.get("followers") for b in st["buckets"] for v in b["vbuckets"])
    if followed:
        # The active knows a follower by the name its replica registered, which is the
        # replica's instance id (`sluice status` on the replica prints it first), and by the KV
        # address it told (which the cluster map gives clients).
        print(
            "followers are named by replica instance id (the first line of `sluice status` on each replica)"
            " and KV address"
        )
    for b in st["buckets"]:
        print()
        evicting = f"; eviction lru, {b['evictions']:,} evicted" if b.get("eviction") == "lru" else ""
        print(f"bucket {b['name']}: {b['mem_used']:,} of {b['memory_quota']:,} bytes{evicting}")
        rows = [("vbucket", "state", "items", "high seqno", "persisted", "unpersisted", "replication")]
        for v in b["vbuckets"]:
            if args.all or v["high_seqno"] or v["state"] != "active":
                lag = lags.get((b["name"], v["vbucket"]))
                if lag is not None:
                    repl = f"lag {lag['lag_seqnos']} seqnos, {lag['lag_ms']:.1f} ms"
                elif rep and v["state"] == "dead":
                    repl = "not followed (dead on the active: moved away)"
                elif v.get("followers"):
                    repl = ", ".join(
                        f"replica {f['replica'][:12]}"
                        + (f" at {f['kv_address']}" if f.get("kv_address") else "")
                        + f" acked {f['acked_seqno']} "
                        f"(lag {v['high_seqno'] - f['acked_seqno']})"
                        for f in v["followers"]
                    )
                else:
                    repl = "-"
                rows.append(
                    (
                        str(v["vbucket"]),
                        v["state"],
                        str(v["items"]),
                        str(v["high_seqno"]),
                        str(v["persisted_seqno"]),
                        str(v["high_seqno"] - v["persisted_seqno"]),
                        repl,
                    )
                )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print(
                "  ".join(
                    c.rjust(w) if i not in (1, 6) else c.ljust(w)
                    for i, (c, w) in enumerate(zip(r, widths, strict=True))
                ).rstrip()
            )
        hidden = len(b["vbuckets"]) - (len(rows) - 1)
        if hidden:
            print(f"({hidden} empty active vbuckets not shown; --all shows them)")
    for t in st.get("topics", []):
        print()
        print(f"topic {t['name']}: {len(t['partitions'])} partition(s), {t['long_polls']} consume(s) waiting")
        rows = [("partition", "first", "high-water mark", "bytes", "produced", "consumed bytes")]
        for p in t["partitions"]:
            rows.append(
                (
                    str(p["partition"]),
                    f"{p['first_seq']:,}",
                    f"{p['high_water_mark']:,}",
                    f"{p['bytes']:,}",
                    f"{p['produced_messages']:,}",
                    f"{p['consumed_bytes']:,}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    return EXIT_OK


def _parse_vbuckets(text: str) -> list[int]:
    """ "0,3,8-11" -> [0, 3, 8, 9, 10, 11]."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad vbucket list item {part!r} (use 0,3,8-11)")
        out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return out


def _text_or_base64(name: str, data: bytes, row: dict) -> None:
    import base64

    try:
        row[name] = data.decode("utf-8")
    except UnicodeDecodeError:
        row[name + "_base64"] = base64.b64encode(data).decode("ascii")


def _tuple_json(data: bytes) -> object:
    """A MessagePack value (an iproto tuple or key) as JSON-able objects: bytes (a varbinary, a
    string that is not UTF-8) become {"base64": ...}, a UUID or decimal its text, another
    extension {"ext": type, "base64": ...}; a map key that is a number, boolean or nil its JSON
    text, one that is bytes or a container "base64:" and its MessagePack bytes."""
    import json

    return json.loads(_native.msgpack_json(data))


class _BackfillProgress:
    """Progress of the backfills on stderr: a line at most every `every` seconds while one runs,
    and one when they have finished: none runs and the stream is idle or over (a vbucket whose
    backfill has not begun yet must not make the others look done)."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self.last = -every
        self.finished_reported = False

    def update(self, positions: dict, idle: bool = False) -> None:
        disk = [(seq, a, b) for seq, a, b, is_disk in positions.values() if is_disk]
        if not disk:
            return
        total = sum(b - a + 1 for _, a, b in disk)
        done = sum(max(0, min(seq, b) - a + 1) for seq, a, b in disk)
        running = sum(1 for seq, _, b in disk if seq < b)
        now = time.monotonic()
        if running:
            self.finished_reported = False
            if now - self.last < self.every:
                return
            pct = 100 * done / total
            line = f"backfill: {running} vbuckets running, {done:,} of {total:,} seqnos ({pct:.0f}%)"
        elif not self.finished_reported and idle:
            self.finished_reported = True
            line = f"backfill: done, {total:,} seqnos from {len(disk)} vbuckets"
        else:
            return
        self.last = now
        print(line, file=sys.stderr, flush=True)


def _replica_vbuckets_if_no_active(
    address: str, bucket: str, user: str | None, password: str | None
) -> list[int] | None:
    """None (every active vbucket) when the node has an active vbucket in `bucket`; else the
    vbuckets it holds as a replica, announced on stderr."""
    login = {"bucket": bucket, "username": user, "password": password}
    if _native.vbucket_positions(address, state="active", **login):
        return None
    replicas = sorted(vb for vb, _, _ in _native.vbucket_positions(address, state="replica", **login))
    if replicas:
        print(
            f"sluice tail: {address} has no active vbucket in bucket {bucket!r} (a replica node): "
            f"streaming the {len(replicas)} vbucket(s) it replicates",
            file=sys.stderr,
            flush=True,
        )
        return replicas
    return None


def cmd_tail_topic(args: argparse.Namespace) -> int:
    """Follows a topic's partitions over TANK's protocol and prints their messages."""
    import json

    from sluice.client import write_atomically
    from sluice.tank import TAIL, OutOfRange, TankConnection, TankError

    misplaced = [
        flag
        for flag, given in (
            ("--vbuckets", args.vbuckets),
            ("--tuples", args.tuples),
            ("--user", args.user),
            ("--password-stdin", args.password_stdin),
            ("--bucket", args.bucket != "default"),
        )
        if given
    ]
    if misplaced:
        print(f"sluice tail: {', '.join(misplaced)} are for buckets, not --topic", file=sys.stderr)
        return EXIT_USAGE
    address = args.address or _load(args).values["tank_listen"]
    if not address:
        print("sluice tail: no TANK listener (tank_listen is off): give --address", file=sys.stderr)
        return EXIT_USAGE
    try:
        saved = json.loads(Path(args.state).read_text()) if args.state and Path(args.state).exists() else {}
        positions = {int(p): int(seq) for p, seq in saved.get("partitions", {}).items()}
    except (ValueError, OSError, AttributeError) as e:
        print(f"sluice tail: --state {args.state}: not a topic position file ({e})", file=sys.stderr)
        return EXIT_USAGE
    printed = 0
    out = sys.stdout
    try:
        with TankConnection(address) as tank:
            ranges = tank.partitions(args.topic) if args.topic in dict(tank.topics()) else None
            if ranges is None:
                print(f"sluice tail: topic {args.topic!r} is unknown at {address}", file=sys.stderr)
                return EXIT_FAILURE
            try:
                wanted = _parse_vbuckets(args.partitions) if args.partitions else range(len(ranges))
            except ValueError as e:
                print(f"sluice tail: --partitions: {e}", file=sys.stderr)
                return EXIT_USAGE
            start = 0 if args.start == "beginning" else TAIL
            seqs = {p: positions.get(p, start) for p in wanted if p < len(ranges)}
            if len(seqs) != len(wanted):
                print(f"sluice tail: topic {args.topic!r} has {len(ranges)} partition(s)", file=sys.stderr)
                return EXIT_USAGE
            # --until-now: each partition's high-water mark at the start.
            until = {p: ranges[p][1] for p in seqs} if args.until_now else None
            if until is not None:
                seqs = {p: s for p, s in seqs.items() if s != TAIL and until[p] and s <= until[p]}
            header = False
            while seqs:
                try:
                    fetched = tank.consume_partitions(args.topic, seqs, max_wait=1.0, min_bytes=1)
                except OutOfRange as e:
                    # Retention dropped messages this position had not read: go on from the oldest.
                    print(f"sluice tail: {e}; going on from {e.first_available}", file=sys.stderr)
                    seqs[e.partition] = e.first_available
                    continue
                for f in fetched:
                    for m in f.messages:
                        if until is not None and m.seq > until[f.partition]:
                            break
                        if args.format == "json":
                            row = {"partition": f.partition, "seq": m.seq, "ts": m.ts}
                            if m.key is not None:
                                _text_or_base64("key", m.key, row)
                            if not args.no_values:
                                _text_or_base64("content", m.content, row)
                            out.write(json.dumps(row) + "\n")
                        else:
                            if not header:
                                out.write(f"{'partition':>9}  {'seq':>12}  {'ts':>13}  key  content\n")
                                header = True
                            key = (m.key or b"").decode("utf-8", "backslashreplace")
                            text = "" if args.no_values else m.content.decode("utf-8", "backslashreplace")
                            out.write(f"{f.partition:>9}  {m.seq:>12}  {m.ts:>13}  {key or '-'}  {text}\n")
                        printed += 1
                        if args.max and printed >= args.max:
                            return EXIT_OK
                    seqs[f.partition] = positions[f.partition] = f.next_seq
                    if until is not None and f.next_seq > until[f.partition]:
                        del seqs[f.partition]
                out.flush()
                if args.state:
                    write_atomically(args.state, json.dumps({"topic": args.topic, "partitions": positions}))
    except TankError as e:
        print(f"sluice tail: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        sys.stderr.close()
    return EXIT_OK


def cmd_tail(args: argparse.Namespace) -> int:
    """Follows a bucket's DCP stream (or with --topic, a topic's partitions) and prints its
    changes."""
    import json

    from sluice.client import Client

    if args.topic:
        return cmd_tail_topic(args)

    try:
        vbuckets = _parse_vbuckets(args.vbuckets) if args.vbuckets else None
    except ValueError as e:
        print(f"sluice tail: --vbuckets: {e}", file=sys.stderr)
        return EXIT_USAGE
    address = args.address or _load(args).values["listen"]
    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else None
    client = Client(address, bucket=args.bucket, username=args.user, password=password)
    if vbuckets is None:
        # "Every active vbucket" of a replica node is none: there, tail follows the vbuckets it
        # replicates instead (the copy it serves, as the Spark source reads replicas), and says so.
        try:
            vbuckets = _replica_vbuckets_if_no_active(address, args.bucket, args.user, password)
        except _native.SluiceError as e:
            print(f"sluice tail: {e}", file=sys.stderr)
            return EXIT_FAILURE
    state = args.state if args.state and Path(args.state).exists() else None
    progress = _BackfillProgress()
    printed = 0
    table_header = False
    try:
        stream = client.stream(
            vbuckets,
            start=args.start,
            end="now" if args.until_now else None,
            state=state,
            rollback="resume",
            format="python",
            values=not args.no_values,
            skip_empty=False,
            follow_moves=not args.no_follow,
        )
    except (ValueError, _native.SluiceError) as e:
        print(f"sluice tail: {e}", file=sys.stderr)
        return EXIT_FAILURE
    out = sys.stdout
    try:
        with stream:
            for batch in stream:
                for c in batch:
                    if args.tuples:
                        try:
                            key = _tuple_json(c.key)
                            tup = _tuple_json(c.value) if c.op == "mutation" and not args.no_values else None
                        except ValueError as e:
                            print(
                                f"sluice tail: --tuples: vbucket {c.vbucket} seqno {c.seqno} is not an "
                                f"iproto tuple ({e}): is {args.bucket!r} the bucket of a space?",
                                file=sys.stderr,
                            )
                            return EXIT_FAILURE
                    if args.format == "json":
                        row = {"vbucket": c.vbucket, "seqno": c.seqno, "op": c.op}
                        if args.tuples:
                            row["key"] = key
                            if tup is not None:
                                row["tuple"] = tup
                        else:
                            _text_or_base64("key", c.key, row)
                        if not args.no_values and c.op == "mutation" and not args.tuples:
                            _text_or_base64("value", c.value, row)
                        row.update(cas=c.cas, rev_seqno=c.rev_seqno, flags=c.flags, expiry=c.expiry)
                        out.write(json.dumps(row) + "\n")
                    else:
                        if not table_header:
                            out.write(f"{'vbucket':>7}  {'seqno':>12}  {'op':<10}  {'rev':>6}  key\n")
                            table_header = True
                        if args.tuples:
                            text = json.dumps(key) + ("  " + json.dumps(tup) if tup is not None else "")
                        else:
                            text = c.key.decode("utf-8", "backslashreplace")
                        out.write(f"{c.vbucket:>7}  {c.seqno:>12}  {c.op:<10}  {c.rev_seqno:>6}  {text}\n")
                    printed += 1
                    if args.max and printed >= args.max:
                        break
                out.flush()
                for vb, seqno in stream.rollbacks:
                    print(f"sluice tail: vbucket {vb} rolled back to seqno {seqno}", file=sys.stderr)
                stream.rollbacks.clear()
                if args.state:
                    stream.save_state(args.state)
                progress.update(stream.positions(), idle=not batch)
                if args.max and printed >= args.max:
                    break
            progress.update(stream.positions(), idle=True)
    except _native.SluiceError as e:
        print(f"sluice tail: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # A reader like `head` went away: what was printed is in the state file already.
        sys.stderr.close()
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    """Drives a memcached binary protocol server (sluice or memcached) or an iproto one (sluice or
    Tarantool) and prints the result."""
    import json

    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else None
    r = _native.bench(
        args.server,
        connections=args.connections,
        pipeline=args.pipeline,
        duration=args.duration,
        count=args.count,
        keys=args.keys,
        key_size=args.key_size,
        value_size=args.value_size,
        get_ratio=args.get_ratio,
        prefill=not args.no_prefill,
        threads=args.threads,
        user=args.user,
        password=password,
        cacert=args.cacert,
        protocol=args.protocol,
        space=args.space,
        durability=args.durability,
        unordered=args.unordered,
    )
    if args.json:
        print(json.dumps(r))
        return EXIT_OK if r["errors"] == 0 else EXIT_FAILURE
    lat = r["latency_us"]
    read, write = ("select", "replace") if args.protocol == "iproto" else ("get", "set")
    print(
        f"{args.server}: {r['ops']:,} requests in {r['seconds']:.2f} s = {r['ops_per_s']:,.0f} ops/s "
        f"({args.connections} connections x pipeline {args.pipeline}, {args.get_ratio:.0%} {read.upper()})"
    )
    print(f"  {read}s {r['gets']:,} (misses {r['misses']:,})  {write}s {r['sets']:,}  errors {r['errors']:,}")
    print("  latency (us)  " + "  ".join(f"{k} {v:,}" for k, v in lat.items()))
    return EXIT_OK if r["errors"] == 0 else EXIT_FAILURE


def cmd_user_hash(_args: argparse.Namespace) -> int:
    """Reads a password (a prompt on a terminal, twice, else the first line of stdin) and prints the
    credentials for [users.NAME], one TOML line per SCRAM mechanism (PLAIN checks against them
    too); the password itself is never stored."""
    if sys.stdin.isatty():
        password = getpass.getpass("password: ")
        # A typo at a prompt that does not echo would be stored for good: ask twice.
        if password and getpass.getpass("password again: ") != password:
            print("sluice user hash: the passwords differ; nothing printed", file=sys.stderr)
            return EXIT_USAGE
    else:
        password = sys.stdin.readline().rstrip("\n")
    if not password:
        print("sluice user hash: an empty password", file=sys.stderr)
        return EXIT_USAGE
    for key, value in user_credentials(password).items():
        print(f'{key} = "{value}"')
    return EXIT_OK


def cmd_wal_dump(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        print(f"sluice wal-dump: no such file: {path}", file=sys.stderr)
        return EXIT_FAILURE
    sys.stdout.flush()
    try:
        _native.wal_dump(str(path), sys.stdout.fileno())
    except _native.SluiceError as e:
        print(f"sluice wal-dump: {e}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def cmd_tarantool_tail(args: argparse.Namespace) -> int:
    if args.max < 0:
        raise _UsageError("--max must be 0 (no limit) or more")
    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else None
    if args.user is None and password is not None:
        raise _UsageError("--password-stdin goes with --user")
    # Ctrl-C ends the tail at once, as it ends `tail -f`: the native loop holds no Python state.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    _native.tarantool_tail(
        args.address,
        sys.stdout.fileno(),
        user=args.user,
        password=password,
        snapshot=args.snapshot,
        max_rows=args.max,
        timeout=args.timeout,
        idle=args.idle,
        state=args.state,
    )
    return EXIT_OK


def cmd_config_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)
    cfg.to_native()
    for warning in cfg.warnings():
        print(f"{args.file}: warning: {warning}", file=sys.stderr)
    print(f"{args.file}: ok ({len(cfg.buckets)} bucket(s): {', '.join(cfg.buckets)})")
    return EXIT_OK


def cmd_config_example(args: argparse.Namespace) -> int:
    sys.stdout.write(example_toml(data_dir=args.data_dir))
    return EXIT_OK


def cmd_config_reference(_args: argparse.Namespace) -> int:
    sys.stdout.write(reference())
    return EXIT_OK


def _default(key: str) -> object:
    """The default of a top-level configuration key, as help texts show it."""
    return next(k.default for k in ENGINE_KEYS if k.name == key)


class _ShowDefaults(argparse.HelpFormatter):
    """Help that ends each option with its default, unless it has none (None, a flag's False)
    or its text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice", description="A replication daemon for key-value changes.")
    p.add_argument("--version", action="version", version=f"sluice {_native.__version__}")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    formatter = {"formatter_class": _ShowDefaults}
    sub.required = True

    s = sub.add_parser(
        "serve",
        help="open the data directory and serve it over the network",
        description="Recover the data directory, serve the memcached binary protocol, and run "
        "until SIGTERM or Ctrl-C; then finish in-flight requests, flush the WAL and exit 0. "
        f"Without --config, embedded defaults: {_default('listen')}, admin endpoint "
        f"{_default('admin_listen')}, data in ./{_default('data_dir')}, no TLS listener (tls_listen "
        f"serves one once tls.certificate is set), one bucket 'default' of "
        f"{_native.DEFAULTS['buckets.num_vbuckets']} vbuckets. Two nodes on one machine need "
        "their own --listen, --admin-listen and --data-dir.",
        **formatter,
    )
    s.add_argument("--config", metavar="FILE", help="TOML configuration file")
    s.add_argument(
        "--data-dir", metavar="DIR", help=f"overrides data_dir (default: ./{_default('data_dir')})"
    )
    s.add_argument("--listen", metavar="HOST:PORT", help=f"overrides listen (default: {_default('listen')})")
    s.add_argument(
        "--admin-listen",
        metavar="HOST:PORT",
        help=f'overrides admin_listen ("" turns it off; default: {_default("admin_listen")})',
    )
    for front in _native.FRONTS:
        key = f"{front['name']}_listen"
        s.add_argument(
            f"--{front['name']}-listen",
            metavar="HOST:PORT",
            help=f'overrides {key} ("" turns it off; default: {_default(key)})',
        )
    s.add_argument(
        "--replica-of",
        metavar="HOST:PORT",
        help="follow this active node: every vbucket is a replica fed over DCP "
        "(overrides replication.replica_of; default: none, the node is active)",
    )
    s.add_argument(
        "--cluster",
        metavar="URL",
        help="join the cluster etcd://HOST:PORT/NAME coordinates (overrides cluster.etcd; default: "
        "none, a node on its own)",
    )
    s.add_argument(
        "--follow-tarantool",
        metavar="HOST:PORT",
        help="follow this Tarantool into the spaces of the same names, declared from its own schema "
        "when the config declares none (overrides tarantool_upstream.address; default: none)",
    )
    s.add_argument(
        "--follow-tarantool-user",
        metavar="USER",
        help="the Tarantool user to log in as (overrides tarantool_upstream.user; default: guest)",
    )
    s.add_argument(
        "--follow-tarantool-password-file",
        metavar="PATH",
        help="file holding that user's password (overrides tarantool_upstream.password_file)",
    )
    s.add_argument(
        "--follow-spaces",
        metavar="NAME,...",
        type=lambda v: [n for n in v.split(",") if n],
        help="the spaces to follow (overrides tarantool_upstream.spaces; default: every space declared, "
        "or every space of the Tarantool when none is)",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="serve on a non-loopback address although no authentication is configured",
    )
    s.add_argument(
        "--force-recovery",
        action="store_true",
        help="start despite damaged WAL or snapshot files, skipping the damage",
    )
    s.set_defaults(func=cmd_serve)

    st = sub.add_parser(
        "status",
        help="print a running node's vbuckets and WAL as tables",
        description="Reads the admin endpoint's /status (admin_listen from --config, or --admin) and "
        "prints, per bucket, each vbucket's state, items, high and persisted seqnos.",
        **formatter,
    )
    st.add_argument("--config", metavar="FILE", help="TOML configuration file (for admin_listen)")
    st.add_argument(
        "--admin", metavar="[https://]HOST:PORT", help="the admin endpoint (default: admin_listen)"
    )
    st.add_argument("--all", action="store_true", help="also list empty active vbuckets")
    st.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the node")
    st.add_argument(
        "--user", help="log in as this user (HTTP Basic); the password from SLUICE_PASSWORD or a prompt"
    )
    st.add_argument(
        "--token-file",
        metavar="FILE",
        help="the node's admin token (default: admin.token in --data-dir or the configuration's data_dir)",
    )
    st.add_argument("--data-dir", metavar="DIR", help="the node's data directory (for its admin.token)")
    st.add_argument(
        "--cacert", metavar="FILE", help="PEM CA file to verify an https:// admin endpoint's certificate with"
    )
    st.set_defaults(func=cmd_status)

    pr = sub.add_parser(
        "promote",
        help="failover: make a replica node active",
        description="Tells a running replica node (through its admin endpoint) to stop following its "
        "active and make every replica vbucket active, each with a new failover entry. Restart the "
        "old active with --replica-of this node to rejoin it: it rolls back what it never replicated.",
        **formatter,
    )
    pr.add_argument("--config", metavar="FILE", help="TOML configuration file (for admin_listen)")
    pr.add_argument(
        "--admin", metavar="[https://]HOST:PORT", help="the admin endpoint (default: admin_listen)"
    )
    pr.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the node")
    pr.add_argument(
        "--user", help="log in as this user (HTTP Basic); the password from SLUICE_PASSWORD or a prompt"
    )
    pr.add_argument(
        "--token-file",
        metavar="FILE",
        help="the node's admin token (default: admin.token in --data-dir or the configuration's data_dir)",
    )
    pr.add_argument("--data-dir", metavar="DIR", help="the node's data directory (for its admin.token)")
    pr.add_argument(
        "--cacert", metavar="FILE", help="PEM CA file to verify an https:// admin endpoint's certificate with"
    )
    pr.set_defaults(func=cmd_promote)

    mv = sub.add_parser(
        "move-vbucket",
        help="move one vbucket to another node (takeover)",
        description="Takeover of one vbucket (DCP takeover stream): the target catches up, the source "
        "goes pending (writes get a temporary failure), drains and hands over with SET_VBUCKET_STATE; "
        "the target goes active and the source dead (writes there get NOT_MY_VBUCKET). Prints how "
        "long writes to the vbucket paused. --from and --to are the nodes' admin endpoints "
        f"(admin_listen, default {_default('admin_listen')}), not their KV ports.",
        **formatter,
    )
    mv.add_argument("--vb", type=int, required=True, metavar="N", help="the vbucket to move")
    mv.add_argument(
        "--from", dest="source", required=True, metavar="HOST:PORT", help="the source's admin endpoint"
    )
    mv.add_argument(
        "--to", dest="target", required=True, metavar="HOST:PORT", help="the target's admin endpoint"
    )
    mv.add_argument("--bucket", default="default", help="the bucket")
    mv.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the move")
    mv.add_argument(
        "--source-address",
        metavar="HOST:PORT",
        help="the source's KV address as the target reaches it "
        "(default: the listen address the source reports)",
    )
    mv.add_argument("--config", metavar="FILE", help="the target's TOML configuration (for its data_dir)")
    mv.add_argument(
        "--user", help="log in as this user (HTTP Basic); the password from SLUICE_PASSWORD or a prompt"
    )
    mv.add_argument(
        "--token-file",
        metavar="FILE",
        help="the target's admin token (default: admin.token in --data-dir or the configuration's data_dir)",
    )
    mv.add_argument("--data-dir", metavar="DIR", help="the target's data directory (for its admin.token)")
    mv.add_argument(
        "--cacert", metavar="FILE", help="PEM CA file to verify an https:// admin endpoint's certificate with"
    )
    mv.set_defaults(func=cmd_move_vbucket)

    d = sub.add_parser(
        "wal-dump",
        help="print a WAL segment or snapshot (sluice's or Tarantool's) as JSON lines",
        description="Print the records of a .xlog or .snap file as JSON lines, then a last "
        "line telling how the file ends (eof, no-eof-marker, torn, corrupt) "
        "with its byte offset. Tarantool's own files (format 0.12 and 0.13) are read too: a first "
        "line with the file's meta (type, version, instance, vclock), then each row as "
        'Tarantool\'s xlog module shows it ({"HEADER": ..., "BODY": ...}).',
    )
    d.add_argument("file")
    d.set_defaults(func=cmd_wal_dump)

    t = sub.add_parser(
        "tail",
        help="follow a bucket's change stream (DCP) and print it as JSON lines or a table",
        description="Streams every active vbucket (or --vbuckets) of a bucket from the beginning or "
        "from now, printing each mutation, deletion and expiration. With --state FILE the position "
        "is saved after every batch printed and a restart continues from it: no duplicates, no "
        "gaps. A progress line goes to stderr while a backfill runs. On a replica node (no active "
        "vbucket) it streams the vbuckets the node replicates. On a node of a cluster it streams "
        "every vbucket of the bucket from its active, wherever the cluster map puts it; a vbucket "
        "that moves (rebalance, failover, move-vbucket) goes on from its new node where it left "
        "off (--no-follow: this node alone).",
        **formatter,
    )
    t.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="the server (default: listen of --config; with --topic, its tank_listen)",
    )
    t.add_argument("--config", metavar="FILE", help="TOML configuration file (for listen)")
    t.add_argument("--bucket", default="default", help="the bucket")
    t.add_argument(
        "--topic",
        metavar="NAME",
        help="follow a topic's partitions over TANK's protocol instead of a bucket: prints each "
        "message (partition, seq, ts, key, content)",
    )
    t.add_argument("--partitions", metavar="LIST", help="with --topic: e.g. 0,2-3 (default: every one)")
    t.add_argument(
        "--vbuckets",
        metavar="LIST",
        help="e.g. 0,3,8-11 (default: every active vbucket; on a replica node, every replica vbucket; in a "
        "cluster, every vbucket)",
    )
    t.add_argument(
        "--from",
        dest="start",
        choices=["beginning", "now"],
        default="now",
        help="where vbuckets the --state file does not cover start: their first change, or only "
        "changes made from now on",
    )
    t.add_argument("--until-now", action="store_true", help="stop at the high seqnos of the moment")
    t.add_argument("--state", metavar="FILE", help="resume from and save the stream position to FILE")
    t.add_argument("--format", choices=["json", "table"], default="json", help="output lines")
    t.add_argument("--no-values", action="store_true", help="keys and metadata only")
    t.add_argument(
        "--tuples",
        action="store_true",
        help="the bucket holds an iproto space: print each key and tuple (MessagePack) as JSON arrays "
        '("key": [1], "tuple": [1, "ada", 30])',
    )
    t.add_argument(
        "--no-follow",
        action="store_true",
        help="stream from this node alone, as it holds the vbuckets: do not follow the cluster map",
    )
    t.add_argument("--max", type=int, default=0, help="stop after printing this many changes (0: no limit)")
    t.add_argument("--user", help="SASL PLAIN user; the password is read from stdin with --password-stdin")
    t.add_argument("--password-stdin", action="store_true")
    t.set_defaults(func=cmd_tail)

    tt = sub.add_parser(
        "tarantool-tail",
        help="follow a Tarantool as an anonymous replica and print its changes as JSON lines",
        description="Connects to a Tarantool (2.6 or later) as an anonymous replica (nothing is "
        "registered in its _cluster; the user needs its replication role, e.g. "
        "box.schema.user.grant('rep', 'replication')) and prints every row it replicates, as "
        "wal-dump prints the rows of Tarantool's files. With --snapshot, first the rows of its "
        "snapshot (the system spaces, then yours), then every change after it; otherwise the "
        "changes from now on. Heartbeats are answered, so box.info.replication on the Tarantool "
        "shows this reader following it.",
        **formatter,
    )
    tt.add_argument("address", metavar="HOST:PORT", help="the Tarantool's iproto address")
    tt.add_argument("--user", help="chap-sha1 user; the password is read from stdin with --password-stdin")
    tt.add_argument("--password-stdin", action="store_true")
    tt.add_argument(
        "--snapshot",
        action="store_true",
        help="print the snapshot's rows first (not when resuming from --state)",
    )
    tt.add_argument(
        "--state",
        metavar="FILE",
        help="resume from the position saved in FILE, and save it after every row printed",
    )
    tt.add_argument("--max", type=int, default=0, help="stop after printing this many rows (0: no limit)")
    tt.add_argument("--timeout", type=float, default=10.0, help="seconds to connect and for each answer")
    tt.add_argument(
        "--idle", type=float, default=10.0, help="give up after this many seconds without a row or heartbeat"
    )
    tt.set_defaults(func=cmd_tarantool_tail)

    b = sub.add_parser(
        "bench",
        help="load a memcached binary protocol or iproto server (sluice, memcached, Tarantool), measure it",
        description="Pipelined load from N connections: GETs and SETs by --get-ratio over --keys keys, "
        "for --duration seconds (or --count requests). Prints ops/s and latency percentiles "
        "(HdrHistogram; each request from the send of its batch to its reply). With --protocol iproto: "
        "SELECT by primary key and REPLACE of [id, name, age] tuples in --space (a `users` space: "
        "unsigned id first, name a string of --value-size bytes, age unsigned), over Tarantool's iproto.",
        **formatter,
    )
    b.add_argument("--server", required=True, metavar="HOST:PORT")
    b.add_argument(
        "--protocol",
        choices=["memcached", "iproto", "greenstack"],
        default="memcached",
        help="what to speak (greenstack: the server's greenstack_listen)",
    )
    b.add_argument("--space", type=int, default=512, help="iproto: the space id")
    b.add_argument("--connections", type=int, default=16, help="client connections")
    b.add_argument("--pipeline", type=int, default=32, help="requests in flight per connection")
    b.add_argument("--duration", type=float, default=10.0, help="seconds")
    b.add_argument("--count", type=int, default=0, help="stop after this many requests (0: duration only)")
    b.add_argument("--keys", type=int, default=100_000, help="distinct keys")
    b.add_argument("--key-size", type=int, default=16, help="bytes per key (memcached; iproto keys are ids)")
    b.add_argument("--value-size", type=int, default=100, help="bytes per value (iproto: of the name field)")
    b.add_argument("--get-ratio", type=float, default=0.9, help="share of reads (GET, SELECT) among requests")
    b.add_argument("--no-prefill", action="store_true", help="do not write every key before measuring")
    b.add_argument(
        "--durability",
        choices=["none", "persist", "majority", "majority_and_persist_active", "persist_to_majority"],
        help="the level the writes ask for (memcached: majority and the *_persist levels; greenstack: "
        "any), else the bucket's",
    )
    b.add_argument(
        "--unordered",
        action="store_true",
        help="memcached: say HELLO UnorderedExecution, so that a durable write's reply does not hold "
        "back the replies behind it",
    )
    b.add_argument("--threads", type=int, default=2, help="client threads")
    b.add_argument(
        "--user",
        help="SASL PLAIN user (iproto: chap-sha1); the password is read from stdin with --password-stdin",
    )
    b.add_argument("--password-stdin", action="store_true")
    b.add_argument(
        "--cacert",
        metavar="FILE",
        help="connect over TLS (the TLS port, e.g. 11207), trusting the CAs in this PEM file; the "
        "server's certificate must carry the --server IP address",
    )
    b.add_argument("--json", action="store_true", help="print the result as one JSON object")
    b.set_defaults(func=cmd_bench)

    tp = sub.add_parser("topic", help="create and list topics on a TANK listener (sluice's or TANK's)")
    tsub = tp.add_subparsers(dest="topic_command", metavar="ACTION")
    tsub.required = True
    tc = tsub.add_parser("create", help="create a topic (as tank-cli create_topic does)")
    tc.add_argument("name")
    tc.add_argument("--partitions", type=int, default=1, help="how many partitions (default: 1)")
    tc.add_argument(
        "--settings",
        default="",
        help="TANK's and Kafka's key=value lines, e.g. 'log.retention.bytes=1000000' (default: none)",
    )
    tl = tsub.add_parser("list", help="print every topic with its partitions' sequence numbers")
    for a in (tc, tl):
        a.add_argument(
            "--address",
            default="127.0.0.1:11011",
            metavar="HOST:PORT",
            help="the TANK listener (default: 127.0.0.1:11011)",
        )
    tc.set_defaults(func=cmd_topic_create)
    tl.set_defaults(func=cmd_topic_list)

    u = sub.add_parser("user", help="manage users: print the credentials for [users.NAME]")
    usub = u.add_subparsers(dest="user_command", metavar="ACTION")
    usub.required = True
    uh = usub.add_parser(
        "hash",
        help="read a password (prompt or stdin) and print the lines to put under [users.NAME]: "
        "scram_sha512, scram_sha256, scram_sha1 (salted and iterated keys, never the password)",
    )
    uh.set_defaults(func=cmd_user_hash)

    from sluice.cluster.cli import add_parser as add_cluster_parser

    add_cluster_parser(sub)

    c = sub.add_parser("config", help="check a configuration file or print the reference of every key")
    csub = c.add_subparsers(dest="config_command", metavar="ACTION")
    csub.required = True
    cc = csub.add_parser("check", help="validate a TOML file; exit 2 with the key and reason if it is wrong")
    cc.add_argument("file")
    cc.set_defaults(func=cmd_config_check)
    ce = csub.add_parser("example", help="print a TOML file of every key with its default, commented")
    ce.add_argument(
        "--data-dir",
        metavar="DIR",
        help="set data_dir to DIR, uncommented (a packaged service's file: deploy/sluice.toml "
        "sets /var/lib/sluice)",
    )
    ce.set_defaults(func=cmd_config_example)
    cr = csub.add_parser("reference", help="print every key with its type, default and meaning (Markdown)")
    cr.set_defaults(func=cmd_config_reference)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except _native.ConfigError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return EXIT_USAGE
    except _UsageError as e:
        print(f"sluice {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except _native.SluiceError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
