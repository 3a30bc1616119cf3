"""Tarantool's iproto served by `sluice serve`, through the `tarantool` connector from PyPI
(tarantool-python): connect with and without AUTH, every request type and update operation,
SELECT's iterators with LIMIT and OFFSET on full and partial keys, errors as Tarantool words
them, schema by name, threads, restarts, DCP and a read-only replica."""

from __future__ import annotations

import signal
import threading
import time

import msgpack
import pytest
import sluice
from helpers import Node, node_config
from iproto_helpers import NUM_VBUCKETS, SPACES, USERS_SPACE, host_port, start_iproto_node, user_table

tarantool = pytest.importorskip("tarantool")
from tarantool.const import (  # noqa: E402
    ITERATOR_ALL,
    ITERATOR_EQ,
    ITERATOR_GE,
    ITERATOR_GT,
    ITERATOR_LE,
    ITERATOR_LT,
    ITERATOR_REQ,
)
from tarantool.error import DatabaseError  # noqa: E402


def connect(node: Node, user: str | None = "app", password: str | None = "secret"):
    host, port = host_port(node.iproto)
    return tarantool.Connection(host, port, user=user, password=password)


@pytest.fixture
def node(tmp_path):
    n = start_iproto_node(tmp_path)
    yield n
    assert n.stop() == 0, n.log()[-3000:]


def error_of(call) -> tuple[int, str]:
    with pytest.raises(DatabaseError) as e:
        call()
    return e.value.code, e.value.message


def test_every_request_type_by_name_and_number(node):
    conn = connect(node)
    assert conn.ping() > 0
    assert conn.insert("users", [1, "ada", 36]).data == [[1, "ada", 36]]
    assert conn.insert(USERS_SPACE, [2, "bob", None]).data == [[2, "bob", None]]
    assert conn.select("users", [1]).data == [[1, "ada", 36]]
    assert conn.replace("users", [2, "bob", 41]).data == [[2, "bob", 41]]
    assert conn.select("users").data == [[1, "ada", 36], [2, "bob", 41]]
    assert conn.update("users", [1], [("+", 2, 1)]).data == [[1, "ada", 37]]
    assert conn.update("users", [9], [("+", 2, 1)]).data == [], "a missing key updates nothing"
    assert conn.upsert("users", [3, "cy", 1], [("+", 2, 1)]).data == []
    assert conn.upsert("users", [3, "cy", 1], [("+", 2, 1)]).data == []
    assert conn.select("users", [3]).data == [[3, "cy", 2]], "inserted, then incremented"
    assert conn.delete("users", [3]).data == [[3, "cy", 2]]
    assert conn.delete("users", [3]).data == []
    assert conn.select("users", [3]).data == []
    conn.close()


def test_every_update_operation(node):
    conn = connect(node)
    conn.insert("users", [1, "ada", 12, 5, "tail"])

    def update(*ops):
        return conn.update("users", [1], list(ops)).data[0]

    # Field numbers are 0-based, as tarantool-python sends them (INDEX_BASE absent).
    assert update(("+", 2, 8)) == [1, "ada", 20, 5, "tail"]
    assert update(("-", 2, 5)) == [1, "ada", 15, 5, "tail"]
    assert update(("&", 2, 6)) == [1, "ada", 6, 5, "tail"]
    assert update(("|", 2, 9)) == [1, "ada", 15, 5, "tail"]
    assert update(("^", 2, 5)) == [1, "ada", 10, 5, "tail"]
    assert update(("=", "name", "bob")) == [1, "bob", 10, 5, "tail"], "by field name"
    assert update((":", 1, 0, 1, "R")) == [1, "Rob", 10, 5, "tail"], "splice"
    assert update(("!", 3, "new")) == [1, "Rob", 10, "new", 5, "tail"]
    assert update(("#", 3, 2)) == [1, "Rob", 10, "tail"]
    assert update(("=", -1, "end")) == [1, "Rob", 10, "end"], "a negative field counts from the end"
    assert update(("!", 4, "appended")) == [1, "Rob", 10, "end", "appended"]
    assert update(("+", "age", 1), ("=", 3, 0)) == [1, "Rob", 11, 0, "appended"], "several at once"
    code, message = error_of(lambda: update(("+", 1, 1)))
    assert code == 26, message  # ER_UPDATE_ARG_TYPE: arithmetic on a string
    code, message = error_of(lambda: update(("=", 0, 2)))
    assert code == 94 and "primary" in message, message  # ER_CANT_UPDATE_PRIMARY_KEY
    code, message = error_of(lambda: update(("=", 2, "x")))
    assert code == 23, message  # the result breaks the format
    assert conn.select("users", [1]).data == [[1, "Rob", 11, 0, "appended"]], "refused updates change nothing"
    conn.close()


def test_iterators_limits_and_offsets_on_full_and_partial_keys(node):
    conn = connect(node)
    rows = [[a, b, a * 10] for a in (1, 2, 3) for b in ("x", "y", "z")]
    for r in reversed(rows):
        conn.insert("pairs", r)

    def select(key, iterator, **kw):
        return [tuple(r[:2]) for r in conn.select("pairs", key, iterator=iterator, **kw).data]

    everything = [tuple(r[:2]) for r in rows]
    assert select([], ITERATOR_ALL) == everything, "in primary-key order"
    assert select([], ITERATOR_EQ) == everything, "EQ with an empty key is everything"
    assert select([2], ITERATOR_EQ) == [(2, "x"), (2, "y"), (2, "z")], "a partial key"
    assert select([2], ITERATOR_REQ) == [(2, "z"), (2, "y"), (2, "x")]
    assert select([2, "y"], ITERATOR_EQ) == [(2, "y")], "the full key"
    assert select([2, "y"], ITERATOR_GT) == [(2, "z"), (3, "x"), (3, "y"), (3, "z")]
    assert select([2, "y"], ITERATOR_GE, limit=2) == [(2, "y"), (2, "z")]
    assert select([2], ITERATOR_GT) == [(3, "x"), (3, "y"), (3, "z")], "past every [2, *]"
    assert select([2], ITERATOR_LT) == [(1, "z"), (1, "y"), (1, "x")], "descending"
    assert select([2, "y"], ITERATOR_LE, limit=3) == [(2, "y"), (2, "x"), (1, "z")]
    assert select([], ITERATOR_ALL, offset=7) == [(3, "y"), (3, "z")]
    assert select([], ITERATOR_ALL, offset=2, limit=2) == [(1, "z"), (2, "x")]
    assert select([], ITERATOR_ALL, limit=0) == []
    assert select([4], ITERATOR_EQ) == []
    assert select([1, "x"], ITERATOR_LT) == []
    conn.close()


def test_errors_in_tarantools_words(node):
    conn = connect(node)
    conn.insert("users", [1, "ada", 36])
    assert error_of(lambda: conn.insert("users", [1, "again", 1])) == (
        3,
        "Duplicate key exists in unique index 'primary' in space 'users'",
    )
    code, message = error_of(lambda: conn.insert("users", [2, 3, 4]))
    assert code == 23 and "expected string" in message, message
    code, message = error_of(lambda: conn.insert("users", [2]))
    assert code == 39 and "required by space format is missing" in message, message
    code, message = error_of(lambda: conn.insert("users", ["two", "x"]))
    assert code == 23, message
    code, message = error_of(lambda: conn.select("users", ["one"]))
    assert code == 18, message  # ER_KEY_PART_TYPE
    code, message = error_of(lambda: conn.select("users", [1, 2]))
    assert code == 31, message  # ER_KEY_PART_COUNT
    assert error_of(lambda: conn.select(9999, [1])) == (36, "Space '9999' does not exist")
    assert error_of(lambda: conn.select(USERS_SPACE, [1], index=7)) == (
        35,
        "No index #7 is defined in space 'users'",
    )
    with pytest.raises(tarantool.error.SchemaError):
        conn.select("no_such_space", [1])
    code, message = error_of(lambda: conn.call("no_such_function"))
    assert (code, message) == (33, "Procedure 'no_such_function' is not defined")
    code, message = error_of(lambda: conn.eval("return os.exit()"))
    assert code == 5 and "return os.exit()" in message, message
    code, message = error_of(lambda: conn.execute("select 1"))
    assert code == 5 and "SQL" in message, message
    assert conn.ping() > 0, "still serving after every error"
    conn.close()


def test_builtin_calls_and_evals(node):
    conn = connect(node)
    for i in range(5):
        conn.insert("pairs", [i % 2, str(i), None])
    assert conn.call("box.session.user").data == ["app"]
    assert conn.eval("return box.session.user()").data == ["app"]
    info = conn.call("box.info").data[0]
    assert info["ro"] is False and info["status"] == "running" and len(info["uuid"]) == 36
    assert conn.eval("return box.info").data[0]["uuid"] == info["uuid"]
    assert conn.call("box.space.pairs:len").data == [5]
    assert conn.eval("return box.space.pairs:count()").data == [5]
    # As net.box sends index:count(): with a key and an iterator.
    assert conn.call("box.space.pairs.index.primary:count", [1]).data == [2]
    assert conn.call("box.space.pairs.index.primary:count", [0], {"iterator": "GT"}).data == [2]
    assert conn.eval("return ...", 1, "two", [3]).data == [1, "two", [3]]
    conn.close()


def test_guest_gets_what_users_guest_grants(node):
    guest = connect(node, user=None, password=None)
    assert guest.ping() > 0
    assert guest.call("box.session.user").data == ["guest"]
    code, message = error_of(lambda: guest.select(USERS_SPACE, [1]))
    assert (code, message) == (42, "Read access to space 'users' is denied for user 'guest'")
    assert guest.select("pairs", []).data == [], "guest reads pairs: [users.guest] grants it"
    code, message = error_of(lambda: guest.insert("pairs", [1, "a", None]))
    assert (code, message) == (42, "Write access to space 'pairs' is denied for user 'guest'")
    # users is not even visible to guest's schema, as in Tarantool's _vspace.
    with pytest.raises(tarantool.error.SchemaError):
        guest.select("users", [1])
    guest.close()


def test_a_wrong_password_then_the_right_one_on_the_same_connection(node):
    conn = connect(node, user=None, password=None)
    code, message = error_of(lambda: conn.authenticate("app", "wrong"))
    assert (code, message) == (47, "Incorrect password supplied for user 'app'")
    code, message = error_of(lambda: conn.authenticate("nobody", "x"))
    assert (code, message) == (45, "User 'nobody' is not found")
    # Still guest: the failed logins left the session as it was.
    assert conn.call("box.session.user").data == ["guest"]
    deadline = time.monotonic() + 10  # failed logins slow the next ones down
    conn.authenticate("app", "secret")
    assert time.monotonic() < deadline
    assert conn.call("box.session.user").data == ["app"]
    conn.insert("users", [1, "ada", 1])
    assert conn.select("users", [1]).data == [[1, "ada", 1]]
    conn.close()
    assert node.metric_sum("sluice_auth_failures_total") >= 2


def test_a_correct_login_after_a_burst_of_failed_ones_that_went_away(node):
    """asynctnt-like retries: wrong passwords from one address, each given up within its
    connect timeout while it waits its turn. The attempts of closed connections leave the line,
    so the right password is checked within one backoff, not after theirs."""
    host, port = host_port(node.iproto)
    for _ in range(40):
        try:
            tarantool.Connection(host, port, user="app", password="wrong", socket_timeout=0.2).close()
        except tarantool.error.Error:
            pass
    took = time.monotonic()
    conn = connect(node)
    assert conn.call("box.session.user").data == ["app"]
    conn.close()
    # One backoff at most (5 s); the 40 attempts before would have queued for minutes.
    assert time.monotonic() - took < 8
    assert node.metric_sum("sluice_auth_failures_total") >= 3


def test_a_login_that_cannot_be_checked_in_time_is_told_it_is_throttled(tmp_path):
    """On a node without [users.guest], an iproto connection must log in by login_timeout: an
    AUTH whose turn comes later is answered that it is throttled and when to retry, not that
    its password is wrong."""
    cfg = tmp_path / "n.toml"
    cfg.write_text('login_timeout = "3s"\n' + SPACES + user_table("app", "secret", '{ users = ["read"] }'))
    node = Node(tmp_path / "n", "--config", str(cfg))
    try:
        host, port = host_port(node.iproto)
        # Six failures, each on a connection of its own: after them the next check is 3.2 s off.
        for _ in range(6):
            conn = tarantool.Connection(host, port, user=None, password=None)
            assert error_of(lambda c=conn: c.authenticate("app", "wrong"))[0] == 47
            conn.close()
        conn = tarantool.Connection(host, port, user=None, password=None)
        code, message = error_of(lambda: conn.authenticate("app", "secret"))
        assert code == 42, message  # ER_ACCESS_DENIED
        assert "throttled after failed logins" in message and "retry in" in message, message
        conn.close()
        time.sleep(3.5)
        conn = tarantool.Connection(host, port, user="app", password="secret")
        assert conn.call("box.session.user").data == ["app"]
        conn.close()
    finally:
        assert node.stop() == 0, node.log()[-3000:]


def test_threads_each_with_a_connection(node):
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            conn = connect(node)
            for i in range(40):
                key = t * 1000 + i
                conn.replace("users", [key, f"t{t}", i])
                assert conn.select("users", [key]).data == [[key, f"t{t}", i]]
            conn.close()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    conn = connect(node)
    assert len(conn.select("users").data) == 160
    conn.close()
    assert node.metric("sluice_iproto_requests_total", type="replace") == 160


def test_data_survives_a_restart_and_clients_reconnect(tmp_path):
    node = start_iproto_node(tmp_path)
    conn = connect(node)
    conn.insert("pairs", [7, "seven", {"nested": [1, 2]}])
    conn.close()
    assert node.stop() == 0
    node = start_iproto_node(tmp_path)
    try:
        conn = connect(node)
        assert conn.select("pairs", [7]).data == [[7, "seven", {"nested": [1, 2]}]]
        conn.close()
    finally:
        assert node.stop() == 0


def test_a_write_is_a_change_on_dcp_with_the_encoded_key_and_the_tuple(node):
    conn = connect(node)
    conn.insert("pairs", [1, "a", [True, None]])
    conn.insert("pairs", [2, "b", None])
    conn.delete("pairs", [2, "b"])
    conn.close()
    client = sluice.Client(node.address, bucket="pairs", username="app", password="secret", name="iproto-dcp")
    changes = []
    with client.stream(list(range(NUM_VBUCKETS)), start="beginning", end="now", format="python") as s:
        for batch in s:
            changes += [(c.op, c.key, c.value) for c in batch]
    # Changes of one key are deduplicated as DCP does: key [2, "b"] streams as its deletion only.
    assert [(k, v) for op, k, v in changes if v] == [
        (msgpack.packb([1, "a"]), msgpack.packb([1, "a", [True, None]]))
    ]
    assert [k for _, k, v in changes if not v] == [msgpack.packb([2, "b"])], "the delete streams too"


def test_a_replica_serves_tuples_and_refuses_writes(tmp_path):
    # No users on either node: replication needs no login, iproto serves anyone.
    active = start_iproto_node(tmp_path, "active", users=False)
    replica = None
    try:
        conn = connect(active, user=None, password=None)
        conn.insert("users", [1, "ada", 36])
        conn.close()
        replica = start_iproto_node(tmp_path, "replica", "--replica-of", active.address, users=False)
        rconn = connect(replica, user=None, password=None)
        deadline = time.monotonic() + 30
        while rconn.select("users", [1]).data != [[1, "ada", 36]]:
            assert time.monotonic() < deadline, "the replica never served the tuple"
            time.sleep(0.1)
        code, message = error_of(lambda: rconn.insert("users", [2, "bob", 1]))
        assert (code, message) == (7, "Can't modify data because this instance is in read-only mode.")
        assert rconn.call("box.info").data[0]["ro"] is True
        rconn.close()
    finally:
        if replica is not None:
            assert replica.stop() == 0
        assert active.stop() == 0


def test_sighup_gives_new_logins_the_new_users(tmp_path):
    """Users come from the same table as the memcached front's: a reload changes who may log
    in over iproto and what guest may do, for the next login."""
    n = start_iproto_node(tmp_path)
    try:
        connect(n).close()
        users = (
            user_table("app", "changed", '{ users = ["read"] }')
            + '[users.guest]\nbuckets = { users = ["read"] }\n'
        )
        node_config(tmp_path, "n", SPACES + users)
        n.proc.send_signal(signal.SIGHUP)
        n.wait_for("users updated now")
        probe = connect(n, user=None, password=None)
        code, _ = error_of(lambda: probe.authenticate("app", "secret"))
        assert code == 47, "the old password no longer logs in"
        probe.close()
        conn = connect(n, password="changed")
        assert conn.select("users", []).data == []
        assert error_of(lambda: conn.insert("users", [1, "ada", 36]))[0] == 42, "write taken away"
        conn.close()
        guest = connect(n, user=None, password=None)
        assert guest.select("users", []).data == [], "guest may read users now"
        guest.close()
    finally:
        assert n.stop() == 0, n.log()[-3000:]
