"""Greenstack on `greenstack_listen`, from frames built by hand as seed 001 lays them out
(independent of any client): HELLO first, SASL PLAIN, buckets, GET and MUTATION, unknown
commands, quiet, lanes and fences, a durable write's reply overtaken by a GET's on the same
lane, and bad frames closing the connection."""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time

import msgpack
import sluice.config
from helpers import NUM_VBUCKETS, Node, fill_for_a_slow_recovery, node_config, send_without_reading
from mcbp_wire import Scram

# Opcodes, flags, flex keys and statuses (docs/greenstack.md).
HELLO, SASL_AUTH, SELECT_BUCKET, LIST_BUCKETS, MUTATION, GET = 0x0001, 0x0002, 0x0400, 0x0401, 0x0405, 0x0406
DELETE, TOUCH, GET_ALL_VB_SEQNOS, NOTICE = 0x0407, 0x0408, 0x0409, 0x0410
DCP_OPEN, DCP_STREAM_REQUEST, DCP_SNAPSHOT_MARKER, DCP_MUTATION = 0x0500, 0x0501, 0x0502, 0x0503
DCP_DELETION, DCP_STREAM_END, DCP_CLOSE_STREAM, DCP_BUFFER_ACK = 0x0504, 0x0506, 0x0507, 0x0508
RESPONSE, FLEX, FENCE, MORE, QUIET = 0x01, 0x02, 0x04, 0x08, 0x10
LANE_ID, PRIORITY, VBUCKET_ID, IGNORE_UNLESS_EXECUTED_BEFORE = 0x0000, 0x0005, 0x0007, 0x0009
SUCCESS, AUTH_ERROR, INVALID_STATE, NO_ACCESS, NOT_FOUND, UNKNOWN_COMMAND = 0, 3, 6, 7, 8, 9
KEY_EXISTS, INVALID_ARGUMENTS, NOT_EXECUTED_IN_TIME = 0x0400, 0x0001, 0x0408
AUTH_CONTINUE, NOT_INITIALIZED, NOT_MY_VBUCKET, ROLLBACK = 0x000C, 0x0005, 0x0403, 0x0409
ADD, SET, APPEND, PATCH = 0, 1, 3, 5
DURABLE = "persist"


def frame(
    opaque: int,
    opcode: int,
    payload: dict | bytes = b"",
    flags: int = 0,
    lane: bytes | None = None,
    flex: bytes = b"",
) -> bytes:
    """A request; `flex` holds flex header entries besides the lane id."""
    body = struct.pack(">IH", opaque, opcode)
    entries = flex + (struct.pack(">HH", LANE_ID, len(lane)) + lane if lane is not None else b"")
    if entries:
        flags |= FLEX
    body += bytes([flags])
    if entries:
        body += struct.pack(">I", len(entries)) + entries
    body += payload if isinstance(payload, bytes) else msgpack.packb(payload)
    return struct.pack(">I", len(body)) + body


class Reply:
    """A frame from the server: a response (`status`), or a request of its own (a notice)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.opaque, self.opcode, self.flags = struct.unpack_from(">IHB", raw, 0)
        self.status = None
        at, self.lane, self.flex = 7, None, {}
        if self.flags & RESPONSE:
            (self.status,) = struct.unpack_from(">H", raw, 7)
            at = 9
        if self.flags & FLEX:
            (n,) = struct.unpack_from(">I", raw, at)
            flex, at = raw[at + 4 : at + 4 + n], at + 4 + n
            self.flex = {}
            while flex:
                key, length = struct.unpack_from(">HH", flex, 0)
                self.flex[key], flex = flex[4 : 4 + length], flex[4 + length :]
            self.lane = self.flex.get(LANE_ID)
        self.payload = msgpack.unpackb(raw[at:]) if raw[at:] else {}


class Conn:
    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=20)
        self.buf = b""
        self.notices: list[Reply] = []

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def reply(self) -> Reply:
        """The next response; notices on the way are kept in `notices`."""
        while True:
            r = self.next()
            if r.status is not None:
                return r
            self.notices.append(r)

    def next(self) -> Reply:
        while True:
            if len(self.buf) >= 4:
                (n,) = struct.unpack_from(">I", self.buf)
                if len(self.buf) >= 4 + n:
                    raw, self.buf = self.buf[4 : 4 + n], self.buf[4 + n :]
                    return Reply(raw)
            chunk = self.sock.recv(1 << 16)
            assert chunk, "the server closed the connection"
            self.buf += chunk

    def call(self, opcode: int, payload: dict | bytes = b"", **kw) -> Reply:
        self.send(frame(77, opcode, payload, **kw))
        r = self.reply()
        assert (r.opaque, r.opcode) == (77, opcode)
        return r

    def closed(self) -> bool:
        self.sock.settimeout(20)
        try:
            return self.sock.recv(1 << 16) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def start(tmp_path, *users: str, **bucket: object) -> Node:
    cfg = node_config(tmp_path, "a", "".join(users), **bucket)
    return Node(tmp_path / "a", "--config", str(cfg))


def test_hello_login_buckets_and_documents(tmp_path):
    app = sluice.config.hash_password("secret", iterations=1000)
    reader = sluice.config.hash_password("r", iterations=1000)
    users = (
        f'[users.app]\npassword_hash = "{app}"\nbuckets = {{ default = ["read", "write"] }}\n'
        f'[users.reader]\npassword_hash = "{reader}"\nbuckets = {{ default = ["read"] }}\n'
    )
    node = start(tmp_path, users)
    c = Conn(node.greenstack)
    try:
        # Nothing before HELLO.
        assert c.call(GET, {"id": "k"}).status == INVALID_STATE
        hello = c.call(HELLO, {"user_agent": "test", "user_agent_version": "1"})
        assert hello.status == SUCCESS
        assert hello.payload["user_agent"] == "sluice" and "PLAIN" in hello.payload["sasl_mechanisms"]
        # Without a login: no bucket to see or select.
        assert c.call(LIST_BUCKETS).payload == {"buckets": []}
        assert c.call(SELECT_BUCKET, {"name": "default"}).status == NOT_FOUND
        bad = c.call(SASL_AUTH, {"mechanism": "PLAIN", "challenge": b"\x00app\x00wrong"})
        assert bad.status == AUTH_ERROR and "password" in bad.payload["message"]
        assert c.call(SASL_AUTH, {"mechanism": "PLAIN", "challenge": b"\x00app\x00secret"}).status == SUCCESS
        assert c.call(LIST_BUCKETS).payload == {"buckets": ["default"]}
        assert c.call(SELECT_BUCKET, {"name": "default"}).status == SUCCESS
        assert c.call(GET, {"id": "k"}).status == NOT_FOUND
        m = c.call(MUTATION, {"type": SET, "id": "k", "value": b"v1", "flags": 7})
        assert m.status == SUCCESS and m.payload["seqno"] >= 1 and m.payload["cas"] > 0
        assert c.call(MUTATION, {"type": ADD, "id": "k", "value": b"x"}).status == KEY_EXISTS
        assert c.call(MUTATION, {"type": APPEND, "id": "k", "value": b"+"}).status == SUCCESS
        got = c.call(GET, {"id": "k"})
        assert (got.status, got.payload["value"], got.payload["flags"]) == (SUCCESS, b"v1+", 7)
        # A JSON merge patch (RFC 7386) on a JSON document; a clear error on anything else.
        c.call(MUTATION, {"type": SET, "id": "doc", "value": b'{"a":1,"b":{"c":2,"d":3}}', "datatype": 1})
        patch = {"type": PATCH, "id": "doc", "value": b'{"b":{"c":null,"e":4},"f":[1]}'}
        assert c.call(MUTATION, patch).status == SUCCESS
        doc = c.call(GET, {"id": "doc"}).payload
        assert (doc["value"], doc["datatype"]) == (b'{"a":1,"b":{"d":3,"e":4},"f":[1]}', 1)
        not_json = c.call(MUTATION, {"type": PATCH, "id": "k", "value": b"{}"})
        assert not_json.status == INVALID_ARGUMENTS and "not JSON" in not_json.payload["message"]
        assert c.call(MUTATION, {"type": PATCH, "id": "nope", "value": b"{}"}).status == NOT_FOUND
        touched = c.call(TOUCH, {"id": "k", "expiration": 3600})
        assert touched.status == SUCCESS and touched.payload["seqno"] > m.payload["seqno"]
        seqnos = c.call(GET_ALL_VB_SEQNOS).payload["vbuckets"]
        assert max(s for _, s in seqnos) == touched.payload["seqno"]
        assert c.call(GET_ALL_VB_SEQNOS, {"state": "replica"}).payload == {"vbuckets": []}
        assert c.call(DELETE, {"id": "k", "cas": 1}).status == KEY_EXISTS
        assert c.call(DELETE, {"id": "k"}).status == SUCCESS
        assert c.call(GET, {"id": "k"}).status == NOT_FOUND
        assert c.call(DELETE, {"id": "k"}).status == NOT_FOUND
        c.call(MUTATION, {"type": SET, "id": "k", "value": b"v1+", "flags": 7})
        bad_field = c.call(MUTATION, {"type": "set", "id": "k"})
        assert "field 'type'" in bad_field.payload["message"]
        # Unknown commands are answered and the connection goes on; quiet successes are not.
        unknown = c.call(0x0BAD)
        assert unknown.status == UNKNOWN_COMMAND
        c.send(
            frame(1, MUTATION, {"type": SET, "id": "q", "value": b"1"}, flags=QUIET),
            frame(2, GET, {"id": "q"}),
        )
        r = c.reply()
        assert (r.opaque, r.payload["value"]) == (2, b"1")
        # A reader may read, not write.
        r2 = Conn(node.greenstack)
        r2.call(HELLO, {})
        r2.call(SASL_AUTH, {"mechanism": "PLAIN", "challenge": b"\x00reader\x00r"})
        r2.call(SELECT_BUCKET, {"name": "default"})
        assert r2.call(GET, {"id": "k"}).payload["value"] == b"v1+"
        assert r2.call(MUTATION, {"type": SET, "id": "k", "value": b"no"}).status == NO_ACCESS
        r2.close()
        assert node.metric("sluice_greenstack_unknown_commands_total") == 1
    finally:
        c.close()
        node.stop()


def test_lanes_fences_and_a_read_overtaking_a_durable_write(tmp_path):
    node = start(tmp_path)
    c = Conn(node.greenstack)
    try:
        c.call(HELLO, {})
        c.call(SELECT_BUCKET, {"name": "default"})
        c.call(MUTATION, {"type": SET, "id": "fast", "value": b"here"})
        # On one lane: a write that waits for the WAL's sync, then a GET. The GET's reply
        # comes first; the write's follows once it is durable.
        c.send(
            frame(
                10, MUTATION, {"type": SET, "id": "slow", "value": b"1", "durability": "persist"}, lane=b"L"
            ),
            frame(11, GET, {"id": "fast"}, lane=b"L"),
        )
        first, second = c.reply(), c.reply()
        assert (first.opaque, first.lane, first.payload["value"]) == (11, b"L", b"here")
        assert (second.opaque, second.lane, second.status) == (10, b"L", SUCCESS)
        # A fence waits for the lane's earlier requests: the GET fenced behind a durable write
        # answers after it, while another lane is not held up.
        c.send(
            frame(
                20, MUTATION, {"type": SET, "id": "slow", "value": b"2", "durability": "persist"}, lane=b"F"
            ),
            frame(21, GET, {"id": "slow"}, lane=b"F", flags=FENCE),
            frame(22, GET, {"id": "fast"}, lane=b"other"),
        )
        replies = [c.reply() for _ in range(3)]
        assert [r.opaque for r in replies] == [22, 20, 21]
        # The fenced GET saw the write before it.
        assert replies[2].payload["value"] == b"2"
        assert node.metric("sluice_greenstack_out_of_order_replies_total") >= 1
    finally:
        c.close()
        node.stop()


def test_bad_frames_close_the_connection(tmp_path):
    node = start(tmp_path)
    try:
        for bad in (
            frame(1, HELLO, flags=0x20),  # an unassigned flag bit
            frame(1, HELLO, flags=0x80),  # a next flag byte announced, none there
            struct.pack(">I", 3) + b"abc",  # shorter than the smallest frame
            struct.pack(">I", 0x7FFFFFFF),  # longer than the limit
        ):
            c = Conn(node.greenstack)
            c.send(bad)
            assert c.closed(), bad.hex()
            c.close()
        assert node.metric_sum("sluice_protocol_errors_total") >= 4
        # The server carries on.
        c = Conn(node.greenstack)
        assert c.call(HELLO, {}).status == SUCCESS
        c.close()
    finally:
        node.stop()


def test_notices_tell_clients_to_back_off_and_that_the_server_stops(tmp_path):
    node = start(tmp_path, memory_quota=4 << 20)
    c = Conn(node.greenstack)
    try:
        c.call(HELLO, {})
        c.call(SELECT_BUCKET, {"name": "default"})
        # Writes until the bucket is above its high watermark: a back-off notice comes, once a
        # second at most, before the writes are refused.
        value = b"x" * 100_000
        for i in range(200):
            c.call(MUTATION, {"type": SET, "id": f"k{i}", "value": value})
            if c.notices:
                break
        backoff = c.notices[0]
        assert backoff.opcode == NOTICE and not backoff.flags & RESPONSE
        p = backoff.payload
        assert (p["kind"], p["bucket"]) == ("backoff", "default")
        assert p["mem_used"] > p["high_watermark"] and p["delay_ms"] >= 100
        # The client may answer a notice (here: it does not know it); the server carries on.
        c.send(struct.pack(">I", 9) + struct.pack(">IHBH", backoff.opaque, NOTICE, RESPONSE, UNKNOWN_COMMAND))
        assert c.call(GET, {"id": "k0"}).status == SUCCESS
        # Stopping: a shutdown notice, then the connection closes.
        node.proc.send_signal(signal.SIGTERM)
        bye = c.next()
        assert (bye.opcode, bye.payload["kind"]) == (NOTICE, "shutdown")
        assert c.closed()
        assert node.proc.wait(timeout=60) == 0
    finally:
        c.close()
        node.stop()


def test_a_request_that_waits_past_its_ignore_unless_executed_before_is_not_run(tmp_path):
    app = sluice.config.hash_password("secret", iterations=1000)
    # A login whose password hash takes a while to check: what a fence behind it waits for.
    slow = sluice.config.hash_password("slow", iterations=400_000)
    users = (
        f'[users.app]\npassword_hash = "{app}"\nbuckets = {{ default = ["read", "write"] }}\n'
        f'[users.slow]\npassword_hash = "{slow}"\nbuckets = {{ default = ["read"] }}\n'
    )
    node = start(tmp_path, users)
    c = Conn(node.greenstack)
    try:
        c.call(HELLO, {})
        c.call(SASL_AUTH, {"mechanism": "PLAIN", "challenge": b"\x00app\x00secret"})
        c.call(SELECT_BUCKET, {"name": "default"})
        c.call(MUTATION, {"type": SET, "id": "k", "value": b"v"})

        def within(ms: int) -> dict:
            return {"flex": struct.pack(">HHI", IGNORE_UNLESS_EXECUTED_BEFORE, 4, ms)}

        started = time.monotonic()
        c.send(
            frame(1, SASL_AUTH, {"mechanism": "PLAIN", "challenge": b"\x00slow\x00slow"}, lane=b"F"),
            frame(2, GET, {"id": "k"}, lane=b"F", flags=FENCE, **within(1)),
            frame(3, GET, {"id": "k"}, lane=b"F", flags=FENCE, **within(60_000)),
        )
        replies = {r.opaque: r for r in (c.reply(), c.reply(), c.reply())}
        waited = time.monotonic() - started
        assert replies[1].status == SUCCESS
        assert replies[2].status == NOT_EXECUTED_IN_TIME, replies[2].payload
        assert "within 1 ms" in replies[2].payload["message"]
        assert (replies[3].status, replies[3].payload["value"]) == (SUCCESS, b"v")
        assert waited > 0.02, "the login did not take long enough to test this"
        assert node.metric("sluice_greenstack_not_executed_total") == 1
    finally:
        c.close()
        node.stop()


def test_an_admins_connection_is_told_of_failed_logins(tmp_path):
    root = sluice.config.hash_password("root-secret", iterations=1000)
    app = sluice.config.hash_password("secret", iterations=1000)
    users = (
        f'[users.root]\npassword_hash = "{root}"\nbuckets = {{ "*" = ["read", "write", "admin"] }}\n'
        f'[users.app]\npassword_hash = "{app}"\nbuckets = {{ default = ["read", "write"] }}\n'
    )
    node = start(tmp_path, users)
    admin, other, intruder = Conn(node.greenstack), Conn(node.greenstack), Conn(node.greenstack)
    try:
        for c, login in ((admin, b"\x00root\x00root-secret"), (other, b"\x00app\x00secret")):
            c.call(HELLO, {})
            assert c.call(SASL_AUTH, {"mechanism": "PLAIN", "challenge": login}).status == SUCCESS
        intruder.call(HELLO, {})
        bad = intruder.call(SASL_AUTH, {"mechanism": "PLAIN", "challenge": b"\x00app\x00guess"})
        assert bad.status == AUTH_ERROR
        told = admin.next()
        assert (told.opcode, told.payload["kind"]) == (NOTICE, "failed_logins")
        assert (told.payload["user"], told.payload["from"], told.payload["last_minute"]) == (
            "app",
            "127.0.0.1",
            1,
        )
        # Only admins are told: the other connection gets nothing but its own answers.
        assert other.call(LIST_BUCKETS).payload == {"buckets": ["default"]}
        assert other.notices == []
    finally:
        for c in (admin, other, intruder):
            c.close()
        node.stop()


def test_a_failover_tells_connections_the_new_vbucket_map(tmp_path):
    import json

    from helpers import run_cli, start_node

    active = start_node(tmp_path, "a")
    replica = start_node(tmp_path, "r", "--replica-of", active.address)
    c = Conn(replica.greenstack)
    try:
        c.call(HELLO, {})
        assert c.call(SELECT_BUCKET, {"name": "default"}).status == SUCCESS
        active.stop()
        r = run_cli("promote", "--admin", replica.admin)
        assert r.returncode == 0, r.stderr
        told = c.next()
        while told.payload.get("kind") != "map_changed":
            told = c.next()
        assert (told.opcode, told.payload["bucket"]) == (NOTICE, "default")
        config = json.loads(told.payload["config"])
        assert config["name"] == "default" and told.payload["rev"] >= 1
        # Every vbucket is now served by this node: its own entry in the map's server list
        # ("$HOST" is the address the client reached it at, as Couchbase writes it).
        servers = config["vBucketServerMap"]["serverList"]
        me = servers.index(f"$HOST:{replica.port}")
        assert {chain[0] for chain in config["vBucketServerMap"]["vBucketMap"]} == {me}
    finally:
        c.close()
        replica.stop()
        active.stop()


def test_connections_not_logged_in_are_bounded_as_on_the_memcached_port(tmp_path):
    app = sluice.config.hash_password("secret", iterations=1000)
    cfg = tmp_path / "bounded.toml"
    cfg.write_text(
        'login_timeout = "1s"\nmax_unauthenticated_per_ip = 2\n'
        f'[users.app]\npassword_hash = "{app}"\nbuckets = {{ default = ["read", "write"] }}\n'
    )
    node = Node(tmp_path / "a", "--config", str(cfg))
    conns = []
    try:
        member = Conn(node.greenstack)
        conns.append(member)
        member.call(HELLO, {})
        assert member.call(SASL_AUTH, {"mechanism": "PLAIN", "challenge": b"\x00app\x00secret"}).status == 0
        silent = [Conn(node.greenstack) for _ in range(2)]
        conns += silent
        time.sleep(0.2)
        # A third connection not logged in from this address is refused at once.
        third = Conn(node.greenstack)
        conns.append(third)
        assert third.closed()
        # The silent ones are closed at their login deadline; the member is not.
        started = time.monotonic()
        assert all(c.closed() for c in silent)
        assert 0.3 < time.monotonic() - started < 15
        assert member.call(LIST_BUCKETS).payload == {"buckets": ["default"]}
        assert node.metric("sluice_prelogin_closed_total", reason="login_timeout") >= 2
        # One that sends without reading its replies is closed at its deadline too.
        deaf = socket.create_connection((node.host, int(node.greenstack.rsplit(":", 1)[1])), timeout=1.0)
        conns_before = node.metric("sluice_prelogin_closed_total", reason="login_timeout")
        send_without_reading(deaf, frame(1, LIST_BUCKETS, {}) * 20_000)
        deadline = time.monotonic() + 10
        while node.metric("sluice_prelogin_closed_total", reason="login_timeout") == conns_before:
            assert time.monotonic() < deadline, "the connection kept its pre-login slot"
            time.sleep(0.1)
        deaf.close()
    finally:
        for c in conns:
            c.close()
        node.stop()


def test_scram_logins_check_both_signatures(tmp_path):
    creds = sluice.config.user_credentials("ada-secret", iterations=1000)
    users = "[users.ada]\n" + "".join(f'{k} = "{v}"\n' for k, v in creds.items())
    users += 'buckets = { default = ["read"] }\n'
    node = start(tmp_path, users)
    try:
        for mechanism in ("SCRAM-SHA512", "SCRAM-SHA256", "SCRAM-SHA1"):
            c = Conn(node.greenstack)
            hello = c.call(HELLO, {})
            assert mechanism in hello.payload["sasl_mechanisms"]
            scram = Scram(mechanism, "ada", "ada-secret")
            first = c.call(SASL_AUTH, {"mechanism": mechanism, "challenge": scram.first()})
            assert first.status == AUTH_CONTINUE, first.payload
            final = c.call(
                SASL_AUTH, {"mechanism": mechanism, "challenge": scram.final(first.payload["challenge"])}
            )
            # The server proves it holds the keys too.
            assert final.status == SUCCESS and final.payload["challenge"] == scram.expected_signature
            assert c.call(LIST_BUCKETS).payload == {"buckets": ["default"]}
            c.close()
        c = Conn(node.greenstack)
        c.call(HELLO, {})
        # A wrong password fails at the second step, as an unknown user does.
        for user, password in (("ada", "wrong"), ("nobody", "x")):
            scram = Scram("SCRAM-SHA256", user, password)
            first = c.call(SASL_AUTH, {"mechanism": "SCRAM-SHA256", "challenge": scram.first()})
            assert first.status == AUTH_CONTINUE
            final = c.call(
                SASL_AUTH, {"mechanism": "SCRAM-SHA256", "challenge": scram.final(first.payload["challenge"])}
            )
            assert final.status == AUTH_ERROR
        # A client-final message with no exchange under way, and one for another mechanism.
        stray = c.call(SASL_AUTH, {"mechanism": "SCRAM-SHA256", "challenge": b"c=biws,r=x,p=eA=="})
        assert stray.status == AUTH_ERROR and "no SCRAM exchange" in stray.payload["message"]
        scram = Scram("SCRAM-SHA1", "ada", "ada-secret")
        first = c.call(SASL_AUTH, {"mechanism": "SCRAM-SHA1", "challenge": scram.first()})
        other = c.call(
            SASL_AUTH, {"mechanism": "SCRAM-SHA256", "challenge": scram.final(first.payload["challenge"])}
        )
        assert other.status == AUTH_ERROR and "SCRAM-SHA1" in other.payload["message"]
        assert c.call(LIST_BUCKETS).payload == {"buckets": []}
        c.close()
    finally:
        assert node.stop() == 0


def stream_messages(c: Conn, opaque: int) -> list[Reply]:
    """The messages of the stream opened by request `opaque`, up to its STREAM END."""
    got = []
    while True:
        m = c.next()
        assert m.opaque == opaque and m.status is None, (m.opcode, m.status)
        got.append(m)
        if m.opcode == DCP_STREAM_END:
            assert not m.flags & MORE
            return got
        assert m.flags & MORE and m.flags & QUIET


def test_dcp_over_greenstack_streams_snapshots_follows_rolls_back_and_closes(tmp_path):
    node = start(tmp_path, "")
    c, writer = Conn(node.greenstack), Conn(node.greenstack)
    try:
        for conn in (c, writer):
            conn.call(HELLO, {})
            assert conn.call(SELECT_BUCKET, {"name": "default"}).status == SUCCESS
        keys = [
            k for k in (f"doc{i}".encode() for i in range(400)) if sluice.vbucket_of(k, NUM_VBUCKETS) == 3
        ][:5]
        for k in keys:
            assert writer.call(MUTATION, {"type": SET, "id": k, "value": b"v-" + k}).status == SUCCESS
        assert writer.call(DELETE, {"id": keys[0]}).status == SUCCESS
        # Nothing before DCP OPEN.
        assert c.call(DCP_STREAM_REQUEST, {"vbucket": 3}).status == INVALID_STATE
        assert c.call(DCP_OPEN, {"name": "t"}).status == SUCCESS
        assert c.call(DCP_OPEN, {"name": "t"}).status == INVALID_STATE
        c.send(frame(40, DCP_STREAM_REQUEST, {"vbucket": 3, "to_latest": True}))
        ok = c.reply()
        assert (ok.opaque, ok.status) == (40, SUCCESS) and ok.flags & MORE
        [[uuid, at]] = ok.payload["failover_log"]
        assert at == 0
        got = stream_messages(c, 40)
        assert all(m.flex[VBUCKET_ID] == b"\x00\x03" for m in got)
        assert got[0].opcode == DCP_SNAPSHOT_MARKER and got[0].payload["end"] == 6
        docs = got[1:-1]
        # The deleted key's first version was deduplicated away: its tombstone is last.
        assert [(m.opcode, m.payload["key"]) for m in docs] == [(DCP_MUTATION, k) for k in keys[1:]] + [
            (DCP_DELETION, keys[0])
        ]
        assert [m.payload["seqno"] for m in docs] == [2, 3, 4, 5, 6]
        assert docs[0].payload["value"] == b"v-" + keys[1] and docs[0].payload["cas"] > 0
        assert got[-1].payload == {"reason": 0}

        # A uuid the vbucket never had: roll back to 0.
        r = c.call(DCP_STREAM_REQUEST, {"vbucket": 3, "start_seqno": 4, "vbucket_uuid": uuid ^ 1})
        assert r.status == ROLLBACK and r.payload["rollback_seqno"] == 0
        # Following from where it got to: a new write arrives; close ends the stream.
        c.send(frame(41, DCP_STREAM_REQUEST, {"vbucket": 3, "start_seqno": 6, "vbucket_uuid": uuid}))
        assert c.reply().status == SUCCESS
        assert c.call(DCP_STREAM_REQUEST, {"vbucket": 3}).status == KEY_EXISTS
        assert writer.call(MUTATION, {"type": SET, "id": keys[1], "value": b"new"}).status == SUCCESS
        marker, mutation = c.next(), c.next()
        assert marker.opcode == DCP_SNAPSHOT_MARKER and marker.payload["start"] == 7
        assert mutation.payload["seqno"] == 7 and mutation.payload["value"] == b"new"
        c.send(frame(42, DCP_CLOSE_STREAM, {"vbucket": 3}))
        end = c.next()
        assert (end.opaque, end.opcode, end.payload) == (41, DCP_STREAM_END, {"reason": 1})
        closed = c.reply()
        assert (closed.opaque, closed.status) == (42, SUCCESS)
        assert c.call(DCP_CLOSE_STREAM, {"vbucket": 3}).status == NOT_FOUND
        assert c.call(DCP_STREAM_REQUEST, {"vbucket": 999}).status == NOT_MY_VBUCKET
        assert "sluice_greenstack_dcp_streams 0" in node.metrics()
    finally:
        c.close()
        writer.close()
        assert node.stop() == 0


def test_a_greenstack_stream_request_needs_the_stream_permission_as_it_is_now(tmp_path):
    secret = sluice.config.hash_password("s", iterations=1000)

    def users(perms: str) -> str:
        return f'[users.feed]\npassword_hash = "{secret}"\nbuckets = {{ default = {perms} }}\n'

    cfg = node_config(tmp_path, "a", users('["read", "stream"]'))
    node = Node(tmp_path / "a", "--config", str(cfg))
    c = Conn(node.greenstack)
    try:
        c.call(HELLO, {})
        assert c.call(SASL_AUTH, {"mechanism": "PLAIN", "challenge": b"\x00feed\x00s"}).status == SUCCESS
        assert c.call(SELECT_BUCKET, {"name": "default"}).status == SUCCESS
        assert c.call(DCP_OPEN, {"name": "feed"}).status == SUCCESS
        c.send(frame(7, DCP_STREAM_REQUEST, {"vbucket": 3}))
        assert c.reply().status == SUCCESS
        # The permission taken away live: the open connection's next stream is refused.
        node_config(tmp_path, "a", users('["read"]'))
        node.proc.send_signal(signal.SIGHUP)
        node.wait_for("users updated now")
        assert c.call(DCP_STREAM_REQUEST, {"vbucket": 5}).status == NO_ACCESS
    finally:
        c.close()
        assert node.stop() == 0


def test_dcp_over_greenstack_holds_to_the_clients_window(tmp_path):
    node = start(tmp_path, "")
    c = Conn(node.greenstack)
    try:
        c.call(HELLO, {})
        c.call(SELECT_BUCKET, {"name": "default"})
        keys = [
            k for k in (f"w{i}".encode() for i in range(2000)) if sluice.vbucket_of(k, NUM_VBUCKETS) == 5
        ][:60]
        for k in keys:
            assert c.call(MUTATION, {"type": SET, "id": k, "value": b"x" * 100}).status == SUCCESS
        assert c.call(DCP_OPEN, {"name": "w", "buffer_size": 1000}).status == SUCCESS
        c.send(frame(50, DCP_STREAM_REQUEST, {"vbucket": 5, "to_latest": True}))
        assert c.reply().status == SUCCESS
        # Up to the window (one message may overflow it), then nothing until acknowledged.
        got, size = [], 0
        while size < 1000:
            m = c.next()
            got.append(m)
            size += len(m.raw) + 4
        c.sock.settimeout(0.5)
        try:
            more = c.sock.recv(1 << 16)
        except TimeoutError:
            more = b""
        assert more == b"" and c.buf == b""
        c.sock.settimeout(20)
        # Acknowledging everything read lets the rest come, to the stream's end.
        total = len(got)
        while got[-1].opcode != DCP_STREAM_END:
            c.send(frame(0, DCP_BUFFER_ACK, {"bytes": size}, flags=QUIET))
            size = 0
            while size < 1000:
                m = c.next()
                got.append(m)
                size += len(m.raw) + 4
                if m.opcode == DCP_STREAM_END:
                    break
        assert total < len(got)
        assert [m.payload["key"] for m in got if m.opcode == DCP_MUTATION] == keys
    finally:
        c.close()
        assert node.stop() == 0


def test_queued_requests_start_by_priority_then_in_order(tmp_path):
    node = start(tmp_path)
    c = Conn(node.greenstack)
    try:
        c.call(HELLO, {})
        c.call(SELECT_BUCKET, {"name": "default"})
        c.call(MUTATION, {"type": SET, "id": "k", "value": b"v"})

        def get(opaque: int, priority: int | None) -> bytes:
            flex = b"" if priority is None else struct.pack(">HHB", PRIORITY, 1, priority)
            return frame(opaque, GET, {"id": "k"}, lane=b"P", flex=flex)

        # Behind a fenced durable write the GETs queue; once it completes they start lowest
        # priority value first, and in the order read among equals (no priority counts as 128).
        slow = {"type": SET, "id": "w", "value": b"1", "durability": "persist"}
        c.send(
            frame(30, MUTATION, slow, lane=b"P", flags=FENCE),
            get(31, 200),
            get(32, 10),
            get(33, None),
            get(34, 10),
            get(35, 129),
        )
        assert [c.reply().opaque for _ in range(6)] == [30, 32, 34, 33, 35, 31]
    finally:
        c.close()
        node.stop()


def test_clients_connecting_during_warm_up_are_told_when_it_is_done(tmp_path):
    """The Greenstack port opens before the data is recovered: a client says HELLO, is told the
    server is warming up, has its requests answered "not initialized", and is told when warm-up
    is done; then the same connection works, a frame split across the hand-over included."""
    node = start(tmp_path)
    fill_for_a_slow_recovery(node)
    c = Conn(node.greenstack)
    c.call(HELLO, {})
    c.call(SELECT_BUCKET, {"name": "default"})
    assert c.call(MUTATION, {"type": SET, "id": "kept", "value": b"v"}).status == SUCCESS
    c.close()
    assert node.stop() == 0

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    restarted: list[Node] = []
    starting = threading.Thread(
        target=lambda: restarted.append(
            Node(
                tmp_path / "a",
                "--config",
                str(tmp_path / "a.toml"),
                "--greenstack-listen",
                f"127.0.0.1:{port}",
            )
        )
    )
    starting.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                c = Conn(f"127.0.0.1:{port}")
                break
            except OSError:
                assert time.monotonic() < deadline, "the Greenstack port never opened"
                time.sleep(0.005)
        hello = c.call(HELLO, {})
        assert hello.status == SUCCESS
        warming = c.next()
        assert (warming.opcode, warming.payload["kind"]) == (NOTICE, "warming_up")
        assert c.call(SELECT_BUCKET, {"name": "default"}).status == NOT_INITIALIZED
        assert c.call(GET, {"id": "kept"}).status == NOT_INITIALIZED
        # Another client sends and never reads its answers: warm-up still ends without it.
        deaf = socket.create_connection(("127.0.0.1", port), timeout=0.5)
        send_without_reading(deaf, frame(1, GET, {"id": "kept"}) * 10_000, rounds=100)
        # Half a frame now, the rest once warm-up is done.
        select = frame(9, SELECT_BUCKET, {"name": "default"})
        c.send(select[:5])
        done = c.next()
        assert (done.opcode, done.payload["kind"]) == (NOTICE, "warmup_done")
        assert done.payload["warmup_ms"] > 0
        c.send(select[5:])
        assert c.reply().status == SUCCESS
        got = c.call(GET, {"id": "kept"})
        assert (got.status, got.payload["value"]) == (SUCCESS, b"v")
        c.close()
        deaf.close()
        starting.join(60)
        assert restarted, "the node did not start"
        assert restarted[0].greenstack == f"127.0.0.1:{port}"
    finally:
        starting.join(60)
        for n in restarted:
            n.stop()
