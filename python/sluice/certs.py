"""`sluice tls init`: a self-signed CA and a certificate it signs for a node, written as PEM
files beside each other, with the configuration lines that use them. For trying TLS, for a
cluster on a private network, or for a test; a node facing clients it does not control wants a
certificate from the CA those clients already trust."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sluice import _native

# The files written, by what they hold.
CA_CERTIFICATE, CA_KEY, CERTIFICATE, KEY = "ca.pem", "ca-key.pem", "node.pem", "node-key.pem"


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def cmd_tls_init(args: argparse.Namespace) -> int:
    names = args.name or []
    addresses = args.ip or []
    if not names and not addresses:
        names, addresses = ["localhost"], ["127.0.0.1"]
    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        print(f"sluice tls init: {out} is a file; --dir names a directory", file=sys.stderr)
        return 1
    there = [f for f in (CA_CERTIFICATE, CA_KEY, CERTIFICATE, KEY) if (out / f).exists()]
    if there and not args.force:
        print(
            f"sluice tls init: {out / there[0]} exists; --force replaces the files (clients that "
            f"trust the old CA then need the new {CA_CERTIFICATE})",
            file=sys.stderr,
        )
        return 1
    try:
        ca, ca_key, cert, key = _native.tls_issue(names, addresses, years=args.years)
    except ValueError as e:
        print(f"sluice tls init: {e}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    # The keys readable by their owner only, as the node's other secrets.
    _write(out / CA_KEY, ca_key, 0o600)
    _write(out / KEY, key, 0o600)
    _write(out / CA_CERTIFICATE, ca, 0o644)
    _write(out / CERTIFICATE, cert, 0o644)
    print(f"# wrote {out / CA_CERTIFICATE}, {out / CA_KEY}, {out / CERTIFICATE}, {out / KEY}")
    print(f"# for {', '.join([*names, *addresses])}; clients trust {out / CA_CERTIFICATE}")
    print("[tls]")
    print(f'certificate = "{out / CERTIFICATE}"')
    print(f'key = "{out / KEY}"')
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    tls = sub.add_parser("tls", help="certificates for TLS")
    tsub = tls.add_subparsers(dest="tls_command", required=True)
    init = tsub.add_parser(
        "init",
        help="write a self-signed CA and a node certificate it signs, and print the [tls] lines",
        description="Writes ca.pem and ca-key.pem (a CA good for ten years), node.pem (a "
        "certificate for the names and addresses given, signed by the CA) "
        "and node-key.pem into --dir, keys with mode 0600, and prints the [tls] lines to use. "
        "Without --name or --ip: localhost and 127.0.0.1.",
    )
    init.add_argument("--dir", default="tls", help="where the files go (default: ./tls)")
    init.add_argument("--name", action="append", help="a DNS name the node is reached by (repeatable)")
    init.add_argument("--ip", action="append", help="an IP address the node is reached at (repeatable)")
    init.add_argument("--years", type=int, default=2, help="the node certificate's life (default 2)")
    init.add_argument("--force", action="store_true", help="replace files already there")
    init.set_defaults(func=cmd_tls_init)
