"""Couchbase's document commands on the wire against a real `sluice serve`: GET_META, item
locks (GET_LOCKED / UNLOCK_KEY), sub-document lookups and mutations single and multi-path,
and GET_REPLICA on a replica node against an active one. Layouts from kv_engine's
BinaryProtocol.md and SubDocument.md."""

from __future__ import annotations

import json
import socket
import struct
import time

from helpers import Node, start_node, wait_converged, write_users_config
from mcbp_wire import (
    DELETE,
    DOC_ADD,
    DOC_MKDOC,
    GET,
    GET_LOCKED,
    GET_META,
    GET_REPLICA,
    HELLO,
    PATH_MKDIR_P,
    PATH_XATTR,
    SET,
    SUBDOC_ARRAY_ADD_UNIQUE,
    SUBDOC_ARRAY_PUSH_LAST,
    SUBDOC_COUNTER,
    SUBDOC_DELETE,
    SUBDOC_DICT_ADD,
    SUBDOC_DICT_UPSERT,
    SUBDOC_EXISTS,
    SUBDOC_GET,
    SUBDOC_GET_COUNT,
    SUBDOC_MULTI_LOOKUP,
    SUBDOC_MULTI_MUTATION,
    SUBDOC_REPLACE,
    SUBDOC_REPLACE_BODY_WITH_XATTR,
    UNLOCK_KEY,
    connect,
    login,
    lookup_results,
    lookup_spec,
    mutation_spec,
    read_response,
    request,
    set_extras,
    subdoc,
)

MUTATION_SEQNO, XERROR, JSON = 0x04, 0x07, 0x0B
KEY_ENOENT, KEY_EEXISTS, EINVAL, NOT_MY_VBUCKET, LOCKED, NOT_LOCKED = 0x01, 0x02, 0x04, 0x07, 0x09, 0x0E
EACCESS, NOT_SUPPORTED, ETMPFAIL = 0x24, 0x83, 0x86
PATH_ENOENT, PATH_MISMATCH, PATH_EINVAL, DOC_NOTJSON, PATH_EEXISTS = 0xC0, 0xC1, 0xC2, 0xC6, 0xC9
INVALID_COMBO, MULTI_PATH_FAILURE, UNKNOWN_VATTR, CANT_MODIFY_VATTR, XATTR_ORDER = (
    0xCB,
    0xCC,
    0xD1,
    0xD2,
    0xD4,
)


def call(s: socket.socket, frame: bytes) -> dict:
    s.sendall(frame)
    return read_response(s)


def hello(s: socket.socket, *features: int) -> None:
    r = call(s, request(HELLO, b"documents-test", b"".join(struct.pack(">H", f) for f in features)))
    assert r["status"] == 0 and len(r["value"]) == 2 * len(features), r


def store(s: socket.socket, key: bytes, value: bytes, flags: int = 0, expiry: int = 0, cas: int = 0) -> dict:
    return call(s, request(SET, key, value, set_extras(flags, expiry), cas=cas))


def get_meta(s: socket.socket, key: bytes) -> dict:
    """GET_META version 2; the reply with its extras unpacked as `meta`."""
    r = call(s, request(GET_META, key, extras=b"\x02"))
    if r["status"] == 0:
        deleted, flags, expiry, rev, datatype = struct.unpack(">IIIQB", r["extras"])
        r["meta"] = {"deleted": deleted, "flags": flags, "expiry": expiry, "rev": rev, "datatype": datatype}
    return r


def test_get_meta_answers_live_items_tombstones_and_missing_keys(server):
    with connect(server) as s:
        w = store(s, b"m", b"v", flags=0xDEADBEEF, expiry=1000)
        r = get_meta(s, b"m")
        assert r["status"] == 0 and r["cas"] == w["cas"] and r["key"] == b"" and r["value"] == b""
        m = r["meta"]
        assert (m["deleted"], m["flags"], m["rev"]) == (0, 0xDEADBEEF, 1)
        assert abs(m["expiry"] - (time.time() + 1000)) < 60, "the expiry is absolute"
        # Version 1 (or no version byte) leaves the datatype out.
        for extras in (b"", b"\x01"):
            r = call(s, request(GET_META, b"m", extras=extras))
            assert r["status"] == 0 and len(r["extras"]) == 20
        d = call(s, request(DELETE, b"m"))
        assert d["status"] == 0
        r = get_meta(s, b"m")
        assert r["status"] == 0 and r["meta"]["deleted"] == 1 and r["meta"]["rev"] == 2
        assert call(s, request(GET_META, b"never"))["status"] == KEY_ENOENT
        assert call(s, request(GET_META, b"m", extras=b"\x02\x00"))["status"] == EINVAL


def test_a_locked_item_takes_only_its_lock_cas_until_unlocked(server):
    with connect(server) as s:
        hello(s, XERROR)
        first = store(s, b"lk", b"v0")
        r = call(s, request(GET_LOCKED, b"lk", extras=struct.pack(">I", 30)))
        lock_cas = r["cas"]
        assert r["status"] == 0 and r["value"] == b"v0" and lock_cas not in (0, first["cas"])
        assert call(s, request(GET, b"lk"))["cas"] == 0xFFFFFFFFFFFFFFFF, "a locked item reads with CAS -1"
        assert store(s, b"lk", b"x")["status"] == LOCKED
        assert store(s, b"lk", b"x", cas=first["cas"])["status"] == LOCKED
        assert call(s, request(DELETE, b"lk"))["status"] == LOCKED
        assert call(s, request(GET_LOCKED, b"lk"))["status"] == LOCKED, "locked already"
        assert call(s, request(UNLOCK_KEY, b"lk", cas=lock_cas + 1))["status"] == LOCKED
        assert call(s, request(UNLOCK_KEY, b"lk", cas=lock_cas))["status"] == 0
        assert call(s, request(UNLOCK_KEY, b"lk", cas=lock_cas))["status"] == NOT_LOCKED
        assert store(s, b"lk", b"v1")["status"] == 0, "unlocked: anyone writes"
        # A write with the lock's CAS gets in and releases the lock.
        lock_cas = call(s, request(GET_LOCKED, b"lk"))["cas"]
        w = store(s, b"lk", b"v2", cas=lock_cas)
        assert w["status"] == 0 and w["cas"] != lock_cas
        assert store(s, b"lk", b"v3")["status"] == 0
        assert call(s, request(GET_LOCKED, b"missing"))["status"] == KEY_ENOENT
        assert call(s, request(UNLOCK_KEY, b"missing", cas=1))["status"] == KEY_ENOENT
    # A text-protocol client sees a locked key as memcached's refusals, not a server error.
    with connect(server) as s:
        lock_cas = call(s, request(GET_LOCKED, b"lk"))["cas"]
        with socket.create_connection((server.host, server.port), timeout=10) as t:
            t.sendall(b"set lk 0 0 1\r\nx\r\ncas lk 0 0 1 %d\r\nx\r\n" % (lock_cas + 1))
            got = b""
            while got.count(b"\r\n") < 2:
                got += t.recv(4096)
            assert got == b"NOT_STORED\r\nEXISTS\r\n"
        assert call(s, request(UNLOCK_KEY, b"lk", cas=lock_cas))["status"] == 0
    # Without XERROR a client gets the statuses it knows, as from Couchbase.
    with connect(server) as s:
        lock_cas = call(s, request(GET_LOCKED, b"lk"))["cas"]
        assert store(s, b"lk", b"x")["status"] == KEY_EEXISTS
        assert call(s, request(GET_LOCKED, b"lk"))["status"] == ETMPFAIL
        assert call(s, request(UNLOCK_KEY, b"lk", cas=lock_cas))["status"] == 0
        assert call(s, request(UNLOCK_KEY, b"lk", cas=lock_cas))["status"] == ETMPFAIL


def test_a_lock_runs_out_after_its_time(server):
    with connect(server) as s:
        hello(s, XERROR)
        store(s, b"short", b"v")
        assert call(s, request(GET_LOCKED, b"short", extras=struct.pack(">I", 1)))["status"] == 0
        assert store(s, b"short", b"x")["status"] == LOCKED
        deadline = time.monotonic() + 10
        while store(s, b"short", b"x")["status"] == LOCKED:
            assert time.monotonic() < deadline, "a 1 s lock still held after 10 s"
            time.sleep(0.1)
        assert call(s, request(GET, b"short"))["value"] == b"x"


DOC = b'{"a":1,"b":[1,2],"c":{"d":"x"}}'


def test_single_path_lookups_and_mutations(server):
    with connect(server) as s:
        hello(s, MUTATION_SEQNO, XERROR, JSON)
        w = store(s, b"doc", DOC, flags=7, expiry=1000)
        expiry = get_meta(s, b"doc")["meta"]["expiry"]
        r = call(s, subdoc(SUBDOC_GET, b"doc", b"c.d"))
        assert (r["status"], r["value"], r["cas"], r["datatype"]) == (0, b'"x"', w["cas"], 0x01)
        assert call(s, subdoc(SUBDOC_EXISTS, b"doc", b"b[-1]"))["status"] == 0
        assert call(s, subdoc(SUBDOC_GET_COUNT, b"doc", b"b"))["value"] == b"2"
        assert call(s, subdoc(SUBDOC_GET, b"doc", b"zz"))["status"] == PATH_ENOENT
        assert call(s, subdoc(SUBDOC_GET, b"doc", b"a.x"))["status"] == PATH_MISMATCH
        r = call(s, subdoc(SUBDOC_GET, b"doc", b"a..b"))
        assert r["status"] == PATH_EINVAL and json.loads(r["value"])["error"]["context"]
        assert call(s, subdoc(SUBDOC_GET, b"nodoc", b"a"))["status"] == KEY_ENOENT

        r = call(s, subdoc(SUBDOC_DICT_ADD, b"doc", b"e", b"5"))
        assert r["status"] == 0 and r["cas"] != w["cas"] and len(r["extras"]) == 16, "a mutation token"
        assert call(s, subdoc(SUBDOC_DICT_ADD, b"doc", b"e", b"6"))["status"] == PATH_EEXISTS
        r = call(s, subdoc(SUBDOC_COUNTER, b"doc", b"a", b"10"))
        assert (r["status"], r["value"]) == (0, b"11")
        assert call(s, subdoc(SUBDOC_ARRAY_PUSH_LAST, b"doc", b"b", b"3"))["status"] == 0
        assert call(s, subdoc(SUBDOC_ARRAY_ADD_UNIQUE, b"doc", b"b", b"3"))["status"] == PATH_EEXISTS
        assert call(s, subdoc(SUBDOC_DELETE, b"doc", b"c"))["status"] == 0
        assert call(s, subdoc(SUBDOC_REPLACE, b"doc", b"a", b'"s"'))["status"] == 0
        assert call(s, subdoc(SUBDOC_DICT_UPSERT, b"doc", b"x.y", b"1"))["status"] == PATH_ENOENT
        assert call(s, subdoc(SUBDOC_DICT_UPSERT, b"doc", b"x.y", b"1", flags=PATH_MKDIR_P))["status"] == 0
        r = call(s, request(GET, b"doc"))
        # Fields keep their order and the flags stay; as in Couchbase, a mutation that gives no
        # expiry leaves the document none (one that gives it sets it).
        assert r["value"] == b'{"a":"s","b":[1,2,3],"e":5,"x":{"y":1}}'
        assert r["extras"] == struct.pack(">I", 7)
        assert expiry != 0 and get_meta(s, b"doc")["meta"]["expiry"] == 0
        # A CAS that is not the document's.
        assert call(s, subdoc(SUBDOC_DICT_UPSERT, b"doc", b"z", b"1", cas=1))["status"] == KEY_EEXISTS
        # MKDOC creates the document; a document that is not JSON is refused.
        r = call(s, subdoc(SUBDOC_DICT_UPSERT, b"new", b"p.q", b"true", doc_flags=DOC_MKDOC))
        assert r["status"] == 0
        assert call(s, request(GET, b"new"))["value"] == b'{"p":{"q":true}}'
        store(s, b"text", b"plain text")
        assert call(s, subdoc(SUBDOC_DICT_UPSERT, b"text", b"a", b"1"))["status"] == DOC_NOTJSON
        # REPLACE_BODY_WITH_XATTR of an attribute the document lacks; of a body path.
        r = call(s, subdoc(SUBDOC_REPLACE_BODY_WITH_XATTR, b"doc", b"x", flags=PATH_XATTR))
        assert r["status"] == PATH_ENOENT
        assert call(s, subdoc(SUBDOC_REPLACE_BODY_WITH_XATTR, b"doc", b"x"))["status"] == EINVAL


def multi_lookup(s: socket.socket, key: bytes, *specs: bytes, doc_flags: int | None = None) -> dict:
    extras = b"" if doc_flags is None else bytes([doc_flags])
    return call(s, request(SUBDOC_MULTI_LOOKUP, key, b"".join(specs), extras))


def multi_mutation(s: socket.socket, key: bytes, *specs: bytes, extras: bytes = b"", cas: int = 0) -> dict:
    return call(s, request(SUBDOC_MULTI_MUTATION, key, b"".join(specs), extras, cas=cas))


def test_multi_lookup_answers_every_spec_and_document_virtual_xattrs(server):
    with connect(server) as s:
        w = store(s, b"doc", DOC, flags=9, expiry=1000)
        r = multi_lookup(
            s,
            b"doc",
            lookup_spec(SUBDOC_GET, b"$document.exptime", PATH_XATTR),
            lookup_spec(SUBDOC_GET, b"$document", PATH_XATTR),
            lookup_spec(SUBDOC_GET, b"meta.user", PATH_XATTR),
            lookup_spec(GET, b""),
            lookup_spec(SUBDOC_GET, b"c"),
            lookup_spec(SUBDOC_EXISTS, b"nope"),
            lookup_spec(SUBDOC_GET_COUNT, b"b"),
        )
        assert r["status"] == MULTI_PATH_FAILURE and r["cas"] == w["cas"]
        results = lookup_results(r["value"])
        assert [st for st, _ in results] == [0, 0, PATH_ENOENT, 0, 0, PATH_ENOENT, 0]
        assert abs(int(results[0][1]) - (time.time() + 1000)) < 60
        vattr = json.loads(results[1][1])
        assert vattr["CAS"] == f"0x{w['cas']:016x}" and vattr["flags"] == 9
        assert vattr["value_bytes"] == len(DOC) and vattr["deleted"] is False
        assert results[3][1] == DOC, "GET with an empty path is the whole document"
        assert json.loads(results[4][1]) == {"d": "x"} and results[6][1] == b"2"
        r = multi_lookup(s, b"doc", lookup_spec(SUBDOC_GET, b"a"))
        assert r["status"] == 0 and lookup_results(r["value"]) == [(0, b"1")]
        r = multi_lookup(s, b"doc", lookup_spec(SUBDOC_GET, b"$nope", PATH_XATTR))
        assert lookup_results(r["value"]) == [(UNKNOWN_VATTR, b"")]
        # Whole-request errors: xattrs after the body, too many specs, a spec cut short,
        # a command that is not a lookup, a missing document.
        r = multi_lookup(
            s, b"doc", lookup_spec(SUBDOC_GET, b"a"), lookup_spec(SUBDOC_GET, b"$document", PATH_XATTR)
        )
        assert r["status"] == XATTR_ORDER
        assert multi_lookup(s, b"doc", *[lookup_spec(SUBDOC_GET, b"a")] * 17)["status"] == INVALID_COMBO
        assert multi_lookup(s, b"doc", lookup_spec(SUBDOC_GET, b"abc")[:-1])["status"] == EINVAL
        assert multi_lookup(s, b"doc", lookup_spec(SUBDOC_DICT_ADD, b"a"))["status"] == INVALID_COMBO
        assert multi_lookup(s, b"nodoc", lookup_spec(SUBDOC_GET, b"a"))["status"] == KEY_ENOENT


def test_multi_mutation_is_all_or_nothing(server):
    with connect(server) as s:
        hello(s, MUTATION_SEQNO)
        w = store(s, b"doc", b'{"a":1}')
        r = multi_mutation(
            s,
            b"doc",
            mutation_spec(SUBDOC_DICT_UPSERT, b"b", b"2"),
            mutation_spec(SUBDOC_COUNTER, b"a", b"5"),
            mutation_spec(SUBDOC_DICT_ADD, b"a", b"3"),
        )
        assert r["status"] == MULTI_PATH_FAILURE and r["value"] == bytes([2]) + struct.pack(
            ">H", PATH_EEXISTS
        )
        after = call(s, request(GET, b"doc"))
        assert (after["value"], after["cas"]) == (b'{"a":1}', w["cas"]), "a failing spec changes nothing"
        r = multi_mutation(
            s,
            b"doc",
            mutation_spec(SUBDOC_DICT_UPSERT, b"b", b"2"),
            mutation_spec(SUBDOC_COUNTER, b"a", b"5"),
            extras=struct.pack(">I", 1000),
        )
        assert r["status"] == 0 and len(r["extras"]) == 16
        assert r["value"] == bytes([1]) + struct.pack(">HI", 0, 1) + b"6", "the counter's result, by index"
        assert call(s, request(GET, b"doc"))["value"] == b'{"a":6,"b":2}'
        assert get_meta(s, b"doc")["meta"]["expiry"] > time.time() + 900
        # Virtual xattrs are read-only.
        r = multi_mutation(s, b"doc", mutation_spec(SUBDOC_DICT_UPSERT, b"$document.x", b"1", PATH_XATTR))
        assert r["status"] == MULTI_PATH_FAILURE and r["value"] == b"\x00" + struct.pack(
            ">H", CANT_MODIFY_VATTR
        )
        # Doc flags: ADD creates only; a whole-document SET; a whole-document delete.
        add = bytes([DOC_ADD])
        assert (
            multi_mutation(s, b"doc", mutation_spec(SUBDOC_DICT_UPSERT, b"c", b"1"), extras=add)["status"]
            == KEY_EEXISTS
        )
        assert (
            multi_mutation(s, b"fresh", mutation_spec(SUBDOC_ARRAY_PUSH_LAST, b"l", b"1"), extras=add)[
                "status"
            ]
            == 0
        )
        assert call(s, request(GET, b"fresh"))["value"] == b'{"l":[1]}'
        r = multi_mutation(
            s, b"fresh", mutation_spec(SET, b"", b'{"z":0}'), mutation_spec(SUBDOC_COUNTER, b"z", b"2")
        )
        assert r["status"] == 0
        assert call(s, request(GET, b"fresh"))["value"] == b'{"z":2}'
        assert multi_mutation(s, b"fresh", mutation_spec(DELETE, b""))["status"] == 0
        assert call(s, request(GET, b"fresh"))["status"] == KEY_ENOENT
        assert (
            multi_mutation(s, b"gone", mutation_spec(SUBDOC_DICT_UPSERT, b"a", b"1"))["status"] == KEY_ENOENT
        )
        # A lock covers sub-document mutations too.
        lock_cas = call(s, request(GET_LOCKED, b"doc"))["cas"]
        assert (
            multi_mutation(s, b"doc", mutation_spec(SUBDOC_DICT_UPSERT, b"c", b"1"))["status"] == KEY_EEXISTS
        )
        r = multi_mutation(s, b"doc", mutation_spec(SUBDOC_DICT_UPSERT, b"c", b"1"), cas=lock_cas)
        assert r["status"] == 0


def test_lookups_need_read_and_mutations_write(tmp_path):
    users = tmp_path / "users.toml"
    write_users_config(users, '["read"]')
    node = Node(tmp_path / "n", "--config", str(users))
    try:
        with connect(node) as s:
            assert login(s, "ada", "ada-secret") == 0
            store(s, b"doc", DOC)
        with connect(node) as s:
            assert login(s, "bob", "bob-secret") == 0
            assert multi_lookup(s, b"doc", lookup_spec(SUBDOC_GET, b"a"))["status"] == 0
            assert get_meta(s, b"doc")["status"] == 0
            assert call(s, subdoc(SUBDOC_DICT_UPSERT, b"doc", b"z", b"1"))["status"] == EACCESS
            assert (
                multi_mutation(s, b"doc", mutation_spec(SUBDOC_DICT_UPSERT, b"z", b"1"))["status"] == EACCESS
            )
            assert call(s, request(GET_LOCKED, b"doc"))["status"] == EACCESS
    finally:
        assert node.stop() == 0


def test_get_replica_is_served_by_a_replica_node_only(tmp_path):
    active = start_node(tmp_path, "a")
    replica = start_node(tmp_path, "r", "--replica-of", active.address)
    try:
        with connect(active) as s:
            store(s, b"rk", b"rv", flags=3)
            assert call(s, request(GET_REPLICA, b"rk"))["status"] == NOT_MY_VBUCKET
        wait_converged(active, replica)
        with connect(replica) as s:
            r = call(s, request(GET_REPLICA, b"rk"))
            assert (r["status"], r["value"], r["key"], r["extras"]) == (0, b"rv", b"rk", struct.pack(">I", 3))
            assert call(s, request(GET_REPLICA, b"nothing"))["status"] == KEY_ENOENT
            assert call(s, request(GET, b"rk"))["status"] == NOT_MY_VBUCKET
    finally:
        assert replica.stop() == 0
        assert active.stop() == 0


def test_sub_document_commands_refuse_documents_over_2_mib(server):
    """A parsed document costs several times its size: past 2 MiB, E2BIG, and the item is
    still read and written whole."""
    big = b'{"a":[' + b",".join([b"1"] * (1100 * 1024)) + b"]}"
    assert len(big) > 2 << 20
    with connect(server) as s:
        assert store(s, b"big", big)["status"] == 0
        r = call(s, subdoc(SUBDOC_GET, b"big", b"a[0]"))
        assert r["status"] == 0x03 and b"2 MiB" in r["value"], r
        assert call(s, subdoc(SUBDOC_DICT_UPSERT, b"big", b"b", b"1"))["status"] == 0x03
        assert call(s, request(GET, b"big"))["value"] == big


def test_a_tap_feed_writes_over_a_lock_and_ends_it(server):
    """Changes fed from another node (a TAP feed) are replicated changes: a client's lock does
    not refuse them, and the item it locked is replaced."""
    from test_permissions import kv_status, tap_command

    with connect(server) as s:
        hello(s, XERROR)
        store(s, b"fed", b"mine")
        assert call(s, request(GET_LOCKED, b"fed", extras=struct.pack(">I", 30)))["status"] == 0
        assert store(s, b"fed", b"x")["status"] == LOCKED
        assert kv_status(s, tap_command(0x41, b"fed", b"theirs")) == 0
        r = call(s, request(GET, b"fed"))
        assert r["value"] == b"theirs" and r["cas"] != 0xFFFFFFFFFFFFFFFF, "the lock ended"
        assert store(s, b"fed", b"mine again")["status"] == 0
        assert call(s, request(GET_LOCKED, b"fed"))["status"] == 0
        assert kv_status(s, tap_command(0x42, b"fed")) == 0  # TAP_DELETE
        assert call(s, request(GET, b"fed"))["status"] == KEY_ENOENT


def test_document_level_errors_are_the_command_s_own(server):
    """A stored body that is not JSON, or nests past Couchbase's 32 levels, fails a
    multi-mutation as a whole (DOC_NOTJSON, DOC_E2DEEP), not as its first spec."""
    doc_e2deep = 0xC4
    with connect(server) as s:
        hello(s, XERROR)
        store(s, b"plain", b"not json")
        r = multi_mutation(s, b"plain", mutation_spec(SUBDOC_DICT_UPSERT, b"a", b"1"))
        assert r["status"] == DOC_NOTJSON, r
        deep = b"[" * 33 + b"]" * 33
        store(s, b"deep", deep)
        assert call(s, subdoc(SUBDOC_GET, b"deep", b"[0]"))["status"] == doc_e2deep
        r = multi_mutation(s, b"deep", mutation_spec(SUBDOC_ARRAY_PUSH_LAST, b"", b"1"))
        assert r["status"] == doc_e2deep, r
        assert call(s, request(GET, b"deep"))["value"] == deep
        store(s, b"deep32", b"[" * 32 + b"]" * 32)
        assert call(s, subdoc(SUBDOC_GET, b"deep32", b"[0]"))["status"] == 0


def test_a_range_scan_on_the_wire(server):
    """RANGE_SCAN_CREATE, _CONTINUE and _CANCEL byte for byte as Couchbase's SDKs read them: the
    16-byte id; continue frames with 4 bytes of extras (1: documents follow), a limit ending in
    RangeScanMore (0xa6) and the end in RangeScanComplete (0xa7), keys in byte order, documents
    as a 25-byte header, LEB128 key and value; an unknown id and a cancelled scan are KEY_ENOENT."""
    import base64

    import sluice

    create, resume, cancel = 0xDA, 0xDB, 0xDC
    vb = 3
    n = len(server.status()["buckets"][0]["vbuckets"])
    keys = sorted(k for k in (f"k{i:04d}".encode() for i in range(2000)) if sluice.vbucket_of(k, n) == vb)[:5]
    with connect(server) as s:
        for i, k in enumerate(keys):
            s.sendall(request(SET, k, b'{"n":%d}' % i, set_extras(flags=0x02000006)))
            assert read_response(s)["status"] == 0
        spec = {
            "range": {"start": base64.b64encode(keys[1]).decode(), "end": base64.b64encode(b"\xff").decode()}
        }
        s.sendall(request(create, value=json.dumps(spec).encode(), vbucket=vb))
        r = read_response(s)
        assert r["status"] == 0 and len(r["value"]) == 16, r
        scan_id = r["value"]

        def next_frames(items: int) -> list[dict]:
            s.sendall(request(resume, extras=scan_id + struct.pack(">III", items, 0, 0), vbucket=vb))
            frames = [read_response(s)]
            while frames[-1]["status"] == 0:
                frames.append(read_response(s))
            return frames

        first = next_frames(2)
        assert [f["status"] for f in first] == [0xA6] and first[0]["extras"] == b"\x00\x00\x00\x01"
        body, docs = first[0]["value"], []
        while body:
            flags, _expiry, seqno, cas, datatype = struct.unpack(">IIQQB", body[:25])
            klen = body[25]
            key = body[26 : 26 + klen]
            vlen = body[26 + klen]
            value = body[27 + klen : 27 + klen + vlen]
            docs.append((key, value, flags, datatype))
            assert seqno > 0 and cas > 0
            body = body[27 + klen + vlen :]
        assert docs == [(keys[1], b'{"n":1}', 0x02000006, 0), (keys[2], b'{"n":2}', 0x02000006, 0)]
        rest = next_frames(0)
        assert rest[-1]["status"] == 0xA7 and b"".join(f["value"] for f in rest).count(b'{"n":') == 2
        s.sendall(request(resume, extras=scan_id + bytes(12), vbucket=vb))
        assert read_response(s)["status"] == 0x01  # gone once complete

        # Keys only; then cancelled before it ends.
        spec = {"range": {"start": "", "excl_end": base64.b64encode(keys[4]).decode()}, "key_only": True}
        s.sendall(request(create, value=json.dumps(spec).encode(), vbucket=vb))
        scan_id = read_response(s)["value"]
        frames = next_frames(3)
        assert frames[-1]["status"] == 0xA6 and frames[-1]["extras"] == bytes(4)
        assert frames[-1]["value"] == b"".join(bytes([len(k)]) + k for k in keys[:3])
        s.sendall(request(cancel, extras=scan_id, vbucket=vb))
        assert read_response(s)["status"] == 0
        s.sendall(request(resume, extras=scan_id + bytes(12), vbucket=vb))
        assert read_response(s)["status"] == 0x01
        # A range with no key in it: KEY_ENOENT at create, which the SDK counts as done.
        spec = {
            "range": {"start": base64.b64encode(b"zz").decode(), "end": base64.b64encode(b"zzz").decode()}
        }
        s.sendall(request(create, value=json.dumps(spec).encode(), vbucket=vb))
        assert read_response(s)["status"] == 0x01


XATTR, DATATYPE_XATTR, DATATYPE_JSON = 0x06, 0x04, 0x01
SUCCESS_DELETED, MULTI_PATH_FAILURE_DELETED, UNKNOWN_MACRO = 0xCD, 0xD3, 0xD0
CAN_ONLY_REVIVE_DELETED, DELETED_CANT_HAVE_VALUE = 0xD6, 0xD7
DOC_ACCESS_DELETED, DOC_CREATE_AS_DELETED, DOC_REVIVE_DOCUMENT = 0x04, 0x08, 0x10
PATH_EXPAND_MACROS = 0x10


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit: what `$document.value_crc32c` is of a body."""
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_extended_attributes_on_the_wire(server):
    """User and system extended attributes beside the body: GET answers the body alone; the
    virtual ones describe it; macros expand to the write's own CAS, seqno and body CRC32C; a
    deletion keeps the system ones; a document created deleted holds attributes only, and
    REPLACE_BODY_WITH_XATTR revives it with one as its body (Couchbase's transactions)."""
    with connect(server) as s:
        r = call(s, request(HELLO, b"xattr-test", struct.pack(">HHHH", MUTATION_SEQNO, JSON, XATTR, 0x17)))
        assert sorted(struct.unpack(">HHHH", r["value"])) == sorted([MUTATION_SEQNO, JSON, XATTR, 0x17])
        store(s, b"doc", b'{"n":1}')
        xa = PATH_XATTR | PATH_MKDIR_P
        macro = xa | PATH_EXPAND_MACROS
        r = multi_mutation(
            s,
            b"doc",
            mutation_spec(SUBDOC_DICT_UPSERT, b"meta.user", b'"ann"', xa),
            mutation_spec(SUBDOC_DICT_UPSERT, b"_sync.rev", b"3", xa),
            mutation_spec(SUBDOC_DICT_UPSERT, b"meta.cas", b'"${Mutation.CAS}"', macro),
            mutation_spec(SUBDOC_DICT_UPSERT, b"meta.seq", b'"${Mutation.seqno}"', macro),
            mutation_spec(SUBDOC_DICT_UPSERT, b"meta.crc", b'"${Mutation.value_crc32c}"', macro),
            mutation_spec(SUBDOC_COUNTER, b"n", b"4"),
        )
        assert r["status"] == 0, r
        cas, (_, seqno) = r["cas"], struct.unpack(">QQ", r["extras"])
        got = call(s, request(GET, b"doc"))
        assert (got["value"], got["datatype"]) == (b'{"n":5}', DATATYPE_JSON), "GET answers the body"
        r = multi_lookup(
            s,
            b"doc",
            lookup_spec(SUBDOC_GET, b"meta", PATH_XATTR),
            lookup_spec(SUBDOC_GET, b"_sync.rev", PATH_XATTR),
            lookup_spec(SUBDOC_GET, b"$XTOC", PATH_XATTR),
            lookup_spec(SUBDOC_GET, b"$document", PATH_XATTR),
            lookup_spec(GET, b""),
        )
        assert r["status"] == 0, r
        meta, rev, xtoc, document, body = (v for _, v in lookup_results(r["value"]))
        meta = json.loads(meta)
        # ${Mutation.CAS} is the CAS in network byte order, as kv_engine writes it.
        assert meta["cas"] == f"0x{int.from_bytes(cas.to_bytes(8, 'little'), 'big'):016x}"
        assert meta["seq"] == f"0x{seqno:016x}"
        document = json.loads(document)
        body_crc = crc32c(b'{"n":5}')
        assert meta["crc"] == document["value_crc32c"] == f"0x{body_crc:08x}"
        assert (meta["user"], rev, json.loads(xtoc)) == ("ann", b"3", ["meta", "_sync"])
        assert document["CAS"] == f"0x{cas:016x}" and document["value_bytes"] == len(body) == 7
        assert "xattr" in document["datatype"]
        r = multi_mutation(s, b"doc", mutation_spec(SUBDOC_DICT_UPSERT, b"m.x", b'"${Nope}"', macro))
        assert r["value"] == b"\x00" + struct.pack(">H", UNKNOWN_MACRO)
        # A whole-document SET keeps the system attributes, not the user ones.
        store(s, b"doc", b'{"n":6}')
        sync = lookup_spec(SUBDOC_GET, b"_sync", PATH_XATTR)
        user = lookup_spec(SUBDOC_GET, b"meta", PATH_XATTR)
        r = multi_lookup(s, b"doc", sync, user)
        assert lookup_results(r["value"]) == [(0, b'{"rev":3}'), (PATH_ENOENT, b"")]
        assert call(s, request(GET, b"doc"))["value"] == b'{"n":6}'
        # A deletion keeps the system attributes only; the tombstone is read with AccessDeleted.
        assert call(s, request(DELETE, b"doc"))["status"] == 0
        assert multi_lookup(s, b"doc", lookup_spec(SUBDOC_GET, b"_sync", PATH_XATTR))["status"] == KEY_ENOENT
        r = multi_lookup(
            s,
            b"doc",
            lookup_spec(SUBDOC_GET, b"_sync", PATH_XATTR),
            lookup_spec(SUBDOC_GET, b"meta", PATH_XATTR),
            doc_flags=DOC_ACCESS_DELETED,
        )
        assert r["status"] == MULTI_PATH_FAILURE_DELETED
        assert lookup_results(r["value"]) == [(0, b'{"rev":3}'), (PATH_ENOENT, b"")]

        # Created deleted, holding a staged body; GET does not see it; ADD finds it.
        staged = b'{"balance":10}'
        create = bytes([DOC_ADD | DOC_ACCESS_DELETED | DOC_CREATE_AS_DELETED])
        stage = mutation_spec(SUBDOC_DICT_UPSERT, b"txn.stgd", staged, xa)
        r = multi_mutation(s, b"new", stage, extras=create)
        assert r["status"] == SUCCESS_DELETED, r
        assert call(s, request(GET, b"new"))["status"] == KEY_ENOENT
        r = multi_mutation(s, b"new", mutation_spec(SUBDOC_DICT_UPSERT, b"txn.x", b"1", xa), extras=create)
        assert r["status"] == KEY_EEXISTS
        # A body for a document that stays deleted is refused; revival of a live one too.
        r = multi_mutation(s, b"new", mutation_spec(SET, b"", b"{}"), extras=bytes([DOC_ACCESS_DELETED]))
        assert r["status"] == DELETED_CANT_HAVE_VALUE
        store(s, b"live", b"{}")
        revive = bytes([DOC_ACCESS_DELETED | DOC_REVIVE_DOCUMENT])
        r = multi_mutation(
            s, b"live", mutation_spec(SUBDOC_REPLACE_BODY_WITH_XATTR, b"txn", b"", PATH_XATTR), extras=revive
        )
        assert r["status"] == CAN_ONLY_REVIVE_DELETED
        # Revived with its staged body, the staging removed: a plain document again.
        r = multi_mutation(
            s,
            b"new",
            mutation_spec(SUBDOC_REPLACE_BODY_WITH_XATTR, b"txn.stgd", b"", PATH_XATTR),
            mutation_spec(SUBDOC_DELETE, b"txn", b"", PATH_XATTR),
            extras=revive,
        )
        assert r["status"] == 0, r
        got = call(s, request(GET, b"new"))
        assert (got["value"], got["datatype"]) == (staged, DATATYPE_JSON)
        assert get_meta(s, b"new")["meta"]["datatype"] == DATATYPE_JSON, "no attributes left"
