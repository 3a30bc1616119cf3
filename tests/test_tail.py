"""`sluice tail`: a bucket's change stream as JSON lines or a table, from the beginning or from
now, chosen vbuckets, resumable from a state file, with backfill progress on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import bmemcached
import pytest
import sluice
from helpers import run_cli
from mcbp_wire import DELETE, PATH_MKDIR_P, PATH_XATTR, SUBDOC_DICT_UPSERT, connect, mutation_spec, request
from test_kv_documents import call, multi_mutation, store


def tail(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_cli("tail", *args, timeout=timeout)


def test_from_the_beginning_then_resume_from_state(server, tmp_path):
    mc = bmemcached.Client([server.address])
    for i in range(20000):
        mc.set(f"t{i}", f"value{i}")
    mc.delete("t7")
    state = tmp_path / "tail.json"
    r = tail("--address", server.address, "--from", "beginning", "--until-now", "--state", str(state))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 20000  # the latest version of each key, t7 as a deletion
    by_key = {row["key"]: row for row in rows}
    assert by_key["t5"]["value"] == "value5" and by_key["t5"]["op"] == "mutation"
    assert by_key["t7"]["op"] == "deletion" and "value" not in by_key["t7"]
    assert "backfill: done, 20,001 seqnos from 64 vbuckets" in r.stderr  # backfill progress
    # Resuming from the state file prints only what changed since.
    mc.set("t1", "again")
    mc.set("new", "key")
    r = tail("--address", server.address, "--until-now", "--state", str(state))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["key"], x["value"]) for x in rows] == sorted(
        [("t1", "again"), ("new", "key")], key=lambda x: sluice.vbucket_of(x[0].encode(), 64)
    )
    r = tail("--address", server.address, "--until-now", "--state", str(state))
    assert r.stdout == ""


def test_table_chosen_vbuckets_and_from_now(server):
    mc = bmemcached.Client([server.address])
    for i in range(300):
        mc.set(f"v{i}", "x")
    r = tail(
        "--address",
        server.address,
        "--from",
        "beginning",
        "--until-now",
        "--vbuckets",
        "0,2-3",
        "--format",
        "table",
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["vbucket", "seqno", "op", "rev", "key"]
    vbs = {int(line.split()[0]) for line in lines[1:]}
    assert vbs == {0, 2, 3}
    expected = sum(1 for i in range(300) if sluice.vbucket_of(f"v{i}".encode(), 64) in (0, 2, 3))
    assert len(lines) - 1 == expected

    # From now: follows only new changes; --max stops it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice", "tail", "--address", server.address, "--max", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Wait until its 64 streams are open on the server.
    deadline = time.monotonic() + 60
    while "sluice_dcp_streams 64" not in server.metrics():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    mc.set("later1", "a")
    mc.set("later2", "b")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert sorted(json.loads(line)["key"] for line in out.splitlines()) == ["later1", "later2"]


def test_usage_and_connection_errors(server):
    r = tail("--address", server.address, "--vbuckets", "0,x")
    assert r.returncode == 2 and "--vbuckets" in r.stderr
    r = tail("--address", "127.0.0.1:1", "--until-now")
    assert r.returncode == 1, r.stderr
    assert "nothing listens at 127.0.0.1:1 (connection refused); expected a memcached port" in r.stderr


def test_tuples_of_a_space_as_json(tmp_path):
    """`--tuples`: the changes of a space written over iproto, each key and tuple as JSON arrays
    (binary as base64, maps as objects); a bucket of plain values is refused with a reason."""
    tarantool = pytest.importorskip("tarantool")
    from iproto_helpers import host_port, start_iproto_node

    node = start_iproto_node(tmp_path, users=False)
    try:
        conn = tarantool.Connection(*host_port(node.iproto))
        conn.insert("users", [1, "ada", 36])
        conn.insert("users", [2, "bob", None])
        conn.update("users", [1], [("+", 2, 1)])
        conn.delete("users", [2])
        conn.insert("pairs", [7, "b", {"k": [1, 2.5]}])
        conn.insert("pairs", [7, "c", b"\x00\xff"])
        conn.close()
        everything = ("--from", "beginning", "--until-now", "--tuples")
        r = tail("--address", node.address, "--bucket", "users", *everything)
        assert r.returncode == 0, r.stderr
        rows = sorted((json.loads(line) for line in r.stdout.splitlines()), key=lambda x: x["key"])
        assert [(x["op"], x["key"], x.get("tuple")) for x in rows] == [
            ("mutation", [1], [1, "ada", 37]),
            ("deletion", [2], None),
        ]
        r = tail("--address", node.address, "--bucket", "pairs", *everything)
        assert r.returncode == 0, r.stderr
        rows = sorted((json.loads(line) for line in r.stdout.splitlines()), key=lambda x: x["key"])
        assert [x["tuple"] for x in rows] == [[7, "b", {"k": [1, 2.5]}], [7, "c", {"base64": "AP8="}]]
        r = tail(
            "--address", node.address, "--bucket", "pairs", "--from", "beginning", "--until-now",
            "--tuples", "--format", "table",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert '[7, "b"]  [7, "b", {"k": [1, 2.5]}]' in r.stdout

        mc = bmemcached.Client([node.address])
        mc.set("plain", "not msgpack")
        r = tail("--address", node.address, "--from", "beginning", "--until-now", "--tuples")
        assert r.returncode == 1
        assert "is not an iproto tuple" in r.stderr and "is 'default' the bucket of a space?" in r.stderr
    finally:
        assert node.stop() == 0, node.log()[-3000:]


def test_extended_attributes_with_xattrs(server):
    """--xattrs prints each document's extended attributes beside its body; a deletion shows
    the system ones its tombstone kept. Without it the value is the body alone."""
    with connect(server) as s:
        for key in (b"tagged", b"gone"):
            store(s, key, b'{"n":1}')
            spec = mutation_spec(SUBDOC_DICT_UPSERT, b"_sync.rev", b"2", PATH_XATTR | PATH_MKDIR_P)
            assert multi_mutation(s, key, spec)["status"] == 0
        assert call(s, request(DELETE, b"gone"))["status"] == 0
    r = tail("--address", server.address, "--from", "beginning", "--until-now", "--xattrs")
    assert r.returncode == 0, r.stderr
    rows = {row["key"]: row for row in map(json.loads, r.stdout.splitlines())}
    assert (rows["tagged"]["value"], rows["tagged"]["xattrs"]) == ('{"n":1}', {"_sync": {"rev": 2}})
    assert rows["gone"]["op"] == "deletion" and rows["gone"]["xattrs"] == {"_sync": {"rev": 2}}
    r = tail("--address", server.address, "--from", "beginning", "--until-now")
    plain = {row["key"]: row for row in map(json.loads, r.stdout.splitlines())}
    assert plain["tagged"]["value"] == '{"n":1}' and "xattrs" not in plain["tagged"]
