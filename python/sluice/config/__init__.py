"""Configuration: one definition of every key, TOML validation with the key path and the
reason in every error, and the conversion into the engine's native settings object.

A bad value raises ``ConfigError`` naming the key, e.g.
``invalid config: buckets.default.num_vbuckets: 0 is not in 1..1024``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sluice._native import FRONTS, BucketSettings, ConfigError, EngineSettings
from sluice.config.buckets import _bucket
from sluice.config.keys import BUCKET_KEYS, CLUSTER_KEYS, DURABILITY_LEVELS, ENGINE_KEYS, EVICTION_POLICIES
from sluice.config.reference import example_toml, reference
from sluice.config.spaces import (
    FIELD_TYPES,
    SPACE_KEYS,
    TOPIC_KEYS,
    _check_spaces,
    _space,
    _topic,
    spaces_from_tarantool,
)
from sluice.config.users import (
    CREDENTIAL_KEYS,
    DEFAULT_ITERATIONS,
    GUEST,
    PERMISSIONS,
    SCRAM_MECHANISMS,
    _user,
    _user_warnings,
    hash_password,
    user_credentials,
)
from sluice.config.values import (
    Key,
    _fail,
    is_loopback,
    listen_host,
    parse_duration,
    parse_listen,
    parse_size,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on older interpreters only
    import tomli as tomllib

__all__ = [
    "BUCKET_KEYS",
    "CLUSTER_KEYS",
    "CREDENTIAL_KEYS",
    "DEFAULT_ITERATIONS",
    "DURABILITY_LEVELS",
    "ENGINE_KEYS",
    "EVICTION_POLICIES",
    "FIELD_TYPES",
    "GUEST",
    "KV_DEFAULT_PORT",
    "PERMISSIONS",
    "SCRAM_MECHANISMS",
    "SPACE_KEYS",
    "TOPIC_KEYS",
    "Config",
    "Key",
    "example_toml",
    "hash_password",
    "is_loopback",
    "listen_host",
    "load_config",
    "parse_duration",
    "parse_listen",
    "parse_size",
    "reference",
    "spaces_from_tarantool",
    "user_credentials",
]


# The memcached front's default port. A node whose `listen` is on another port places every
# front whose listener it does not set as far from that front's default port as its own `listen`
# is from this one, so that a second node on one machine needs only its own --listen,
# --admin-listen and --data-dir.
_KV_FRONT = next(f for f in FRONTS if f["kv_port"])
KV_DEFAULT_PORT = int(_KV_FRONT["default_listen"].rpartition(":")[2])


def _beside_listen(key: str, default: str, listen: str) -> str:
    """Where the listener `key`, unset, listens beside a node's `listen`: its `default`, or, when
    listen's port is not KV_DEFAULT_PORT, listen's host at the default port shifted by as much
    (port 0, any free port, gives any free port). A port outside 1..65535 fails naming `key`."""
    host, _, port = listen.rpartition(":")
    if int(port) == KV_DEFAULT_PORT:
        return default
    if int(port) == 0:
        return f"{host}:0"
    default_port = int(default.rpartition(":")[2])
    placed = default_port + int(port) - KV_DEFAULT_PORT
    if not 0 < placed <= 65535:
        raise _fail(
            key,
            f"listen {listen} places it at port {placed} ({default_port} + {port} - {KV_DEFAULT_PORT}), "
            f'outside 1..65535; set {key} (--{key.replace("_", "-")} HOST:PORT, or "" to turn it off)',
        )
    return f"{host}:{placed}"


def _place_fronts(values: dict[str, Any], given: frozenset[str]) -> dict[str, Any]:
    """`values` with each front listener that `given` leaves unset placed beside `listen`
    (`_beside_listen`). One set, "" (off) included, stays as set."""
    for front in FRONTS:
        key = front["listen_key"]
        if not front["kv_port"] and key not in given:
            values[key] = _beside_listen(key, front["default_listen"], values[_KV_FRONT["listen_key"]])
    return values


@dataclasses.dataclass(frozen=True)
class Config:
    """A validated configuration. Build it with ``load_config`` or ``Config.from_dict``."""

    values: Mapping[str, Any]
    buckets: Mapping[str, Mapping[str, Any]]
    source: str = "<defaults>"
    users: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    spaces: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    topics: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    #: The keys of `values` the file or a flag sets; the others hold their defaults, or for a
    #: front's listener its place beside `listen` (`_place_fronts`).
    given: frozenset[str] = frozenset()

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], source: str = "<dict>", place_fronts: bool = True) -> Config:
        """The configuration of `doc` (a TOML file's tables). With `place_fronts` False, the
        fronts it leaves unset keep their defaults until `with_overrides` (flags that may set
        `listen` or the fronts) places them."""
        values = {k.name: k.default for k in ENGINE_KEYS}
        by_name = {k.name: k for k in ENGINE_KEYS}
        sections = {k.name.split(".")[0] for k in ENGINE_KEYS if "." in k.name}
        buckets: dict[str, dict[str, Any]] = {}
        users: dict[str, dict[str, Any]] = {}
        spaces: dict[str, dict[str, Any]] = {}
        topics: dict[str, dict[str, Any]] = {}
        given: set[str] = set()
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
                    given.add(path)
            elif top in by_name:
                values[top] = by_name[top].value(top, raw)
                given.add(top)
            else:
                raise _fail(top, "unknown key")
        buckets.setdefault("default", _bucket("default", {}))
        _check_spaces(spaces, buckets)
        for name, u in users.items():
            for b in u["buckets"]:
                if b != "*" and b not in buckets:
                    raise _fail(f"users.{name}.buckets.{b}", f"no bucket {b!r} is configured")
        return cls(
            values=_place_fronts(values, frozenset(given)) if place_fronts else values,
            buckets=buckets,
            source=source,
            users=users,
            spaces=spaces,
            topics=topics,
            given=frozenset(given),
        )

    def with_overrides(self, **overrides: Any) -> Config:
        """A copy with top-level keys replaced (command-line flags), validated the same way."""
        by_name = {k.name: k for k in ENGINE_KEYS}
        values = dict(self.values)
        given = set(self.given)
        for name, raw in overrides.items():
            path = name.replace("__", ".")
            if path not in by_name:
                raise _fail(path, "unknown key")
            values[path] = by_name[path].value(path, str(raw) if isinstance(raw, Path) else raw)
            given.add(path)
        # A front the file does not place follows a `listen` given here.
        return dataclasses.replace(
            self, values=_place_fronts(values, frozenset(given)), given=frozenset(given)
        )

    def fronts_beside_listen(self) -> dict[str, str]:
        """The front listeners placed beside `listen` rather than at their defaults, by key (a
        TLS one too when it serves on "auto"); none when listen is on its default port."""
        listen = self.values[_KV_FRONT["listen_key"]]
        if int(listen.rpartition(":")[2]) == KV_DEFAULT_PORT:
            return {}
        placed = {}
        for f in FRONTS:
            key, tls_key = f["listen_key"], f["tls_listen_key"]
            if not f["kv_port"] and key not in self.given:
                placed[key] = self.values[key]
            if self.values[tls_key] == "auto" and self.values["tls.certificate"]:
                placed[tls_key] = _beside_listen(tls_key, f["default_tls_listen"], listen)
        return placed

    def secret(self, key: str) -> str | None:
        """The password in the file the key names (its last newline dropped); None without one."""
        path = self.values[key]
        if not path:
            return None
        try:
            return Path(path).read_text().rstrip("\n")
        except OSError as e:
            raise _fail(key, f"cannot read {path}: {e.strerror}") from None

    def check_files(self) -> None:
        """What `sluice serve` reads before it starts can be read: the password files, and
        `data_dir` is a directory if it exists. Raises ConfigError naming the key and the
        reason. (The certificates and keys are loaded by the server's own check,
        `_native.check_server_settings`, which `sluice config check` runs too.)"""
        data_dir = Path(self.values["data_dir"])
        # The directory itself, or the first of its parents that exists (it is created below).
        there = next((p for p in (data_dir, *data_dir.parents) if p.exists()), None)
        if there is not None and not there.is_dir():
            where = "" if there == data_dir else f"{data_dir}: "
            raise _fail("data_dir", f"{where}{there} is a file, not a directory")
        for key in ("replication.password_file", "tarantool_upstream.password_file"):
            self.secret(key)
        if self.values["cluster.etcd"]:
            self.secret("cluster.etcd_password_file")

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

    def user_list(self) -> list[tuple[str, dict[str, str], dict[str, list[str]], dict[str, list[str]]]]:
        """The users as `sluice._native.Server` takes them: name, credentials, bucket grants and
        topic grants."""
        return [
            (n, dict(u["credentials"]), dict(u["buckets"]), dict(u["topics"])) for n, u in self.users.items()
        ]

    def warnings(self) -> list[str]:
        """What the configuration allows but will likely not do what its users want, "key: reason"
        each: users without credentials for a SCRAM mechanism (a warning, not an error, so that
        configurations from before SCRAM keep serving PLAIN)."""
        return [w for name, u in self.users.items() if name != GUEST for w in _user_warnings(name, u)]

    def server_settings(self) -> dict[str, Any]:
        """The settings of `sluice._native.Server`, which it takes as JSON (`server_json`) and
        checks once: the server's keys by their native names, the users and spaces, and each
        registered front's listeners by their keys under `listeners` and `tls_listeners` ("" when
        off; a TLS key's "auto" resolved)."""
        plain = {f["listen_key"] for f in FRONTS}
        tls = {f["tls_listen_key"]: f for f in FRONTS}
        out: dict[str, Any] = {"listeners": {}, "tls_listeners": {}}
        for k in ENGINE_KEYS:
            if not k.server or k.plugin:
                continue
            if k.name in plain:
                out["listeners"][k.name] = self.values[k.name]
            elif k.name in tls:
                out["tls_listeners"][k.name] = self.values[k.name]
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
        for key, front in tls.items():
            if out["tls_listeners"][key] == "auto":
                out["tls_listeners"][key] = (
                    _beside_listen(key, front["default_tls_listen"], self.values[_KV_FRONT["listen_key"]])
                    if out["tls_certificate"]
                    else ""
                )
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


def load_config(path: str | Path, place_fronts: bool = True) -> Config:
    """Reads and validates a TOML file. Errors name the file, the key path and the reason.
    `place_fronts` as for `Config.from_dict`."""
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
        return Config.from_dict(doc, source=str(p), place_fronts=place_fronts)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
