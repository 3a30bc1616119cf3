"""sluice following a real Tarantool 2.6 (`[tarantool_upstream]`): a copy of the Tarantool's
spaces is fetched on first start, then every row it writes (inserts, replaces, updates with each
operation, upserts, deletes, a transaction) is applied, so `select` answers the same on both;
kill -9 and a restart resume from the position kept in the WAL (no second copy, no UPDATE
applied twice); a Tarantool that collected the rows after our position is copied again; the
followed spaces are read-only for iproto clients; /status and /metrics show the follower."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import msgpack
import pytest
import tarantool
from fault_proxy import FaultProxy
from helpers import NO_DEFAULT_PORTS, Node, run_cli
from sluice import Client, RollbackError
from tarantool_peer import (
    CDC_PASSWORD,
    PASSWORD,
    TARANTOOL,
    TARANTOOL_MISSING,
    USER,
    TarantoolPeer,
    follower_config,
    start_follower,
)

pytestmark = pytest.mark.skipif(TARANTOOL is None, reason=TARANTOOL_MISSING)

PRELOAD = 2000

# The first test copies a Tarantool of 100k tuples, with ids past every key the writes use.
BIG_PRELOAD, BIG_BASE = 100_000, 1_000_000


def setup_lua(preload: int = PRELOAD, base: int = 0) -> str:
    return f"""
box.cfg{{checkpoint_count = 1}}
box.schema.user.grant('{USER}', 'replication')
local other = box.schema.space.create('other', {{id = 600}})
other:create_index('primary')
box.schema.user.grant('{USER}', 'read,write', 'space', 'other')
box.begin()
for i = {base + 1}, {base + preload} do box.space.users:insert{{i, 'user' .. i, i % 100}} end
for i = 1, 100 do other:insert{{i, 'not followed'}} end
box.commit()
"""


# Every kind of row: inserts, replaces, updates with each operation (in Lua, field numbers are
# 1-based: Tarantool logs them with INDEX_BASE 1), upserts that insert and that update, deletes,
# an UPDATE of a missing key, writes to a space that is not followed, a multi-statement
# transaction.
WRITES = """
local u, e, o = box.space.users, box.space.events, box.space.other
for i = 1, 200 do u:insert{10000 + i, 'n' .. i, i} end
for i = 1, 50 do u:replace{10000 + i, 'r' .. i, i * 2} end
for i = 51, 100 do u:update(10000 + i, {{'+', 3, 5}}) u:update(10000 + i, {{'-', 3, 1}}) end
for i = 101, 120 do
    u:update(10000 + i, {{'&', 3, 6}})
    u:update(10000 + i, {{'|', 3, 1}})
    u:update(10000 + i, {{'^', 3, 3}})
end
for i = 121, 130 do u:update(10000 + i, {{'=', 2, 'eq' .. i}, {'+', 3, 1}}) end
for i = 131, 140 do u:update(10000 + i, {{':', 2, 1, 1, 'S'}}) end
for i = 141, 150 do u:update(10000 + i, {{'!', 4, 'extra'}}) end
for i = 141, 145 do u:update(10000 + i, {{'#', 4, 1}}) end
for i = 1, 50 do u:upsert({20000 + i, 'up', 1}, {{'+', 3, 1}}) end
for i = 1, 25 do u:upsert({20000 + i, 'up', 1}, {{'+', 3, 10}}) end
for i = 151, 170 do u:delete(10000 + i) end
u:update(99999, {{'+', 3, 1}})
for i = 1, 50 do o:replace{i, 'still not followed'} end
box.begin()
for i = 171, 180 do u:update(10000 + i, {{'+', 3, 100}}) end
e:insert{1, 1, 'txn', box.NULL}
e:insert{1, 2, 'txn', 'note'}
box.commit()
"""


@pytest.fixture
def peer(tmp_path):
    with TarantoolPeer(tmp_path / "tarantool", extra_lua=setup_lua()) as p:
        yield p


@pytest.fixture
def big_peer(tmp_path):
    with TarantoolPeer(tmp_path / "tarantool", extra_lua=setup_lua(BIG_PRELOAD, BIG_BASE)) as p:
        yield p


def connect(address: str) -> tarantool.Connection:
    host, _, port = address.rpartition(":")
    return tarantool.connect(host, int(port), user=USER, password=PASSWORD)


def contents(conn: tarantool.Connection) -> dict[str, list]:
    return {name: sorted(conn.select(name).data) for name in ("users", "events")}


def wait_same(peer: TarantoolPeer, node: Node, timeout: float = 60) -> dict[str, list]:
    """Waits until sluice's spaces hold what the Tarantool's do; returns them."""
    theirs_conn, ours_conn = connect(peer.address), connect(node.iproto)
    try:
        deadline = time.monotonic() + timeout
        while True:
            theirs, ours = contents(theirs_conn), contents(ours_conn)
            if theirs == ours:
                return ours
            if time.monotonic() > deadline:
                missing = {k: len(theirs[k]) - len(ours[k]) for k in theirs}
                diff = [(t, o) for t, o in zip(theirs["users"], ours["users"], strict=False) if t != o][:5]
                raise AssertionError(
                    f"sluice differs from the Tarantool after {timeout} s: rows missing {missing}, "
                    f"first differences {diff}\n{node.log()[-3000:]}"
                )
            time.sleep(0.2)
    finally:
        theirs_conn.close()
        ours_conn.close()


def test_copies_then_follows_every_kind_of_row(tmp_path, big_peer):
    peer = big_peer
    node = start_follower(tmp_path, follower_config(tmp_path, peer))
    try:
        first = wait_same(peer, node)
        assert len(first["users"]) == BIG_PRELOAD
        up = connect(peer.address)
        up.eval(WRITES)
        final = wait_same(peer, node)
        by_id = {t[0]: t for t in final["users"]}
        # Spot checks that the comparison covers what the writes did.
        assert by_id[10001] == [10001, "r1", 2]
        assert by_id[10051] == [10051, "n51", 55]
        assert by_id[10131][1] == "S131"
        assert by_id[10141] == [10141, "n141", 141] and by_id[10146][3] == "extra"
        assert by_id[20001][2] == 11 and by_id[20030][2] == 1
        assert 10151 not in by_id and 99999 not in by_id
        assert by_id[10171][2] == 271
        assert final["events"] == [[1, 1, "txn", None], [1, 2, "txn", "note"]]

        # Read-only for iproto clients, as a Tarantool replica is.
        ours = connect(node.iproto)
        with pytest.raises(tarantool.DatabaseError) as refused:
            ours.insert("users", (5, "nope", 1))
        assert refused.value.args[0] == 7, refused.value.args  # ER_READONLY
        ours.close()

        status = node.status()["tarantool_upstream"]
        assert status["state"] == "follow", status
        assert status["stopped_spaces"] == {}, status
        assert status["copies"] == 1
        assert status["rows_skipped"] >= 50  # the rows of `other`
        assert node.metric("sluice_tarantool_upstream_state", state="follow") == 1
        assert node.metric("sluice_tarantool_upstream_rows_total") == 553  # every row of WRITES but `other`'s
        # A DCP consumer of the space's bucket sees the same final states.
        tail = subprocess.run(
            [sys.executable, "-m", "sluice", "tail", "--address", node.address, "--bucket", "users"]
            + ["--from", "beginning", "--until-now", "--tuples", "--user", "cdc", "--password-stdin"],
            input=CDC_PASSWORD,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert tail.returncode == 0, tail.stderr
        streamed = [json.loads(line) for line in tail.stdout.splitlines()]
        live = sorted(r["tuple"] for r in streamed if r.get("tuple") is not None)
        assert live == final["users"]
        shown = run_cli("status", "--admin", node.admin)
        assert shown.returncode == 0, shown.stderr
        assert f"following the Tarantool at {peer.address}: follow;" in shown.stdout, shown.stdout
        # A truncation upstream empties the space here.
        up.eval("box.space.events:truncate() box.space.events:insert{2, 1, 'after', box.NULL}")
        assert wait_same(peer, node)["events"] == [[2, 1, "after", None]]
        # The Tarantool sees an anonymous replica following it.
        anon = up.eval("return box.info.replication_anon()").data[0]
        assert len(anon) == 1, anon
        up.close()
    finally:
        node.stop()


def test_kill9_resumes_from_the_kept_position_without_applying_anything_twice(tmp_path, peer):
    config = follower_config(tmp_path, peer)
    node = start_follower(tmp_path, config)
    up = connect(peer.address)
    try:
        wait_same(peer, node)
        # Increments are not idempotent: applied twice after the restart, they would show.
        for round_ in range(3):
            up.eval("for r = 1, 20 do for i = 1, 100 do box.space.users:update(i, {{'+', 3, 1}}) end end")
            # Transactions of 100 increments each: applied as one group, kept whole or not at all.
            up.eval(
                "for r = 1, 20 do box.begin() "
                "for i = 201, 300 do box.space.users:update(i, {{'+', 3, 3}}) end box.commit() end"
            )
            node.stop(sig=9)
            up.eval("for i = 101, 300 do box.space.users:update(i, {{'+', 3, 7}}) end")
            node = start_follower(tmp_path, config)
            assert "following the Tarantool at" in node.log() and "from vclock" in node.log()
            wait_same(peer, node)
            assert "fetching a copy" not in node.log(), f"round {round_}: a second copy"
            assert node.status()["tarantool_upstream"]["copies"] == 0
    finally:
        up.close()
        node.stop()


class Consumer:
    """What a DCP consumer of the `users` bucket holds: per vbucket, each key's value as
    streamed; a rollback to 0 drops a vbucket's part, as a consumer must."""

    def __init__(self) -> None:
        self.held: dict[int, dict[bytes, bytes]] = {}
        self.rollbacks: list[tuple[int, int]] = []
        self.deletions = 0

    def rolled_back(self, vbucket: int, seqno: int) -> None:
        assert seqno == 0, (vbucket, seqno)
        self.rollbacks.append((vbucket, seqno))
        self.held.pop(vbucket, None)

    def tuples(self) -> list:
        return sorted(msgpack.unpackb(v) for part in self.held.values() for v in part.values())

    def take(self, stream, until, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            for c in stream.poll(0.5) or []:
                if c.op == "mutation":
                    self.held.setdefault(c.vbucket, {})[c.key] = c.value
                else:
                    self.deletions += 1
                    self.held.get(c.vbucket, {}).pop(c.key, None)
            assert time.monotonic() < deadline, f"the consumer holds {len(self.tuples())} tuples"


def test_a_tarantool_that_collected_our_rows_is_copied_again_and_consumers_roll_back(tmp_path, peer):
    """The Tarantool collects the xlogs after sluice's position, once while sluice is cut off
    from it and once while sluice is down. Each time sluice copies it again, and a DCP consumer
    of the space is told to roll back to 0 (its live streams end with ROLLBACK, a saved state is
    answered with a rollback), never shown deletions of rows the Tarantool did not delete."""
    proxy = FaultProxy(peer.address)
    config = follower_config(tmp_path, peer, proxy.address)
    node = start_follower(tmp_path, config)
    up = connect(peer.address)
    consumer = Consumer()
    try:
        wait_same(peer, node)
        client = Client(node.address, bucket="users", username="cdc", password=CDC_PASSWORD)
        with client.stream(format="python", rollback=consumer.rolled_back) as stream:
            consumer.take(stream, lambda: len(consumer.tuples()) == PRELOAD)
            # Cut off: sluice reconnects into a stalled proxy while the Tarantool deletes rows
            # and then, with checkpoint_count = 1, removes the xlogs holding the deletions.
            proxy.stall(3)
            proxy.cut()
            up.eval("for i = 1, 500 do box.space.users:delete(i) end")
            up.eval("box.snapshot() box.space.users:insert{777777, 'after', 1} box.snapshot()")
            final = wait_same(peer, node)
            assert len(final["users"]) == PRELOAD - 500 + 1
            consumer.take(stream, lambda: consumer.tuples() == final["users"])
            saved = stream.state()
        assert "no longer holds the rows after our position" in node.log()
        assert node.status()["tarantool_upstream"]["copies"] == 2
        assert consumer.deletions == 0
        assert consumer.rollbacks, "no rollback reached the consumer"
        node.stop()

        # Down: the same while sluice is stopped.
        up.eval("for i = 501, 600 do box.space.users:delete(i) end")
        up.eval("box.snapshot() box.space.users:insert{888888, 'after', 2} box.snapshot()")
        node = start_follower(tmp_path, config)
        final = wait_same(peer, node)
        assert len(final["users"]) == PRELOAD - 600 + 2
        assert node.status()["tarantool_upstream"]["copies"] == 1
        client = Client(node.address, bucket="users", username="cdc", password=CDC_PASSWORD)
        with pytest.raises(RollbackError) as told:
            with client.stream(format="python", state=saved) as stream:
                consumer.take(stream, lambda: False, timeout=30)
        assert told.value.seqno == 0
        # Rolled back and resumed, the consumer holds what the Tarantool holds.
        consumer.held.clear()
        with client.stream(format="python", rollback="resume", state=saved) as stream:
            consumer.take(stream, lambda: consumer.tuples() == final["users"])
        assert consumer.deletions == 0
    finally:
        up.close()
        node.stop()
        proxy.close()


def test_serve_follows_a_tarantool_given_on_the_command_line_alone(tmp_path, peer):
    """No config: `--follow-tarantool` declares the followed spaces from the Tarantool's own
    schema, the one without a format (`other`) by its primary key, and follows them."""
    secret = tmp_path / "tarantool.password"
    secret.write_text(PASSWORD + "\n")
    login = ["--follow-tarantool", peer.address, "--follow-tarantool-user", USER]
    login += ["--follow-tarantool-password-file", str(secret)]
    node = Node(tmp_path / "data", *login)
    up = connect(peer.address)
    try:
        # The follower may log it before the node's ready line, which Node waited for.
        if not any("following the Tarantool at" in line for line in node.lines):
            node.wait_for("following the Tarantool at")
        assert "following the Tarantool's space 'users' (id 512): id unsigned, name string" in node.log()
        assert "following the Tarantool's space 'other' (id 600): field1 unsigned" in node.log()
        up.eval("box.space.other:replace{7, 'changed', {1, 2}} box.space.users:delete(3)")
        wait_same(peer, node)
        ours = connect(node.iproto)
        try:
            deadline = time.monotonic() + 30
            while sorted(ours.select("other").data) != sorted(up.select("other").data):
                assert time.monotonic() < deadline, "space other differs"
                time.sleep(0.2)
        finally:
            ours.close()
    finally:
        up.close()
        node.stop()
    # A space named that the Tarantool does not have: the key and the reason, before serving.
    refused = run_cli(
        "serve",
        "--data-dir",
        str(tmp_path / "data2"),
        *login,
        "--follow-spaces",
        "users,nosuch",
        *NO_DEFAULT_PORTS,
    )
    assert refused.returncode == 2, refused.stderr  # a bad config, as for any other key
    assert "tarantool_upstream.spaces: space 'nosuch': no space of this name" in refused.stderr


def test_connections_cut_under_a_writer_are_resumed(tmp_path, peer):
    proxy = FaultProxy(peer.address)
    node = start_follower(tmp_path, follower_config(tmp_path, peer, proxy.address))
    up = connect(peer.address)
    try:
        wait_same(peer, node)
        for _ in range(3):
            up.eval("for i = 1, 300 do box.space.users:update(i, {{'+', 3, 1}}) end")
            proxy.cut()
            up.eval("for i = 301, 600 do box.space.users:update(i, {{'+', 3, 2}}) end")
            wait_same(peer, node)
        status = node.status()["tarantool_upstream"]
        assert status["reconnects"] >= 3, status
        assert status["copies"] == 1, status
        assert status["state"] == "follow", status
    finally:
        up.close()
        node.stop()
        proxy.close()


def test_a_registered_replica_joins_and_resumes_after_kill9(tmp_path, peer):
    """anonymous = false: JOIN registers sluice in the Tarantool's _cluster, and it resumes by a
    registered SUBSCRIBE."""
    config = follower_config(tmp_path, peer)
    with config.open("a") as f:
        f.write("anonymous = false\n")  # [tarantool_upstream] is the file's last table
    node = start_follower(tmp_path, config)
    up = connect(peer.address)
    try:
        assert len(wait_same(peer, node)["users"]) == PRELOAD
        assert len(up.eval("return box.space._cluster:select()").data[0]) == 2
        up.eval("for i = 1, 100 do box.space.users:update(i, {{'+', 3, 1}}) end")
        node.stop(sig=9)
        up.eval("for i = 1, 100 do box.space.users:update(i, {{'+', 3, 1}}) end")
        node = start_follower(tmp_path, config)
        wait_same(peer, node)
        assert node.status()["tarantool_upstream"]["copies"] == 0
        # The Tarantool shows it as its replica 2, followed by a relay.
        deadline = time.monotonic() + 30
        while True:
            downstream = up.eval("return (box.info.replication[2] or {}).downstream").data[0]
            # Its acknowledged vclock reaches the Tarantool's own once the rows are written.
            ours, theirs = up.eval("return box.info.replication[2].downstream.vclock, box.info.vclock").data
            if downstream and downstream.get("status") == "follow" and ours == theirs:
                break
            assert time.monotonic() < deadline, (downstream, ours, theirs)
            time.sleep(0.1)
    finally:
        up.close()
        node.stop()


def test_a_tarantool_restart_is_followed_through(tmp_path, peer):
    node = start_follower(tmp_path, follower_config(tmp_path, peer))
    try:
        wait_same(peer, node)
        up = connect(peer.address)
        up.eval("for i = 1, 100 do box.space.users:update(i, {{'+', 3, 1}}) end")
        up.close()
        peer.restart()
        up = connect(peer.address)
        up.eval("for i = 1, 100 do box.space.users:update(i, {{'+', 3, 5}}) end")
        up.close()
        wait_same(peer, node)
        status = node.status()["tarantool_upstream"]
        assert status["reconnects"] >= 1 and status["copies"] == 1, status
        assert status["state"] == "follow", status
    finally:
        node.stop()
