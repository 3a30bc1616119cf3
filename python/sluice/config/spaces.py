"""The spaces of `[spaces.NAME]` (Tarantool's tuples, served over iproto) and the topics of
`[topics.NAME]`: their checks, and spaces read from a Tarantool that is followed."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any

from sluice._native import ConfigError
from sluice.config.buckets import _BUCKET_NAME, _bucket
from sluice.config.values import _bool, _fail, _int, _str

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised on older interpreters only
    pass


# Tarantool's field types (those sluice checks; docs/iproto.md).
FIELD_TYPES = (
    "unsigned",
    "integer",
    "number",
    "double",
    "string",
    "varbinary",
    "boolean",
    "scalar",
    "any",
    "array",
    "map",
    "uuid",
)


# Types a TREE index cannot order by (Tarantool refuses them in an index too).
_UNINDEXABLE = ("any", "array", "map")


MIN_SPACE_ID = 512  # below are Tarantool's system spaces


MAX_SPACE_ID = 0x7FFFFFFF  # Tarantool's box.schema.SPACE_MAX


_SPACE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")


_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


# [spaces.NAME]'s keys for the reference and the example: key, type, default, meaning.
SPACE_KEYS = [
    ("id", "integer", "(required)", f"The space's number, {MIN_SPACE_ID} or more, unique."),
    (
        "bucket",
        "string",
        "the space's name",
        "The bucket holding its tuples (key: the MessagePack array of the primary key's parts; "
        "value: the tuple). One space per bucket; a bucket not under [buckets] is created with "
        "the bucket defaults.",
    ),
    (
        "format",
        "list of tables",
        "(required)",
        "The fields in order: { name, type, is_nullable = false }; type is one of "
        + ", ".join(FIELD_TYPES)
        + ".",
    ),
    (
        "primary_key",
        "list",
        "the first field",
        "The primary key's fields, by name or 1-based number; not nullable, not any/array/map.",
    ),
]


SPACE_EXAMPLE = {
    "id": "512",
    "bucket": '"users"',
    "format": '[{ name = "id", type = "unsigned" }, { name = "name", type = "string", is_nullable = true }]',
    "primary_key": '["id"]',
}


def _space(name: str, table: Any) -> dict[str, Any]:
    """[spaces.NAME]: id (512 or more), bucket (default: the space's name), format (a list of
    { name, type, is_nullable }) and primary_key (field names or 1-based numbers; default the
    first field). The primary key's fields in 0-based numbers."""
    path = f"spaces.{name}"
    if not _SPACE_NAME.fullmatch(name):
        raise _fail(path, f"space name {name!r} must be a letter then up to 63 of A-Z a-z 0-9 _")
    if not isinstance(table, dict):
        raise _fail(path, f"expected a table, got {type(table).__name__}")
    known = ("id", "bucket", "format", "primary_key")
    for key in table:
        if key not in known:
            raise _fail(f"{path}.{key}", f"unknown key (known: {', '.join(known)})")
    if "id" not in table:
        raise _fail(f"{path}.id", f"missing: every space needs a number of its own, {MIN_SPACE_ID} or more")
    space_id = _int(f"{path}.id", table["id"])
    if not MIN_SPACE_ID <= space_id <= MAX_SPACE_ID:
        raise _fail(
            f"{path}.id", f"{space_id} is not in {MIN_SPACE_ID}..{MAX_SPACE_ID} (lower ids are system spaces)"
        )
    bucket = _str(f"{path}.bucket", table.get("bucket", name))
    if not _BUCKET_NAME.fullmatch(bucket):
        raise _fail(f"{path}.bucket", f"bucket name {bucket!r} must be 1 to 100 of A-Z a-z 0-9 _ . % -")
    raw_format = table.get("format")
    if not isinstance(raw_format, list) or not raw_format:
        raise _fail(
            f"{path}.format",
            'expected a list of fields such as [{ name = "id", type = "unsigned" }, ...], at least one',
        )
    fields: list[dict[str, Any]] = []
    for i, f in enumerate(raw_format, 1):
        fpath = f"{path}.format[{i}]"
        if not isinstance(f, dict):
            raise _fail(fpath, 'expected a table such as { name = "id", type = "unsigned" }')
        for key in f:
            if key not in ("name", "type", "is_nullable"):
                raise _fail(f"{fpath}.{key}", "unknown key (known: name, type, is_nullable)")
        if "name" not in f:
            raise _fail(f"{fpath}.name", "missing: every field has a name")
        fname = _str(f"{fpath}.name", f["name"])
        if not _FIELD_NAME.fullmatch(fname):
            raise _fail(
                f"{fpath}.name", f"field name {fname!r} must be up to 64 of A-Z a-z 0-9 _, not a digit first"
            )
        if any(g["name"] == fname for g in fields):
            raise _fail(f"{fpath}.name", f"field {fname!r} is declared twice")
        ftype = _str(f"{fpath}.type", f.get("type", "any"))
        if ftype not in FIELD_TYPES:
            raise _fail(f"{fpath}.type", f"{ftype!r} is not one of {', '.join(FIELD_TYPES)}")
        nullable = _bool(f"{fpath}.is_nullable", f.get("is_nullable", False))
        fields.append({"name": fname, "type": ftype, "is_nullable": nullable})
    raw_key = table.get("primary_key", [fields[0]["name"]])
    kpath = f"{path}.primary_key"
    if not isinstance(raw_key, list) or not raw_key:
        raise _fail(kpath, 'expected a list of field names or 1-based field numbers, e.g. ["id"]')
    parts: list[int] = []
    for part in raw_key:
        if isinstance(part, str):
            no = next((i for i, f in enumerate(fields) if f["name"] == part), None)
            if no is None:
                raise _fail(
                    kpath, f"no field {part!r} in format (fields: {', '.join(f['name'] for f in fields)})"
                )
        elif isinstance(part, int) and not isinstance(part, bool):
            if not 1 <= part <= len(fields):
                raise _fail(kpath, f"field number {part} is not in 1..{len(fields)} (numbers are 1-based)")
            no = part - 1
        else:
            raise _fail(kpath, f"expected a field name or a 1-based field number, got {part!r}")
        if no in parts:
            raise _fail(kpath, f"field {fields[no]['name']!r} is in the key twice")
        field = fields[no]
        if field["type"] in _UNINDEXABLE:
            raise _fail(
                kpath,
                f"field {field['name']!r} has type {field['type']!r}, which a primary key cannot order by",
            )
        if field["is_nullable"]:
            raise _fail(kpath, f"field {field['name']!r} is nullable; a primary key's fields cannot be")
        parts.append(no)
    return {"id": space_id, "bucket": bucket, "format": fields, "primary_key": parts}


# Tarantool's older names of field types, and the types sluice has no check for (kept as any).
_TARANTOOL_TYPE_ALIASES = {"num": "unsigned", "str": "string", "int": "integer"}


def spaces_from_tarantool(
    space_rows: list[list[Any]], index_rows: list[list[Any]], wanted: list[str]
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """[spaces.NAME] tables for the spaces of a Tarantool, from its `_vspace` tuples (id, owner,
    name, engine, field count, flags, format) and `_vindex` tuples (space id, index id, name,
    type, options, parts): those named in `wanted`, or every user space when it is empty.
    Returns the tables and, for each space left out, why. Fields past the format that the
    primary key uses are declared as `fieldN` with the key part's type; field types sluice
    does not check (decimal, datetime, ...) are declared `any`."""
    primaries = {row[0]: row[5] for row in index_rows if len(row) > 5 and row[1] == 0}
    tables: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for row in space_rows:
        if len(row) < 7 or not isinstance(row[0], int) or not isinstance(row[2], str):
            continue
        space_id, name, engine, flags, fmt = row[0], row[2], row[3], row[5], row[6]
        if space_id < MIN_SPACE_ID or (wanted and name not in wanted):
            continue
        flags = flags if isinstance(flags, dict) else {}
        if engine not in ("memtx", "vinyl"):
            skipped[name] = f"its engine {engine!r} keeps no rows to replicate"
        elif flags.get("temporary") or flags.get("group_id") == 1:
            skipped[name] = "it is temporary or local on the Tarantool, so its rows are not replicated"
        elif space_id not in primaries:
            skipped[name] = "it has no primary index"
        else:
            try:
                table = _space_from_tarantool(name, space_id, fmt, primaries[space_id])
                _space(name, table)
                tables[name] = table
            except ValueError as e:
                skipped[name] = str(e)
            except (TypeError, KeyError, IndexError) as e:
                skipped[name] = f"its format or primary index is not as Tarantool writes them ({e!r})"
            except ConfigError as e:
                skipped[name] = str(e).removeprefix("invalid config: ")
    for name in wanted:
        if name not in tables and name not in skipped:
            skipped[name] = "no space of this name on the Tarantool (or the user may not see it)"
    return tables, skipped


def _space_from_tarantool(name: str, space_id: int, fmt: Any, parts: Any) -> dict[str, Any]:
    if not _SPACE_NAME.fullmatch(name):
        raise ValueError(f"its name is not one sluice takes ({_SPACE_NAME.pattern})")
    fields: list[dict[str, Any]] = []
    for f in fmt if isinstance(fmt, list) else []:
        ftype = _TARANTOOL_TYPE_ALIASES.get(f.get("type", "any"), f.get("type", "any"))
        fields.append(
            {
                "name": f["name"],
                "type": ftype if ftype in FIELD_TYPES else "any",
                "is_nullable": bool(f.get("is_nullable", False)),
            }
        )
    key: list[int] = []
    for part in parts:
        no, ptype = (part[0], part[1]) if isinstance(part, list) else (part["field"], part.get("type", "any"))
        ptype = _TARANTOOL_TYPE_ALIASES.get(ptype, ptype)
        while len(fields) <= no:
            fields.append({"name": f"field{len(fields) + 1}", "type": "any", "is_nullable": False})
        if fields[no]["type"] == "any":
            fields[no]["type"] = ptype if ptype in FIELD_TYPES else "any"
        key.append(no + 1)
    return {"id": space_id, "format": fields, "primary_key": key}


# [topics.NAME]'s keys for the reference and the example: key, type, default, meaning, example.
TOPIC_KEYS = [
    ("partitions", "integer", "`1`", "How many partitions, 1 to 1024.", "4"),
    (
        "settings",
        "string",
        '`""`',
        "TANK's and Kafka's `key=value` lines: log.segment.bytes, log.index.interval.bytes, "
        "log.retention.bytes, log.retention.ms (or .secs, .hours).",
        '"log.retention.bytes = 1073741824"',
    ),
]


def _topic(name: str, table: Any) -> dict[str, Any]:
    """[topics.NAME]: partitions (1 to 1024, default 1) and settings (TANK's and Kafka's
    `key=value` lines, checked when the topic is created)."""
    path = f"topics.{name}"
    if not name or len(name.encode()) > 255:
        raise _fail(path, "a topic name is 1 to 255 bytes")
    if not isinstance(table, dict):
        raise _fail(path, f"expected a table, got {type(table).__name__}")
    for key in table:
        if key not in ("partitions", "settings"):
            raise _fail(f"{path}.{key}", "unknown key (known: partitions, settings)")
    partitions = _int(f"{path}.partitions", table.get("partitions", 1))
    if not 1 <= partitions <= 1024:
        raise _fail(f"{path}.partitions", f"{partitions} is not in 1..1024")
    return {"partitions": partitions, "settings": _str(f"{path}.settings", table.get("settings", ""))}


def _check_spaces(spaces: Mapping[str, dict[str, Any]], buckets: dict[str, dict[str, Any]]) -> None:
    """Ids and buckets are each a space's own; a space's bucket that is not configured is
    created with the bucket defaults."""
    ids: dict[int, str] = {}
    holders: dict[str, str] = {}
    for name, sp in spaces.items():
        if sp["id"] in ids:
            raise _fail(f"spaces.{name}.id", f"{sp['id']} is the id of space {ids[sp['id']]!r} too")
        ids[sp["id"]] = name
        if sp["bucket"] in holders:
            raise _fail(
                f"spaces.{name}.bucket",
                f"bucket {sp['bucket']!r} holds space {holders[sp['bucket']]!r} already "
                "(one space per bucket)",
            )
        holders[sp["bucket"]] = name
        buckets.setdefault(sp["bucket"], _bucket(sp["bucket"], {}))
