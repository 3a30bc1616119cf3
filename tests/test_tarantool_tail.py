"""`sluice tarantool-tail` against a real Tarantool 2.6 (the Debian `tarantool` binary): it follows
as an anonymous replica, prints the snapshot's rows and then every change as the Tarantool makes
it (inserts, updates, deletes, a transaction), shows up in the Tarantool's
box.info.replication_anon while it follows, and a wrong password is a clear error."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time

import pytest
import tarantool
from tarantool_peer import PASSWORD, TARANTOOL, TARANTOOL_MISSING, USER, USERS, TarantoolPeer

pytestmark = pytest.mark.skipif(TARANTOOL is None, reason=TARANTOOL_MISSING)


@pytest.fixture
def peer(tmp_path):
    grant = f"box.schema.user.grant('{USER}', 'replication')"
    with TarantoolPeer(tmp_path / "tarantool", extra_lua=grant) as p:
        yield p


def start_tail(
    peer: TarantoolPeer, *args: str, password: str = PASSWORD
) -> tuple[subprocess.Popen, queue.Queue]:
    """`sluice tarantool-tail` as app, and a queue of the rows it prints (None when it ends)."""
    login = ["--user", USER, "--password-stdin"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice", "tarantool-tail", peer.address, *login, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(password + "\n")
    proc.stdin.close()
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(json.loads(line))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def rows_until(lines: queue.Queue, done, timeout: float = 60) -> list[dict]:
    """Rows as they come, until `done(rows)` holds."""
    rows: list[dict] = []
    deadline = time.monotonic() + timeout
    while not done(rows):
        row = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        assert row is not None, "the tail ended early"
        rows.append(row)
    return rows


def test_the_snapshot_then_every_change_as_it_happens(peer):
    conn = tarantool.Connection(peer.host, peer.port, user=USER, password=PASSWORD)
    for i in range(50):
        conn.replace(USERS.name, [i, f"name{i}", i])
    proc, lines = start_tail(peer, "--snapshot")
    try:
        users = lambda rs: [r for r in rs if r.get("BODY", {}).get("space_id") == USERS.id]  # noqa: E731
        snap = rows_until(lines, lambda rs: len(users(rs)) == 50)
        assert {r["HEADER"]["type"] for r in snap} == {"INSERT"}
        assert sorted(r["BODY"]["tuple"][0] for r in users(snap)) == list(range(50))
        assert 280 in {r["BODY"]["space_id"] for r in snap}, "the system spaces come first (_space)"

        # Changes made now arrive as they happen, with their LSNs.
        conn.insert(USERS.name, [100, "new", 1])
        conn.update(USERS.name, 1, [("+", 2, 5), ("=", 1, "renamed")])
        conn.delete(USERS.name, 2)
        conn.eval(
            "box.begin() box.space.users:replace{101, 'a', 1} box.space.users:replace{102, 'b', 2} "
            "box.commit()"
        )
        live = rows_until(lines, lambda rs: len(rs) >= 5)
        assert [r["HEADER"]["type"] for r in live] == ["INSERT", "UPDATE", "DELETE", "REPLACE", "REPLACE"]
        assert live[0]["BODY"] == {"space_id": USERS.id, "tuple": [100, "new", 1]}
        assert live[1]["BODY"]["key"] == [1]
        assert live[1]["BODY"]["tuple"] == [["+", 2, 5], ["=", 1, "renamed"]]
        assert live[2]["BODY"]["key"] == [2]
        lsns = [r["HEADER"]["lsn"] for r in live]
        assert lsns == sorted(lsns) and len(set(lsns)) == 5
        txn = live[3:]
        assert txn[0]["HEADER"]["tsn"] == txn[1]["HEADER"]["tsn"] == txn[0]["HEADER"]["lsn"]
        assert txn[1]["HEADER"].get("commit") is True and "commit" not in txn[0]["HEADER"]

        # The Tarantool sees it following, and keeps it past its replication timeouts.
        time.sleep(3)
        anon = conn.eval("return box.info.replication_anon()").data[0]
        assert len(anon) == 1, anon
        conn.replace(USERS.name, [103, "later", 3])
        later = rows_until(lines, lambda rs: len(rs) == 1)
        assert later[0]["BODY"]["tuple"] == [103, "later", 3]
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
        proc.wait()
        conn.close()


def test_from_now_and_max(peer):
    conn = tarantool.Connection(peer.host, peer.port, user=USER, password=PASSWORD)
    conn.replace(USERS.name, [1, "before", 1])
    proc, lines = start_tail(peer, "--max", "2")
    try:
        time.sleep(1)  # subscribed: what was written before does not show
        conn.replace(USERS.name, [2, "after", 2])
        conn.replace(USERS.name, [3, "after", 3])
        rows = rows_until(lines, lambda rs: len(rs) == 2)
        assert [r["BODY"]["tuple"][0] for r in rows] == [2, 3]
        assert proc.wait(timeout=30) == 0
        assert lines.get(timeout=5) is None
    finally:
        proc.kill()
        conn.close()


def test_a_wrong_password_is_a_clear_error(peer):
    proc, lines = start_tail(peer, password="wrong")
    assert proc.wait(timeout=30) == 1
    assert proc.stderr is not None
    assert f"Incorrect password supplied for user '{USER}'" in proc.stderr.read()


def test_a_state_file_resumes_where_it_stopped(tmp_path):
    grant = f"box.schema.user.grant('{USER}', 'replication') box.cfg{{checkpoint_count = 1}}"
    with TarantoolPeer(tmp_path / "tarantool", extra_lua=grant) as peer:
        conn = tarantool.Connection(peer.host, peer.port, user=USER, password=PASSWORD)
        state = tmp_path / "tail.state"
        proc, lines = start_tail(peer, "--snapshot", "--state", str(state), "--max", "10000")
        try:
            users = lambda rs: [r for r in rs if r.get("BODY", {}).get("space_id") == USERS.id]  # noqa: E731
            conn.replace(USERS.name, [1, "one", 1])
            rows_until(lines, lambda rs: len(users(rs)) == 1)
        finally:
            proc.kill()
            proc.wait()
        for i in range(2, 8):
            conn.replace(USERS.name, [i, "later", i])
        # Resumed: the rows after the saved position, none twice, none missing.
        proc, lines = start_tail(peer, "--state", str(state), "--max", "6")
        assert proc.wait(timeout=60) == 0
        rows = rows_until(lines, lambda rs: len(rs) == 6)
        assert [r["BODY"]["tuple"][0] for r in rows] == [2, 3, 4, 5, 6, 7]
        assert lines.get(timeout=5) is None
        saved = json.loads(state.read_text())["vclock"]
        assert saved == {str(rows[-1]["HEADER"]["replica_id"]): rows[-1]["HEADER"]["lsn"]}

        # Rows written and then collected from the Tarantool's WAL while nobody followed: the
        # saved position cannot be resumed, and it says so.
        conn.replace(USERS.name, [8, "gone", 8])
        conn.eval("box.snapshot()")
        conn.replace(USERS.name, [9, "gone", 9])
        conn.eval("box.snapshot()")
        proc, lines = start_tail(peer, "--state", str(state))
        assert proc.wait(timeout=60) == 1
        assert proc.stderr is not None
        assert "no longer holds the rows after the saved position" in proc.stderr.read()
        conn.close()
