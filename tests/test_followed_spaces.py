"""Spaces declared from a followed Tarantool's own schema (`sluice serve --follow-tarantool`
without [spaces.NAME]): `_vspace` and `_vindex` tuples as Tarantool 2.6 returns them, turned
into the [spaces.NAME] tables a config file would hold, and the spaces left out with why."""

from __future__ import annotations

from sluice import Config
from sluice.config import spaces_from_tarantool

ID, NAME = {"name": "id", "type": "unsigned"}, {"name": "name", "type": "string"}
AT, SUM = {"name": "at", "type": "datetime"}, {"name": "sum", "type": "decimal"}
SPACES = [
    [280, 1, "_space", "memtx", 0, {}, [ID]],
    [512, 1, "users", "memtx", 0, {}, [ID, NAME]],
    [513, 1, "ledger", "vinyl", 0, {}, [AT, SUM]],
    [600, 1, "bare", "memtx", 0, {}, []],
    [601, 1, "scratch", "memtx", 0, {"temporary": True}, []],
    [602, 1, "mine", "memtx", 0, {"group_id": 1}, []],
    [603, 1, "noindex", "memtx", 0, {}, []],
    [604, 1, "blobs", "memtx", 0, {}, [{"name": "doc", "type": "map"}]],
    [605, 1, "my-space", "memtx", 0, {}, []],
]
INDEXES = [
    [280, 0, "primary", "tree", {"unique": True}, [[0, "unsigned"]]],
    [512, 0, "primary", "tree", {"unique": True}, [{"field": 0, "type": "unsigned"}]],
    [512, 1, "by_name", "tree", {"unique": False}, [[1, "string"]]],
    [513, 0, "primary", "tree", {"unique": True}, [[1, "str"]]],
    [600, 0, "primary", "tree", {"unique": True}, [[0, "unsigned"], [2, "string"]]],
    [601, 0, "primary", "tree", {"unique": True}, [[0, "unsigned"]]],
    [602, 0, "primary", "tree", {"unique": True}, [[0, "unsigned"]]],
    [604, 0, "primary", "hash", {"unique": True}, [[0, "map"]]],
    [605, 0, "primary", "tree", {"unique": True}, [[0, "unsigned"]]],
]


def test_every_user_space_is_declared_or_left_out_with_its_reason() -> None:
    tables, skipped = spaces_from_tarantool(SPACES, INDEXES, [])
    assert tables["users"] == {
        "id": 512,
        "format": [
            {"name": "id", "type": "unsigned", "is_nullable": False},
            {"name": "name", "type": "string", "is_nullable": False},
        ],
        "primary_key": [1],
    }
    # Types sluice does not check are `any`, but a key part's type (an old name read as the new
    # one) is the key field's.
    assert [f["type"] for f in tables["ledger"]["format"]] == ["any", "string"]
    assert tables["ledger"]["primary_key"] == [2]
    # No format: the key's fields are declared by number, the fields between them as any.
    assert [(f["name"], f["type"]) for f in tables["bare"]["format"]] == [
        ("field1", "unsigned"),
        ("field2", "any"),
        ("field3", "string"),
    ]
    assert tables["bare"]["primary_key"] == [1, 3]
    assert set(tables) == {"users", "ledger", "bare"}
    assert "temporary or local" in skipped["scratch"] and "temporary or local" in skipped["mine"]
    assert skipped["noindex"] == "it has no primary index"
    assert "cannot order by" in skipped["blobs"]
    assert "its name is not one sluice takes" in skipped["my-space"]
    assert "_space" not in tables and "_space" not in skipped


def test_named_spaces_only_and_a_missing_one_is_said() -> None:
    tables, skipped = spaces_from_tarantool(SPACES, INDEXES, ["users", "nosuch"])
    assert set(tables) == {"users"}
    assert skipped == {"nosuch": "no space of this name on the Tarantool (or the user may not see it)"}


def test_declared_spaces_get_buckets_as_a_file_would_give_them() -> None:
    tables, _ = spaces_from_tarantool(SPACES, INDEXES, [])
    cfg = Config.from_dict({"tarantool_upstream": {"address": "127.0.0.1:3301"}})
    assert cfg.spaces_to_learn() == []
    cfg = cfg.with_spaces(tables)
    assert set(cfg.buckets) == {"default", "users", "ledger", "bare"}
    assert cfg.spaces_to_learn() is None
    named = Config.from_dict({"tarantool_upstream": {"address": "127.0.0.1:3301", "spaces": ["users"]}})
    assert named.spaces_to_learn() == ["users"]
    assert Config.from_dict({}).spaces_to_learn() is None
