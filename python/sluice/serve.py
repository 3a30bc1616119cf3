"""`sluice serve`: the daemon's life. The configuration checked, the engine opened and
recovered, the server started with its fronts, systemd told, signals handled (SIGTERM and
SIGINT stop, SIGHUP reloads users, plugins and certificates), and the WAL flushed at the
end."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import logging
import os
import re
import signal
import threading
import time

from sluice import _native, systemd
from sluice.config import (
    ENGINE_KEYS,
    KV_DEFAULT_PORT,
    Config,
    is_loopback,
    spaces_from_tarantool,
)
from sluice.options import EXIT_OK, load_for
from sluice.policy import PluginError, PluginRunner

log = logging.getLogger("sluice")


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
    cfg = _declare_followed_spaces(load_for(args))
    server_settings = cfg.server_settings()
    listeners = {**server_settings["listeners"], **server_settings["tls_listeners"]}
    for front in _native.FRONTS:
        for key in (front["listen_key"], front["tls_listen_key"]):
            address = listeners[key]
            if not address or is_loopback(address) or args.insecure:
                continue
            if not front["login"]:
                raise _native.ConfigError(
                    f"invalid config: {key}: {address} is beyond loopback, and {front['title']} has no "
                    "login; pass --insecure to serve it anyway"
                )
            if not cfg.users:
                raise _native.ConfigError(
                    f"invalid config: {key}: {address} is beyond loopback and no user is configured "
                    "([users.NAME]); pass --insecure to serve it anyway"
                )
    admin = cfg.values["admin_listen"]
    if admin and not is_loopback(admin) and not cfg.users and not args.insecure:
        raise _native.ConfigError(
            f"invalid config: admin_listen: {admin} is beyond loopback and no user is configured "
            "([users.NAME]); pass --insecure to serve it anyway"
        )
    settings = cfg.to_native()
    # Read before anything starts: a missing or unusable file is a config error naming its key.
    cfg.check_files()
    etcd_password = cfg.secret("cluster.etcd_password_file") if cfg.values["cluster.etcd"] else None
    for warning in cfg.warnings():
        log.warning("config: %s", warning)
    placed = cfg.fronts_beside_listen()
    # On port 0 each is a free port, which only the ready line can tell.
    if placed and not cfg.values["listen"].endswith(":0"):
        log.info(
            "the listeners not set are placed beside listen %s (its port is not %d): %s",
            cfg.values["listen"],
            KV_DEFAULT_PORT,
            ", ".join(f"{key} {address}" for key, address in placed.items()),
        )
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
    except _native.SluiceError as e:
        engine.close()
        taken = re.search(r"\((\w+)\): Address already in use", str(e))
        if taken is None:
            raise
        key = taken.group(1)
        flag = f"--{key.replace('_', '-')}"
        kv = {f["listen_key"] for f in _native.FRONTS if f["kv_port"]}
        off = {"admin_listen"} | {f["listen_key"] for f in _native.FRONTS} - kv
        if key in off:
            how = f'{flag} HOST:PORT, or {flag} "" to turn it off'
        else:
            how = f"{flag} HOST:PORT" if key in kv else f"another {key}"
        if key in placed:
            how += f"; {key} was placed beside listen {cfg.values['listen']}"
        raise _native.SluiceError(f"{e} (another node on this machine? give this one {how})") from None
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
    fronts = "".join(
        f" ({f['title']} {server.fronts.get(f['name'], 'off')}"
        + (f", TLS {server.tls_fronts[f['name']]}" if f["name"] in server.tls_fronts else "")
        + ")"
        for f in _native.FRONTS
        if not f["kv_port"]
    )
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
        new = load_for(args)
        plugins.apply(new.plugins(), reload=True)
    except (_native.ConfigError, PluginError) as e:
        log.error("reload: the configuration is not valid, keeping the running one: %s", e)
        return current
    # What this reload put in force now, so that it is not then called unchanged.
    applied = False
    try:
        if server.reload_tls():
            applied = True
            log.warning("reload: TLS certificate and key read again; new connections get them")
    except _native.ConfigError as e:
        log.error("reload: keeping the TLS certificate in use: %s", e)
    live = {k.name for k in ENGINE_KEYS if k.plugin} | {"policy.timeout"}
    live_changed = sorted(k for k in live if new.values[k] != current.values.get(k))
    if live_changed:
        applied = True
        log.warning("reload: %s now in force", ", ".join(live_changed))
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
        applied = True
    changed = [k for k in new.values if new.values[k] != current.values.get(k)]
    changed += [
        f"buckets.{b}"
        for b in set(new.buckets) | set(current.buckets)
        if new.buckets.get(b) != current.buckets.get(b)
    ]
    if changed:
        log.warning("reload: %s changed; these take effect after a restart", ", ".join(sorted(changed)))
    elif not applied:
        log.info("reload: the configuration is unchanged")
    return current
