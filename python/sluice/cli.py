"""The `sluice` command: serve, status, tail, tarantool-tail, bench, user, wal-dump, config,
completion.

Exit codes: 0 ok, 1 failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import signal
import sys
from pathlib import Path

from sluice import _native
from sluice.admin_client import (
    UsageError,
    admin_address,
    admin_auth,
    admin_call,
    basic_auth,
    not_an_admin_endpoint,
    refusal,
    unreachable,
)
from sluice.config import (
    KV_DEFAULT_PORT,
    example_toml,
    load_config,
    reference,
    user_credentials,
)
from sluice.options import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, default_of
from sluice.probe import mismatch
from sluice.serve import cmd_serve
from sluice.tail import cmd_tail

log = logging.getLogger("sluice")


def cmd_promote(args: argparse.Namespace) -> int:
    import http.client
    import urllib.error

    admin = admin_address(args, "promote")
    if not admin:
        return EXIT_USAGE
    auth = admin_auth(args)
    try:
        st = admin_call(admin, "/status", args.timeout, auth=auth, cacert=args.cacert)
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
        done = admin_call(admin, "/promote", args.timeout, method="POST", auth=auth, cacert=args.cacert)
    except urllib.error.HTTPError as e:
        print(
            f"sluice promote: {not_an_admin_endpoint(admin, e) or 'the node refused: ' + refusal(e)}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        print(f"sluice promote: {unreachable(admin, e)}", file=sys.stderr)
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

    basic = basic_auth(args)
    auth = basic or admin_auth(args)
    status = {}
    # Both nodes are asked first: a KV port given by mistake is found before anything moves.
    for role, admin, login in (("source", args.source, basic), ("target", args.target, auth)):
        try:
            status[role] = admin_call(admin, "/status", args.timeout, auth=login, cacert=args.cacert)
        except urllib.error.HTTPError as e:
            wrong = not_an_admin_endpoint(admin, e)
            why = f"the {role}: {wrong}" if wrong else f"the {role} {admin} refused: {refusal(e)}"
            print(f"sluice move-vbucket: {why}", file=sys.stderr)
            return EXIT_FAILURE
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            print(f"sluice move-vbucket: the {role}: {unreachable(admin, e)}", file=sys.stderr)
            return EXIT_FAILURE
    source_kv = args.source_address or status["source"]["listen"]
    query = urllib.parse.urlencode(
        {"bucket": args.bucket, "vbucket": args.vb, "source": source_kv, "timeout": args.timeout}
    )
    try:
        # The target gives up at --timeout; the socket waits a little longer to hear it say so.
        r = admin_call(
            args.target, f"/takeover?{query}", args.timeout + 10, method="POST", auth=auth, cacert=args.cacert
        )
    except urllib.error.HTTPError as e:
        print(f"sluice move-vbucket: the takeover failed: {refusal(e)}", file=sys.stderr)
        return EXIT_FAILURE
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        print(f"sluice move-vbucket: the target: {unreachable(args.target, e)}", file=sys.stderr)
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
        # Checked here: the broker's answer says only that the settings are not valid.
        _native.check_topic_settings(args.settings)
    except _native.ConfigError as e:
        print(f"sluice topic create: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with TankConnection(args.address) as t:
            t.create_topic(args.name, args.partitions, args.settings)
    except TankError as e:
        print(f"sluice topic create: {mismatch(args.address, 'tank') or e}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"created topic {args.name} with {args.partitions} partition(s) at {args.address}")
    return EXIT_OK


def cmd_topic_list(args: argparse.Namespace) -> int:
    from sluice.tank import TankConnection, TankError

    try:
        with TankConnection(args.address) as t:
            rows = [("topic", "partition", "first", "high-water mark")]
            for name, _ in t.topics():
                for p, known in enumerate(t.ranges(name)):
                    if known is None:
                        rows.append((name, str(p), "-", "no leader now"))
                    else:
                        rows.append((name, str(p), f"{known[0]:,}", f"{known[1]:,}"))
    except TankError as e:
        print(f"sluice topic list: {mismatch(args.address, 'tank') or e}", file=sys.stderr)
        return EXIT_FAILURE
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    """Prints the node's /status as tables a person can read."""
    import http.client
    import urllib.error

    admin = admin_address(args, "status")
    if not admin:
        return EXIT_USAGE
    try:
        st = admin_call(admin, "/status", args.timeout, auth=admin_auth(args), cacert=args.cacert)
    except urllib.error.HTTPError as e:
        print(
            f"sluice status: {not_an_admin_endpoint(admin, e) or 'the node refused: ' + refusal(e)}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        print(f"sluice status: {unreachable(admin, e)}", file=sys.stderr)
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


def cmd_bench(args: argparse.Namespace) -> int:
    """Drives a memcached binary protocol server (sluice or memcached) or an iproto one (sluice or
    Tarantool) and prints the result."""

    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else None
    # Asked first: the load's connections would wait for ever on a port that never answers.
    expected = {"memcached": "kv"}.get(args.protocol, args.protocol)
    wrong = None if args.cacert else mismatch(args.server, expected)
    if wrong:
        print(f"sluice bench: {wrong}", file=sys.stderr)
        return EXIT_FAILURE
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
        f"succeeded ({args.connections} connections x pipeline {args.pipeline}, "
        f"{args.get_ratio:.0%} {read.upper()})"
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


# What tarantool-tail follows.
TARANTOOL = "a Tarantool's iproto port (its box.cfg listen, 2.6 or later)"


def cmd_tarantool_tail(args: argparse.Namespace) -> int:
    if args.max < 0:
        raise UsageError("--max must be 0 (no limit) or more")
    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else None
    if args.user is None and password is not None:
        raise UsageError("--password-stdin goes with --user")
    # Asked first: a port that is no iproto one would be waited on for --timeout, then named
    # only as giving no answer.
    wrong = mismatch(args.address, "iproto", timeout=min(args.timeout, 2.0), wanted=TARANTOOL)
    if wrong:
        print(f"sluice tarantool-tail: {wrong}", file=sys.stderr)
        return EXIT_FAILURE
    # Ctrl-C ends the tail at once, as it ends `tail -f`: the native loop holds no Python state.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    try:
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
    except _native.SluiceError as e:
        # An iproto port that does not replicate (a sluice node's iproto_listen greets as
        # Tarantool does) refuses the replication requests as unknown.
        hint = (
            f": {args.address} speaks iproto but does not replicate (a sluice node's iproto_listen?); "
            f"expected {TARANTOOL}"
            if "Unknown request type" in str(e)
            else ""
        )
        print(f"sluice tarantool-tail: {e}{hint}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def cmd_config_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)
    cfg.to_native()
    cfg.check_files()
    # What the server checks as it starts (listeners, TLS files), without binding anything.
    max_item = max((b["max_item_size"] for b in cfg.buckets.values()), default=0)
    _native.check_server_settings(cfg.server_json(), max_item, bool(cfg.values["replication.replica_of"]))
    for warning in cfg.warnings():
        print(f"{args.file}: warning: {warning}", file=sys.stderr)
    print(f"{args.file}: ok ({len(cfg.buckets)} bucket(s): {', '.join(cfg.buckets)})")
    return EXIT_OK


# Where each shell looks for a completion script of its own (printed with the script's help).
COMPLETION_PLACES = {
    "bash": "~/.local/share/bash-completion/completions/sluice",
    "zsh": "a directory of $fpath, as _sluice",
    "fish": "~/.config/fish/completions/sluice.fish",
}


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    parser = build_parser()
    # Arguments that take a path complete as one: a file for FILE and PATH (and the positional
    # `file` of wal-dump and config check), a directory for DIR.
    paths = {"FILE": shtab.FILE, "PATH": shtab.FILE, "DIR": shtab.DIRECTORY, "file": shtab.FILE}
    parsers = [parser]
    while parsers:
        for action in parsers.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif (name := action.metavar if isinstance(action.metavar, str) else action.dest) in paths:
                action.complete = paths[name]  # type: ignore[attr-defined]
    sys.stdout.write(shtab.complete(parser, shell=args.shell))
    return EXIT_OK


def cmd_config_example(args: argparse.Namespace) -> int:
    sys.stdout.write(example_toml(data_dir=args.data_dir))
    return EXIT_OK


def cmd_config_reference(_args: argparse.Namespace) -> int:
    sys.stdout.write(reference())
    return EXIT_OK


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
        f"Without --config, embedded defaults: {default_of('listen')}, admin endpoint "
        f"{default_of('admin_listen')}, data in ./{default_of('data_dir')}, no TLS listener (tls_listen "
        f"serves one once tls.certificate is set), one bucket 'default' of "
        f"{_native.DEFAULTS['buckets.num_vbuckets']} vbuckets. A second node on one machine needs "
        "only its own --data-dir, --listen and --admin-listen: when listen is not on port "
        f"{KV_DEFAULT_PORT}, each front listener that no flag or configuration sets listens on "
        f"listen's host at its default port plus (listen's port - {KV_DEFAULT_PORT}), and so does "
        f'tls_listen "auto"; e.g. --listen 127.0.0.1:{KV_DEFAULT_PORT + 100} puts '
        + ", ".join(
            f"{f['title']} on {int(f['default_listen'].rpartition(':')[2]) + 100}"
            for f in _native.FRONTS
            if not f["kv_port"]
        )
        + "; port 0 gives each a free port. "
        + ", ".join(f"--{f['listen_key'].replace('_', '-')}" for f in _native.FRONTS if not f["kv_port"])
        + ' set them instead ("" turns one off).',
        **formatter,
    )
    s.add_argument("--config", metavar="FILE", help="TOML configuration file")
    s.add_argument(
        "--data-dir", metavar="DIR", help=f"overrides data_dir (default: ./{default_of('data_dir')})"
    )
    s.add_argument(
        "--admin-listen",
        metavar="HOST:PORT",
        help=f'overrides admin_listen ("" turns it off; default: {default_of("admin_listen")})',
    )
    for front in _native.FRONTS:
        key = front["listen_key"]
        off = "" if front["kv_port"] else '"" turns it off; '
        s.add_argument(
            "--" + key.replace("_", "-"),
            metavar="HOST:PORT",
            help=f"overrides {key} ({off}default: {default_of(key)}"
            + ("" if front["kv_port"] else ", or beside --listen when that is on another port")
            + ")",
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
        f"(admin_listen, default {default_of('admin_listen')}), not their KV ports.",
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
        "--xattrs",
        action="store_true",
        help="with each change its document's extended attributes, user and system (JSON: an "
        '"xattrs" object; a deletion shows those its tombstone kept)',
    )
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

    from sluice.certs import add_parser as add_tls_parser
    from sluice.cluster.cli import add_parser as add_cluster_parser

    add_cluster_parser(sub)
    add_tls_parser(sub)

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

    co = sub.add_parser(
        "completion",
        help="print a completion script for bash, zsh or fish",
        description="Prints the shell's completion script of every command and option, made from "
        "this parser (shtab). Install it where the shell finds it: "
        + "; ".join(f"{shell}: {place}" for shell, place in COMPLETION_PLACES.items())
        + ". For this session only, in bash: source <(sluice completion bash).",
    )
    co.add_argument("shell", choices=sorted(COMPLETION_PLACES))
    co.set_defaults(func=cmd_completion)
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
    except UsageError as e:
        print(f"sluice {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except _native.SluiceError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
