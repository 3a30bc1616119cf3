"""A bucket's table, `[buckets.NAME]`: its name and its keys checked."""

from __future__ import annotations

import re
from typing import Any

from sluice.config.keys import BUCKET_KEYS
from sluice.config.values import _fail

_BUCKET_NAME = re.compile(r"[A-Za-z0-9_.%-]{1,100}")


def _bucket(name: str, table: Any) -> dict[str, Any]:
    path = f"buckets.{name}"
    if not _BUCKET_NAME.fullmatch(name):
        raise _fail(path, f"bucket name {name!r} must be 1 to 100 of A-Z a-z 0-9 _ . % -")
    if not isinstance(table, dict):
        raise _fail(path, f"expected a table, got {type(table).__name__}")
    by_name = {k.name: k for k in BUCKET_KEYS}
    out = {k.name: k.default for k in BUCKET_KEYS}
    for key, raw in table.items():
        if key not in by_name:
            raise _fail(f"{path}.{key}", f"unknown key (known: {', '.join(by_name)})")
        out[key] = by_name[key].value(f"{path}.{key}", raw)
    return out
