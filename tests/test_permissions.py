"""Every command to the permission it needs, as docs/permissions.md tabulates it, on a real
`sluice serve` with users: per row, a user holding every other permission gets EACCESS (0x24)
and nothing on the node changes; a user holding just that permission succeeds. Then what the
replication role guards beyond the table: SEQNO_ACKNOWLEDGED counts only what a replica's
stream was sent, and a move between nodes whose replication user has the role."""

from __future__ import annotations

import re
import struct
import time
from pathlib import Path

import mcbp_wire
import pytest
import sluice
from dcp_wire import (
    FLAG_TAKEOVER,
    MUTATION,
    DcpConnection,
    control,
    open_producer,
    seqno_ack,
    stream_req,
)
from helpers import NUM_VBUCKETS, Node, admin_post, basic_auth, run_cli, start_node
from mcbp_wire import (
    HEADER,
    NOOP,
    connect,
    durability_framing,
    flex_request,
    read_response,
    request,
    set_extras,
)
from tap_wire import DUMP, FLAG_ACK, LIST_VBUCKETS, TAKEOVER_VBUCKETS, connect_frame, vbucket_list

EACCESS = 0x24
PERMISSIONS = ("read", "write", "stream", "admin", "replication")
PASSWORD = "secret"
ROOT = "root"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "permissions.md"


def users_config(users: dict[str, list[str]]) -> str:
    """[users.NAME] tables with the credentials `sluice user hash` prints (SCRAM keys, which PLAIN
    checks too) for PASSWORD, and `perms` on the default bucket."""
    creds = "".join(
        f'{k} = "{v}"\n' for k, v in sluice.config.user_credentials(PASSWORD, iterations=1000).items()
    )
    return "".join(
        f"[users.{name}]\n{creds}" + f"buckets = {{ default = {perms!r} }}\n".replace("'", '"')
        for name, perms in users.items()
    )


def lacking(needed: str) -> list[str]:
    """Every permission but those that would grant `needed` ("read+write": both needed)."""
    parts = needed.split("+")
    # admin stands in for the replication role (docs/permissions.md), and replication implies stream
    grants = {"replication": {"replication", "admin"}, "stream": {"stream", "replication"}}
    if len(parts) > 1:
        return [p for p in PERMISSIONS if p != parts[-1] and p not in grants.get(parts[-1], ())]
    return [p for p in PERMISSIONS if p not in grants.get(needed, {needed})]


def login(s, user: str) -> None:
    assert mcbp_wire.login(s, user, PASSWORD) == 0, user


def kv_status(s, frame: bytes) -> int:
    """The status of `frame`'s reply; 0 for a quiet command that answered nothing."""
    s.sendall(frame + request(NOOP, opaque=0xFEED))
    status = None
    while True:
        r = read_response(s)
        if r["opcode"] == NOOP and r["opaque"] == 0xFEED:
            return 0 if status is None else status
        status = r["status"] if status is None else status


def tap_command(
    opcode: int, key: bytes = b"", value: bytes = b"", engine: bytes = b"", vbucket: int = 0
) -> bytes:
    """A TAP message sent to the node as a command, asking for an ACK."""
    extras = struct.pack(">HHB3x", len(engine), FLAG_ACK, 1)
    if opcode == 0x41:
        extras += struct.pack(">II", 0, 0)
    body = extras + engine + key + value
    return HEADER.pack(0x80, opcode, len(key), len(extras), 0, vbucket, len(body), 0, 0) + body


def tap_connect_status(s, frame: bytes) -> int:
    """TAP_CONNECT has no reply when it works: the first frame is then a TAP message (0x80)."""
    s.sendall(frame)
    head = read_response(s)
    return head["status"] if head["magic"] == 0x81 else 0


def dcp_status(s, first: bytes, then: bytes | None = None) -> int:
    """DCP_OPEN, then a request on the open producer connection (CONTROL, STREAM_REQ)."""
    s.sendall(first)
    r = read_response(s)
    if then is None or r["status"] != 0:
        return r["status"]
    s.sendall(then)
    return read_response(s)["status"]


KEY = b"key"
VB = 3  # the vbucket the TAP and DCP rows move or kill (reset to active before each row)

# (row as docs/permissions.md names it, permission, how to send it and read its status[, the
# status when allowed if not 0])
ROWS = [
    ("GET (0x00)", "read", lambda s: kv_status(s, request(0x00, KEY))),
    ("SET (0x01)", "write", lambda s: kv_status(s, request(0x01, KEY, b"2", set_extras()))),
    ("ADD (0x02)", "write", lambda s: kv_status(s, request(0x02, b"added", b"v", set_extras()))),
    ("REPLACE (0x03)", "write", lambda s: kv_status(s, request(0x03, KEY, b"3", set_extras()))),
    ("DELETE (0x04)", "write", lambda s: kv_status(s, request(0x04, KEY))),
    (
        "INCREMENT (0x05)",
        "write",
        lambda s: kv_status(s, request(0x05, KEY, extras=struct.pack(">QQI", 1, 0, 0))),
    ),
    (
        "DECREMENT (0x06)",
        "write",
        lambda s: kv_status(s, request(0x06, KEY, extras=struct.pack(">QQI", 1, 0, 0))),
    ),
    ("FLUSH (0x08)", "admin", lambda s: kv_status(s, request(0x08))),
    ("GETQ (0x09)", "read", lambda s: kv_status(s, request(0x09, KEY))),
    ("GETK (0x0c)", "read", lambda s: kv_status(s, request(0x0C, KEY))),
    ("GETKQ (0x0d)", "read", lambda s: kv_status(s, request(0x0D, KEY))),
    ("APPEND (0x0e)", "write", lambda s: kv_status(s, request(0x0E, KEY, b"0"))),
    ("PREPEND (0x0f)", "write", lambda s: kv_status(s, request(0x0F, KEY, b"1"))),
    ("STAT (0x10)", "read", lambda s: kv_status(s, request(0x10, b"vbucket-seqno"))),
    ("SETQ (0x11)", "write", lambda s: kv_status(s, request(0x11, KEY, b"2", set_extras()))),
    ("ADDQ (0x12)", "write", lambda s: kv_status(s, request(0x12, b"addedq", b"v", set_extras()))),
    ("REPLACEQ (0x13)", "write", lambda s: kv_status(s, request(0x13, KEY, b"3", set_extras()))),
    ("DELETEQ (0x14)", "write", lambda s: kv_status(s, request(0x14, KEY))),
    (
        "INCREMENTQ (0x15)",
        "write",
        lambda s: kv_status(s, request(0x15, KEY, extras=struct.pack(">QQI", 1, 0, 0))),
    ),
    (
        "DECREMENTQ (0x16)",
        "write",
        lambda s: kv_status(s, request(0x16, KEY, extras=struct.pack(">QQI", 1, 0, 0))),
    ),
    ("FLUSHQ (0x18)", "admin", lambda s: kv_status(s, request(0x18))),
    ("APPENDQ (0x19)", "write", lambda s: kv_status(s, request(0x19, KEY, b"0"))),
    ("PREPENDQ (0x1a)", "write", lambda s: kv_status(s, request(0x1A, KEY, b"1"))),
    ("TOUCH (0x1c)", "write", lambda s: kv_status(s, request(0x1C, KEY, extras=struct.pack(">I", 100)))),
    ("GAT (0x1d)", "read+write", lambda s: kv_status(s, request(0x1D, KEY, extras=struct.pack(">I", 100)))),
    ("GATQ (0x1e)", "read+write", lambda s: kv_status(s, request(0x1E, KEY, extras=struct.pack(">I", 100)))),
    ("TAP_CONNECT (0x40)", "stream", lambda s: tap_connect_status(s, connect_frame(b"", DUMP))),
    (
        "TAP_CONNECT with TAKEOVER_VBUCKETS",
        "replication",
        lambda s: tap_connect_status(
            s, connect_frame(b"", LIST_VBUCKETS | TAKEOVER_VBUCKETS, vbucket_list(VB))
        ),
    ),
    ("TAP_MUTATION (0x41)", "write", lambda s: kv_status(s, tap_command(0x41, b"tapped", b"v"))),
    ("TAP_DELETE (0x42)", "write", lambda s: kv_status(s, tap_command(0x42, KEY))),
    ("TAP_FLUSH (0x43)", "admin", lambda s: kv_status(s, tap_command(0x43))),
    ("TAP_OPAQUE (0x44)", "write", lambda s: kv_status(s, tap_command(0x44, engine=struct.pack(">I", 2)))),
    (
        "TAP_VBUCKET_SET (0x45)",
        "admin",
        lambda s: kv_status(s, tap_command(0x45, engine=struct.pack(">I", 4), vbucket=VB)),
    ),
    ("TAP_CHECKPOINT_START (0x46)", "write", lambda s: kv_status(s, tap_command(0x46, vbucket=VB))),
    ("TAP_CHECKPOINT_END (0x47)", "write", lambda s: kv_status(s, tap_command(0x47, vbucket=VB))),
    ("GET_ALL_VB_SEQNOS (0x48)", "read", lambda s: kv_status(s, request(0x48))),
    ("DCP_OPEN (0x50)", "stream", lambda s: dcp_status(s, open_producer(b"perm"))),
    (
        "DCP_STREAM_REQ (0x53) with the takeover flag",
        "replication",
        lambda s: dcp_status(s, open_producer(b"perm"), stream_req(VB, flags=FLAG_TAKEOVER)),
    ),
    (
        "DCP_CONTROL (0x5e) consumer_name",
        "replication",
        lambda s: dcp_status(s, open_producer(b"perm"), control("consumer_name", "replica-x")),
    ),
    # Allowed, and answered as on any active node: no replica copy here.
    ("GET_REPLICA (0x83)", "read", lambda s: kv_status(s, request(0x83, KEY)), 0x07),
]

# A takeover from a source that is not there: let through, it fails after the permission check
# (test_a_move_works_with_a_replication_user_and_not_without_the_role makes a real one).
ADMIN_ROWS = [
    ("POST /promote", "admin", "/promote"),
    ("POST /takeover", "admin", f"/takeover?vbucket={VB}&source=127.0.0.1:1&timeout=2"),
]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    users = {ROOT: list(PERMISSIONS)}
    for needed in {r[1] for r in ROWS + ADMIN_ROWS}:
        users[f"only_{needed.replace('+', '_')}"] = needed.split("+")
        users[f"lacks_{needed.replace('+', '_')}"] = lacking(needed)
    tmp = tmp_path_factory.mktemp("perms")
    cfg = tmp / "sluice.toml"
    cfg.write_text(users_config(users))
    n = Node(tmp / "d", "--config", str(cfg))
    yield n
    assert n.stop() == 0


def fingerprint(n) -> tuple:
    """What any change shows in: items, and every vbucket's state and high seqno."""
    with connect(n) as s:
        login(s, ROOT)
        s.sendall(request(0x10))
        stats = {}
        while (r := read_response(s))["key"]:
            stats[r["key"]] = r["value"]
        states = []
        for state in (1, 2, 3, 4):
            s.sendall(request(0x48, extras=struct.pack(">I", state)))
            states.append(read_response(s)["value"])
        return stats[b"curr_items"], tuple(states)


def reset(n) -> None:
    """Before each row: the key holds a number and vbucket VB is active."""
    with connect(n) as s:
        login(s, ROOT)
        assert kv_status(s, request(0x01, KEY, b"1", set_extras())) == 0
        assert kv_status(s, tap_command(0x45, engine=struct.pack(">I", 1), vbucket=VB)) == 0


def test_the_table_in_the_docs_is_the_one_tested():
    documented = dict(re.findall(r"^\| (.+?) \| `([a-z+ ]+?)` \|", DOCS.read_text(), re.M))
    tested = {row[0]: row[1] for row in ROWS + ADMIN_ROWS}
    assert documented == tested


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_each_command_needs_its_permission(node, row):
    _, needed, send, *allowed = row
    reset(node)
    before = fingerprint(node)
    with connect(node) as s:
        login(s, f"lacks_{needed.replace('+', '_')}")
        assert send(s) == EACCESS
    time.sleep(0.05)  # anything it set going would show by now
    assert fingerprint(node) == before, "refused, yet something changed"
    with connect(node) as s:
        login(s, f"only_{needed.replace('+', '_')}")
        assert send(s) == (allowed[0] if allowed else 0)


@pytest.mark.parametrize("row", ADMIN_ROWS, ids=[r[0] for r in ADMIN_ROWS])
def test_each_admin_request_needs_its_permission(node, row):
    _, needed, path = row
    code, _, _ = admin_post(node, path, basic_auth(f"lacks_{needed}", PASSWORD))
    assert code == 403
    code, _, body = admin_post(node, path, basic_auth(f"only_{needed}", PASSWORD))
    assert code == 200 if path == "/promote" else code not in (401, 403), (code, body)


@pytest.fixture
def replication_users(tmp_path):
    """A node whose users are `writer` (read, write), `streamer` (stream) and `repl`
    (replication), on 16 vbuckets."""
    users = {"writer": ["read", "write"], "streamer": ["stream"], "repl": ["replication"]}
    n = start_node(tmp_path, "a", extra=users_config(users))
    yield n
    assert n.stop() == 0


def dcp_as(node, user: str, name: bytes) -> DcpConnection:
    return DcpConnection(node.host, node.port, name, login=(user, PASSWORD))


def durable_set(node, key: bytes, timeout_ms: int) -> int:
    """SET at durability majority (frame info 1, level 1, with a timeout) as `writer`."""
    with connect(node) as s:
        s.settimeout(30)
        login(s, "writer")
        s.sendall(flex_request(0x01, durability_framing(1, timeout_ms), key, b"v", set_extras()))
        return read_response(s)["status"]


def ack(c: DcpConnection, vb: int, seqno: int) -> None:
    c.send(seqno_ack(vb, seqno))


def test_only_the_replication_role_registers_a_replica(replication_users):
    node = replication_users
    c = dcp_as(node, "streamer", b"fake")
    assert c.control("consumer_name", "fake-replica") == EACCESS
    assert c.control("enable_sync_writes", "true") == 0
    c.close()
    # Without a replica, majority is impossible: nothing pretends to be one.
    assert durable_set(node, b"k", 1000) == 0xA1  # DURABILITY_IMPOSSIBLE


def test_a_seqno_ack_counts_only_what_its_stream_was_sent(replication_users):
    node = replication_users
    key = b"durable"
    vb = sluice.vbucket_of(key, NUM_VBUCKETS)
    c = dcp_as(node, "repl", b"replica")
    # A stream opened before the connection declared itself a replica counts for nothing.
    other = (vb + 1) % NUM_VBUCKETS
    assert c.call(stream_req(other))["word"] == 0
    assert c.control("consumer_name", "replica-b") == 0
    assert c.control("enable_sync_writes", "true") == 0
    ack(c, other, 1 << 40)
    assert read_response(c.sock)["status"] == 0x04, "EINVAL: not a replica's stream"
    assert c.call(stream_req(vb))["word"] == 0
    # An acknowledgement of 2^40 before anything was sent covers nothing written later (a
    # request answered behind it on the connection shows it was taken before the write)...
    ack(c, vb, 1 << 40)
    assert c.control("set_priority", "high") == 0
    assert durable_set(node, key, 1500) == 0xA3, "SYNC_WRITE_AMBIGUOUS: no replica has it"
    # ... while the same number once the write was sent covers exactly it.
    import threading

    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(durable_set(node, b"durable", 20_000)))
    t.start()
    deadline = time.monotonic() + 20
    sent = 0
    while sent < 2:  # the timed-out write (applied, its durability unknown), then this one
        m = c.next_message(timeout=max(0.1, deadline - time.monotonic()))
        sent += m["op"] == MUTATION
    ack(c, vb, 1 << 40)
    t.join(timeout=20)
    assert result == [0]
    c.close()


def test_a_move_works_with_a_replication_user_and_not_without_the_role(tmp_path):
    h = sluice.config.hash_password("repl-secret", iterations=1000)
    (tmp_path / "repl.pw").write_text("repl-secret\n")
    login_as = f'[replication]\nuser = "repl"\npassword_file = "{tmp_path / "repl.pw"}"\n'
    source_users = users_config({"writer": ["read", "write"]}) + (
        f'[users.repl]\npassword_hash = "{h}"\nbuckets = {{ default = ["replication"] }}\n'
        f'[users.streamer]\npassword_hash = "{h}"\nbuckets = {{ default = ["stream"] }}\n'
    )
    a = start_node(tmp_path, "a", extra=source_users)
    b = start_node(tmp_path, "b", extra=login_as)
    c = start_node(tmp_path, "c", extra=login_as.replace('"repl"', '"streamer"'))
    try:
        keys = [k for k in (f"k{i}".encode() for i in range(500)) if sluice.vbucket_of(k, NUM_VBUCKETS) == 5]
        with connect(a) as s:
            login(s, "writer")
            for k in keys:
                assert kv_status(s, request(0x01, k, b"v", set_extras())) == 0
        refused = run_cli("move-vbucket", "--vb", "5", "--from", a.admin, "--to", c.admin, timeout=60)
        assert refused.returncode != 0
        assert "replication" in refused.stderr + refused.stdout, refused.stderr
        state_a = {v["vbucket"]: v["state"] for v in a.status()["buckets"][0]["vbuckets"]}
        assert state_a[5] == "active", "a refused takeover leaves the source as it was"
        moved = run_cli("move-vbucket", "--vb", "5", "--from", a.admin, "--to", b.admin, timeout=60)
        assert moved.returncode == 0, moved.stderr
        assert f"{len(keys)} changes streamed" in moved.stdout, moved.stdout
        assert {v["vbucket"]: v["state"] for v in b.status()["buckets"][0]["vbuckets"]}[5] == "active"
    finally:
        for n in (c, b, a):
            n.stop()
