"""`sluice wal-dump` on Tarantool's own `.xlog` and `.snap` files, written by a real Tarantool 2.6
(the Debian `tarantool` binary): every row as Tarantool's `xlog` Lua module reads it from the
same file, zstd-compressed blocks and multi-row transactions included; a torn tail and a
damaged block reported after the rows before them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import wal_dump
from tarantool_peer import TARANTOOL, TARANTOOL_MISSING

pytestmark = pytest.mark.skipif(TARANTOOL is None, reason=TARANTOOL_MISSING)

# Writes every kind of row into its WAL, a snapshot, then more rows; exits cleanly (EOF markers).
WRITER = """
box.cfg{listen = 0, work_dir = WORK, log = 'tarantool.log', checkpoint_count = 10}
local users = box.schema.space.create('users', {id = 512,
    format = {{'id', 'unsigned'}, {'name', 'string'}, {'blob', 'any', is_nullable = true}}})
users:create_index('primary', {parts = {'id'}})
local events = box.schema.space.create('events', {id = 513})
events:create_index('primary', {parts = {{1, 'unsigned'}, {2, 'string'}}})
for i = 1, 200 do users:insert{i, 'name' .. i} end
users:replace{1, 'one', string.rep('x', 5000)}  -- a block over 2 KiB: compressed
users:update({2}, {{'=', 2, 'two'}, {'+', 1, 0}, {'!', 3, 'added'}})
users:upsert({3, 'three'}, {{'=', 2, 'drei'}})
users:upsert({300, 'new'}, {{'=', 2, 'unused'}})
users:delete{4}
box.begin()
events:insert{1, 'a', {k = 1}, -5, 2.5, true}
events:insert{1, 'b', nil, 'x'}
users:delete{5}
box.commit()
-- A write a trigger turns into nothing: a NOP row, which has no body.
users:before_replace(function(old, new) if new ~= nil and new[2] == 'skip' then return old end end)
users:replace{6, 'skip'}
box.snapshot()
users:insert{1000, 'after the snapshot'}
os.exit(0)
"""

# Tarantool's own reading of a file: one JSON object per row.
READER = """
local json = require('json')
json.cfg{encode_use_tostring = true}
for _, row in require('xlog').pairs(arg[1]) do print(json.encode(row)) end
os.exit(0)
"""


@pytest.fixture(scope="module")
def tarantool_dir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("tarantool")
    script = work / "writer.lua"
    script.write_text(f"local WORK = {json.dumps(str(work / 'data'))}\n" + WRITER)
    (work / "data").mkdir()
    r = subprocess.run([TARANTOOL, str(script)], cwd=work, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    (work / "reader.lua").write_text(READER)
    return work


def tarantool_rows(work: Path, path: Path) -> list[dict]:
    r = subprocess.run(
        [TARANTOOL, str(work / "reader.lua"), str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def same_rows(ours: list[dict], theirs: list[dict]) -> None:
    """Row for row equal; timestamps to the millisecond (Tarantool's JSON rounds them)."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        a, b = json.loads(json.dumps(a)), json.loads(json.dumps(b))
        ta, tb = a["HEADER"].pop("timestamp", None), b["HEADER"].pop("timestamp", None)
        assert (ta is None) == (tb is None) and (ta is None or abs(ta - tb) < 1e-3), (a, b)
        assert a == b


def test_every_file_reads_as_tarantool_reads_it(tarantool_dir):
    files = sorted((tarantool_dir / "data").glob("*.xlog")) + sorted((tarantool_dir / "data").glob("*.snap"))
    assert {p.suffix for p in files} == {".xlog", ".snap"}
    stored = b"".join(p.read_bytes() for p in files)
    assert b"\xd5\xba\x0b\xba" in stored, "a zstd-compressed block was written"
    kinds = set()
    for path in files:
        lines = wal_dump(path)
        meta, rows, end = lines[0], lines[1:-1], lines[-1]
        assert meta["file"] == ("XLOG" if path.suffix == ".xlog" else "SNAP")
        assert meta["version"] == "0.13" and meta["tarantool"].startswith("2.6")
        # A file is named by the sum of its vclock.
        assert sum(meta["vclock"].values()) == int(path.stem), meta
        assert end == {"end": "eof", "offset": path.stat().st_size - 4}
        same_rows(rows, tarantool_rows(tarantool_dir, path))
        kinds |= {r["HEADER"]["type"] for r in rows}
    assert {"INSERT", "REPLACE", "UPDATE", "UPSERT", "DELETE", "NOP"} <= kinds
    # The transaction: three rows with one transaction id, the last one its commit.
    wal = [r for p in files if p.suffix == ".xlog" for r in wal_dump(p)[1:-1]]
    txn = [r for r in wal if "tsn" in r["HEADER"]]
    assert len(txn) == 3 and len({r["HEADER"]["tsn"] for r in txn}) == 1
    assert [r["HEADER"].get("commit", False) for r in txn] == [False, False, True]
    assert txn[0]["BODY"]["tuple"] == [1, "a", {"k": 1}, -5, 2.5, True]


def first_xlog(tarantool_dir: Path) -> Path:
    return sorted((tarantool_dir / "data").glob("*.xlog"))[0]


def test_a_torn_tail_and_a_damaged_block(tarantool_dir, tmp_path):
    whole = wal_dump(first_xlog(tarantool_dir))
    rows = whole[1:-1]
    # Cut inside the last block: every row before it, then where and why it stopped.
    torn = tmp_path / "torn.xlog"
    data = first_xlog(tarantool_dir).read_bytes()
    torn.write_bytes(data[:-4][:-10])
    lines = wal_dump(torn)
    end = lines[-1]
    assert end["end"] == "torn" and "left in the file" in end["reason"], end
    assert 0 < len(lines) - 2 < len(rows)
    assert lines[1 : len(lines) - 1] == rows[: len(lines) - 2]
    # A flipped byte inside the first block: the CRC names it, nothing of it is printed.
    damaged = tmp_path / "damaged.xlog"
    meta_end = data.index(b"\n\n") + 2
    flipped = bytearray(data)
    flipped[meta_end + 40] ^= 0xFF
    damaged.write_bytes(bytes(flipped))
    lines = wal_dump(damaged)
    assert lines[1:] == [
        {"end": "corrupt", "offset": meta_end, "reason": "the block's CRC does not match its bytes"}
    ]
