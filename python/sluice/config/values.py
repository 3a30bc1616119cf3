"""How one configuration value parses and is checked: sizes, durations, numbers, paths,
addresses, and the `Key` that names a value, its default and its documentation."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sluice._native import ConfigError

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised on older interpreters only
    pass


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


def _names(path: str, v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise _fail(path, f'expected a list of names such as ["accounts"], got {v!r}')
    return list(v)
