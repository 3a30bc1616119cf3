"""The commands' side of a node's admin endpoint: where it is, who the caller is (a user's
password or the node's token), the call itself, and what a refusal or an unreachable node is
told as."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from pathlib import Path

from sluice.options import TOKEN_FILE, load_for
from sluice.probe import mismatch


def admin_address(args: argparse.Namespace, command: str) -> str | None:
    """The admin endpoint's URL base: --admin as given (http:// unless it says https://), else
    admin_listen of the configuration, over HTTPS when the configuration serves it so."""
    admin = args.admin
    if not admin:
        cfg = load_for(args)
        admin = cfg.values["admin_listen"]
        if admin and cfg.values["tls.certificate"] and cfg.values["tls.admin"]:
            admin = f"https://{admin}"
    if not admin:
        print(
            f"sluice {command}: admin_listen is off in the configuration; pass --admin HOST:PORT",
            file=sys.stderr,
        )
    return admin or None


class UsageError(Exception):
    """A command-line mistake found while preparing a command (exit 2)."""


def basic_auth(args: argparse.Namespace) -> str | None:
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


def admin_auth(args: argparse.Namespace) -> str | None:
    """The Authorization header for the node this command changes or reads: --user's password,
    else the bearer token the node keeps in its data directory (--token-file, else admin.token
    in --data-dir or the configuration's data_dir, when that file is there and readable)."""
    basic = basic_auth(args)
    if basic or args.user:
        return basic
    if args.token_file:
        path = Path(args.token_file)
    else:
        path = Path(load_for(args).data_dir) / TOKEN_FILE
    try:
        token = path.read_text().strip()
    except OSError as e:
        if args.token_file:
            raise UsageError(f"--token-file: cannot read {path}: {e.strerror}") from None
        return None
    return f"Bearer {token}" if token else None


def admin_call(
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
    POSTs need (docs/admin.md)."""
    import http.client
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
        try:
            return json.load(r)
        except ValueError:
            # An HTTP server, but not a node's admin endpoint: told as one that cannot be reached.
            raise http.client.HTTPException(f"{method} {path} answered with no JSON") from None


def refusal(e: Exception) -> str:
    """What the node said when it answered with an error, on one line, with a hint for a
    missing login."""
    why = " ".join(e.read().decode(errors="replace").split())
    if len(why) > 300:
        why = why[:300] + "..."
    if e.code == 401:
        why += (
            " (pass --user NAME with the password in SLUICE_PASSWORD or at the prompt, or "
            "--data-dir/--token-file to use the node's admin.token)"
        )
    return why


def not_an_admin_endpoint(admin: str, e: Exception) -> str | None:
    """What answered at `admin` with an HTTP error when it is not a node's admin endpoint
    (another HTTP server), else None. A refused login is the node's own answer."""
    if getattr(e, "code", None) in (401, 403) or admin.startswith("https://"):
        return None
    return mismatch(admin, "admin")


def unreachable(admin: str, e: Exception) -> str:
    """Why the admin endpoint at `admin` gave no answer: what answers there instead (a KV port,
    another front, a port that says nothing, nothing at all), else the reason."""
    why = getattr(e, "reason", e)
    # Over HTTPS the reason (a certificate not trusted, say) is the answer.
    wrong = None if admin.startswith("https://") else mismatch(admin, "admin")
    return wrong or f"cannot reach the admin endpoint at {admin}: {why}"
