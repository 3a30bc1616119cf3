"""The `sluice` command: serve, wal-dump, config.

Exit codes: 0 ok, 1 failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from sluice import _native
from sluice.config import Config, is_loopback, load_config, reference

log = logging.getLogger("sluice")

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
    return cfg.with_overrides(**overrides) if overrides else cfg


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = _load(args)
    listen = cfg.values["listen"]
    if not is_loopback(listen) and not args.insecure:
        raise _native.ConfigError(
            f"invalid config: listen: {listen} is beyond loopback and no authentication is configured; "
            "pass --insecure to serve it anyway"
        )
    settings = cfg.to_native()
    started = time.monotonic()
    # Handlers go in before anything is announced: a SIGTERM sent right after the ready line
    # (or during recovery) must still flush the WAL and exit 0, not kill the process.
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, flushing the WAL and stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("opening %s (config %s, wal.mode %s)", cfg.data_dir, cfg.source, settings.wal_mode)
    engine = _native.EmbeddedEngine(settings)
    try:
        server = _native.Server(engine, listen, **cfg.server_settings())
    except _native.SluiceError:
        engine.close()
        raise
    report = engine.recovery_report()
    items = sum(engine.stats(bucket=b)["items"] for b in settings.bucket_names)
    log.info(
        "sluice ready: listening on %s; %d items in %d bucket(s) %s, recovered in %.3f s "
        "(snapshot LSN %d, %d WAL records%s), ready %.3f s after start",
        server.address,
        items,
        len(settings.bucket_names),
        ",".join(settings.bucket_names),
        report["seconds"],
        report["snapshot_lsn"],
        report["wal_records"],
        ", after an unclean shutdown" if report["unclean_shutdown"] else "",
        time.monotonic() - started,
    )
    while not stop.wait(1.0):
        pass
    server.stop()
    engine.close()
    log.info("stopped cleanly")
    return EXIT_OK


def cmd_wal_dump(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        print(f"sluice wal-dump: no such file: {path}", file=sys.stderr)
        return EXIT_FAILURE
    sys.stdout.flush()
    _native.wal_dump(str(path), sys.stdout.fileno())
    return EXIT_OK


def cmd_config_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)
    cfg.to_native()
    print(f"{args.file}: ok ({len(cfg.buckets)} bucket(s): {', '.join(cfg.buckets)})")
    return EXIT_OK


def cmd_config_reference(_args: argparse.Namespace) -> int:
    sys.stdout.write(reference())
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice", description="A replication daemon for key-value changes.")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser(
        "serve",
        help="open the data directory and serve it over the network",
        description="Recover the data directory, serve the memcached binary protocol, and run "
        "until SIGTERM or Ctrl-C; then finish in-flight requests, flush the WAL and exit 0. "
        "Without --config, embedded defaults: 127.0.0.1:11210, data in ./sluice-data, one "
        "bucket 'default' of 64 vbuckets.",
    )
    s.add_argument("--config", metavar="FILE", help="TOML configuration file")
    s.add_argument("--data-dir", metavar="DIR", help="overrides data_dir")
    s.add_argument("--listen", metavar="HOST:PORT", help="overrides listen (default 127.0.0.1:11210)")
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

    d = sub.add_parser(
        "wal-dump",
        help="print a WAL segment or snapshot as JSON lines",
        description="Print the records of a .xlog or .snap file as JSON lines, then a last "
        "line telling how the file ends (eof, no-eof-marker, torn, corrupt) "
        "with its byte offset.",
    )
    d.add_argument("file")
    d.set_defaults(func=cmd_wal_dump)

    c = sub.add_parser("config", help="check a configuration file or print the reference of every key")
    csub = c.add_subparsers(dest="config_command", metavar="ACTION")
    csub.required = True
    cc = csub.add_parser("check", help="validate a TOML file; exit 2 with the key and reason if it is wrong")
    cc.add_argument("file")
    cc.set_defaults(func=cmd_config_check)
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
    except _native.SluiceError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
