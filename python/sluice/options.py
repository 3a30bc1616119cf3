"""What every `sluice` command shares: exit codes, the configuration a command runs with (the
file, then its flags), and where a node keeps its admin token."""

from __future__ import annotations

import argparse

from sluice import _native
from sluice.config import (
    ENGINE_KEYS,
    Config,
    load_config,
)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

# The file a running node keeps its admin bearer token in, in its data directory (admin.rs).
TOKEN_FILE = "admin.token"


def load_for(args: argparse.Namespace) -> Config:
    # The file's fronts are placed beside `listen` once the flags are in: `--listen` moves them,
    # and a flag that sets one (or turns it off) keeps it from being placed.
    if args.config:
        cfg = load_config(args.config, place_fronts=False)
    else:
        cfg = Config.from_dict({}, source="<embedded defaults>")
    overrides = {}
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = args.data_dir
    if getattr(args, "force_recovery", False):
        overrides["force_recovery"] = True
    if getattr(args, "admin_listen", None) is not None:
        overrides["admin_listen"] = args.admin_listen
    for front in _native.FRONTS:
        key = front["listen_key"]
        # The KV port always listens: an empty --listen is no override.
        if getattr(args, key, None) is not None and (getattr(args, key) or not front["kv_port"]):
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
    return cfg.with_overrides(**overrides)


def default_of(key: str) -> object:
    """The default of a top-level configuration key, as help texts show it."""
    return next(k.default for k in ENGINE_KEYS if k.name == key)
