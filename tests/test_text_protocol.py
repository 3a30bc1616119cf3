"""memcached's text protocol and meta commands on the KV port (sniffed from the first byte):
pymemcache and python-memcached on every command they offer, the exact bytes of errors and
meta replies over a raw socket, binary clients on the same port, the refusal when users are
configured, a write acknowledged over text surviving kill -9, and memcaslap in text mode."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import time

import bmemcached
import memcache
import pytest
from helpers import Node, start_node, write_users_config
from pymemcache.client.base import Client as PyMemcache


def ask(node: Node, data: bytes, expect_end: bytes = b"\r\n", timeout: float = 10) -> bytes:
    """Sends `data` on a new connection and reads until the reply ends with `expect_end` (or
    the server closes)."""
    with socket.create_connection((node.host, node.port), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        while not got.endswith(expect_end):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def test_pymemcache_every_command(server):
    c = PyMemcache((server.host, server.port), default_noreply=False)
    assert c.set("k", b"v1", expire=100, flags=7)
    assert c.get("k") == b"v1"
    value, cas = c.gets("k")
    assert value == b"v1" and cas.isdigit()
    assert c.cas("k", b"v2", cas) is True
    assert c.cas("k", b"v3", cas) is False, "the CAS is stale now"
    assert c.cas("missing", b"x", b"1") is None
    assert c.add("k", b"no") is False and c.add("k2", b"yes") is True
    assert c.replace("k2", b"yes2") is True and c.replace("nope", b"x") is False
    assert c.append("k2", b"+a") and c.prepend("k2", b"p+")
    assert c.get("k2") == b"p+yes2+a"
    assert c.append("nope", b"x") is False
    assert c.set_many({"m1": b"1", "m2": b"2", "m3": b"3"}) == []
    assert c.get_many(["m1", "m2", "m3", "none"]) == {"m1": b"1", "m2": b"2", "m3": b"3"}
    assert c.gets_many(["m1"])["m1"][0] == b"1"
    assert c.incr("m1", 41) == 42 and c.decr("m1", 50) == 0
    assert c.incr("none", 1) is None
    assert c.touch("m2", 100) is True and c.touch("none", 1) is False
    # pymemcache has no gat: the bytes.
    assert ask(server, b"gat 100 m2 none\r\n", b"END\r\n") == b"VALUE m2 0 1\r\n2\r\nEND\r\n"
    assert re.fullmatch(rb"VALUE m2 0 1 \d+\r\n2\r\nEND\r\n", ask(server, b"gats 100 m2\r\n", b"END\r\n"))
    assert c.delete("m3") is True and c.delete("m3") is False
    assert c.delete_many(["m1", "m2"]) is True
    c.set("quiet", b"q", noreply=True)
    assert c.get("quiet") == b"q", "noreply still stores"
    stats = c.stats()
    for key in (b"pid", b"uptime", b"version", b"curr_items", b"cmd_get", b"get_hits", b"cmd_set"):
        assert key in stats, stats
    assert stats[b"curr_items"] >= 3
    assert c.version() == sluice_version()
    assert c.flush_all() is True
    assert c.get("k") is None
    with pytest.raises(Exception, match="object too large|too large"):
        c.set("big", b"x" * (21 << 20))
    c.quit()


def sluice_version() -> bytes:
    import sluice

    return sluice.__version__.encode()


def test_python_memcached_every_command(server):
    c = memcache.Client([server.address])
    assert c.set("a", "hello", time=100)
    assert c.get("a") == "hello"
    assert c.add("a", "x") == 0 and c.add("b", "x")
    assert c.replace("b", "y") and not c.replace("zz", "y")
    assert c.append("b", "z") and c.prepend("b", "w") and c.get("b") == "wyz"
    assert c.set_multi({"c": 1, "d": 2}) == []
    assert c.get_multi(["c", "d", "none"]) == {"c": 1, "d": 2}
    assert c.incr("c", 5) == 6 and c.decr("c", 2) == 4
    assert c.touch("d", 100)
    assert c.gets("a") == "hello" and c.cas("a", "world") and c.get("a") == "world"
    assert c.delete("a") and c.get("a") is None
    assert c.delete_multi(["c", "d"])
    ((name, stats),) = c.get_stats()
    assert int(stats["pid"]) > 0 and "curr_items" in stats
    c.flush_all()
    assert c.get("b") is None
    c.disconnect_all()


def test_errors_are_memcached_s_bytes(tmp_path):
    node = start_node(tmp_path, "n", max_item_size=1024)
    try:
        assert ask(node, b"bogus\r\n") == b"ERROR\r\n"
        assert ask(node, b"\r\n") == b"ERROR\r\n"
        assert ask(node, b"get\r\n") == b"ERROR\r\n"
        assert ask(node, b"set a 0 0 x\r\n") == b"CLIENT_ERROR bad command line format\r\n"
        long_key = b"k" * 251
        assert ask(node, b"get " + long_key + b"\r\n") == b"CLIENT_ERROR bad command line format\r\n"
        assert ask(node, b"set a 0 0 3\r\nabcd\r\n") == b"CLIENT_ERROR bad data chunk\r\nERROR\r\n"
        # Too large: the value is read and dropped, and the connection goes on.
        big = b"set big 0 0 2000\r\n" + b"x" * 2000 + b"\r\nset a 0 0 1\r\nv\r\nget big a\r\n"
        assert ask(node, big, b"END\r\n") == (
            b"SERVER_ERROR object too large for cache\r\nSTORED\r\nVALUE a 0 1\r\nv\r\nEND\r\n"
        )
        non_numeric = b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n"
        assert ask(node, b"incr a 1\r\n") == non_numeric
        assert ask(node, b"incr a x\r\n") == b"CLIENT_ERROR invalid numeric delta argument\r\n"
        assert ask(node, b"touch a x\r\n") == b"CLIENT_ERROR invalid exptime argument\r\n"
        assert ask(node, b"verbosity 1\r\nverbosity noreply\r\nmn\r\n") == b"OK\r\nMN\r\n"
        # A line past 2048 bytes with no end (not a multi-get) cannot be followed: closed.
        assert ask(node, b"x" * 3000) == b"CLIENT_ERROR line too long\r\n"
        # A multi-get may be longer.
        many = b"get " + b" ".join(b"a" for _ in range(1500)) + b"\r\n"
        assert ask(node, many, b"END\r\n").count(b"VALUE a 0 1\r\n") == 1500
        # version and quit take no arguments, not even noreply (the protocol text, and what
        # memccapable checks); quit with one keeps the connection.
        assert ask(node, b"version foo\r\nquit noreply\r\nmn\r\n") == b"ERROR\r\nERROR\r\nMN\r\n"
        assert ask(node, b"quit\r\nget a\r\n") == b""
        node.wait_for("a command line over 2048 bytes", timeout=10)
    finally:
        assert node.stop() == 0


def test_cas_0_matches_no_item_and_a_huge_get_reply_is_refused(server):
    # No item has CAS 0: memcached answers EXISTS for a present key and NOT_FOUND otherwise.
    assert ask(server, b"set c0 0 0 1\r\nx\r\n") == b"STORED\r\n"
    assert ask(server, b"cas c0 0 0 1 0\r\ny\r\n") == b"EXISTS\r\n"
    assert ask(server, b"cas none 0 0 1 0\r\ny\r\n") == b"NOT_FOUND\r\n"
    assert ask(server, b"get c0\r\n", b"END\r\n") == b"VALUE c0 0 1\r\nx\r\nEND\r\n"
    # One key asked 70 times over, 1 MiB each: past the 64 MiB a reply may hold.
    big = b"b" * (1 << 20)
    assert ask(server, b"set big 0 0 %d\r\n%s\r\n" % (len(big), big)) == b"STORED\r\n"
    reply = ask(server, b"get" + b" big" * 70 + b"\r\n", b"\r\n", timeout=30)
    assert reply.startswith(b"SERVER_ERROR out of memory writing get response\r\n"), reply[:100]


def test_pipelined_commands_are_answered_in_order(server):
    sets = b"".join(b"set p%d 0 0 1 noreply\r\n%d\r\n" % (i, i % 10) for i in range(500))
    gets = b"".join(b"get p%d\r\n" % i for i in range(500))
    got = ask(server, sets + gets + b"mn\r\n", b"MN\r\n")
    expected = b"".join(b"VALUE p%d 0 1\r\n%d\r\nEND\r\n" % (i, i % 10) for i in range(500))
    assert got == expected + b"MN\r\n"


def test_meta_commands_on_the_wire(server):
    assert ask(server, b"mn\r\n") == b"MN\r\n"
    assert ask(server, b"mg m v\r\n") == b"EN\r\n"
    assert ask(server, b"mg m v q k Ox\r\nmn\r\n", b"MN\r\n") == b"MN\r\n", "q hides the miss"
    assert ask(server, b"mg m v k Ox\r\n") == b"EN km Ox\r\n"
    assert ask(server, b"ms m 3 T0 F5 k Oa\r\nabc\r\n") == b"HD km Oa\r\n"
    assert ask(server, b"ms m 3 q\r\nabc\r\nmn\r\n", b"MN\r\n") == b"MN\r\n"
    cas = int(re.search(rb"c(\d+)", ask(server, b"mg m c\r\n")).group(1))
    assert ask(server, b"mg m v f t s Oz\r\n") == b"VA 3 f0 t-1 s3 Oz\r\nabc\r\n"
    assert ask(server, b"mg m\r\n") == b"HD\r\n"
    assert ask(server, b"ms m 3 C1 c\r\nxyz\r\n") == b"EX c0\r\n"
    reply = ask(server, b"ms m 3 C%d c F9 T100\r\nxyz\r\n" % cas)
    assert re.fullmatch(rb"HD c(\d+)\r\n", reply) and reply != b"HD c%d\r\n" % cas
    assert re.fullmatch(rb"VA 3 f9 t(99|100)\r\nxyz\r\n", ask(server, b"mg m v f t\r\n"))
    assert ask(server, b"ms m 1 ME\r\nq\r\n") == b"NS\r\n", "add of an existing key"
    assert ask(server, b"ms none 1 MR\r\nq\r\n") == b"NS\r\n", "replace of a missing key"
    assert ask(server, b"ms none 1 MA\r\nq\r\n") == b"NS\r\n", "append to a missing key"
    assert ask(server, b"ms none 1 C5\r\nq\r\n") == b"NF\r\n"
    assert ask(server, b"ms m 2 MA\r\n++\r\nms m 2 MP\r\n--\r\nmg m v\r\n", b"xyz++\r\n") == (
        b"HD\r\nHD\r\nVA 7\r\n--xyz++\r\n"
    )
    assert ask(server, b"mg m T0 t\r\n") == b"HD t-1\r\n", "T touches"
    assert ask(server, b"md m C1 Oq\r\n") == b"EX Oq\r\n"
    assert ask(server, b"md m k\r\n") == b"HD km\r\n"
    assert ask(server, b"md m\r\n") == b"NF\r\n"
    assert ask(server, b"md m q\r\nmn\r\n", b"MN\r\n") == b"NF\r\nMN\r\n", "q hides HD only"
    # Arithmetic: a miss is NF unless N creates it with J.
    assert ask(server, b"ma n\r\n") == b"NF\r\n"
    assert ask(server, b"ma n N0 J10 v t\r\n") == b"VA 2 t-1\r\n10\r\n"
    assert ask(server, b"ma n v D5 MD\r\n") == b"VA 1\r\n5\r\n"
    assert ask(server, b"ma n D7 M+ q\r\nma n v\r\n", b"\r\n13\r\n") == b"VA 2\r\n13\r\n"
    assert ask(server, b"ma n C1\r\n") == b"EX\r\n"
    assert re.fullmatch(rb"VA 2 t(99|100)\r\n14\r\n", ask(server, b"ma n T100 t v\r\n"))
    assert re.fullmatch(rb"ME n exp=(99|100) cas=\d+ size=2 vb=\d+ seqno=\d+\r\n", ask(server, b"me n\r\n"))
    assert ask(server, b"me none\r\n") == b"EN\r\n"
    # base64 keys: "YWJj" is "abc", which the classic commands then see.
    got = ask(server, b"ms YWJj 2 b\r\nhi\r\nmg YWJj b v k\r\n", b"hi\r\n")
    assert got == b"HD\r\nVA 2 kYWJj b\r\nhi\r\n"
    assert ask(server, b"get abc\r\n") == b"VALUE abc 0 2\r\nhi\r\nEND\r\n"
    # Flags: bad, duplicate, unsupported by name, the opaque's length.
    assert ask(server, b"mg m zz\r\n") == b"CLIENT_ERROR invalid flag\r\n"
    assert ask(server, b"mg m v v\r\n") == b"CLIENT_ERROR duplicate flag\r\n"
    assert ask(server, b"mg m h\r\n") == b"CLIENT_ERROR flag h is not supported by sluice\r\n"
    assert ask(server, b"mg m O" + b"o" * 33 + b"\r\n") == b"CLIENT_ERROR opaque token too long\r\n"
    assert ask(server, b"mg !!! b\r\n") == b"CLIENT_ERROR error decoding key\r\n"
    assert ask(server, b"ms m 1 MX\r\nx\r\nmn\r\n", b"MN\r\n") == (
        b"CLIENT_ERROR invalid mode for ms M token\r\nMN\r\n"
    ), "a refused ms line still has its data skipped"


def test_binary_clients_still_work_on_the_same_port(server):
    text = PyMemcache((server.host, server.port), default_noreply=False)
    text.set("shared", b"from-text")
    binary = bmemcached.Client([server.address])
    assert binary.get("shared") in (b"from-text", "from-text")
    binary.set("other", "from-binary")
    assert text.get("other") is not None


def test_text_is_refused_when_users_are_configured(tmp_path):
    users = tmp_path / "users.toml"
    write_users_config(users, '["read"]')
    node = start_node(tmp_path, "secure", extra=users.read_text())
    try:
        reply = ask(node, b"set a 0 0 1\r\nx\r\n")
        assert reply == (
            b"CLIENT_ERROR authentication required: this node has users; use the binary protocol "
            b"with SASL PLAIN\r\n"
        )
        node.wait_for("memcached's text protocol cannot authenticate", timeout=10)
        c = bmemcached.Client([node.address], "ada", "ada-secret")
        assert c.set("a", "x") and c.get("a") in ("x", b"x"), "binary with SASL still works"
    finally:
        assert node.stop() == 0


def test_a_write_acknowledged_over_text_survives_kill_9(tmp_path):
    node = start_node(tmp_path, "k9")
    sets = b"".join(b"set t%d 0 0 6\r\nval%03d\r\n" % (i, i) for i in range(200))
    with socket.create_connection((node.host, node.port), timeout=10) as s:
        s.sendall(sets)
        got = b""
        while got.count(b"STORED\r\n") < 200:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
        node.proc.send_signal(signal.SIGKILL)
    node.proc.wait(timeout=30)
    again = Node(tmp_path / "k9", "--config", str(tmp_path / "k9.toml"))
    try:
        c = PyMemcache((again.host, again.port))
        found = c.get_many([f"t{i}" for i in range(200)])
        assert found == {f"t{i}": b"val%03d" % i for i in range(200)}
    finally:
        assert again.stop() == 0


@pytest.mark.skipif(shutil.which("memcaslap") is None, reason="libmemcached-tools is not installed")
def test_memcaslap_text_load_has_no_errors(server):
    start = time.monotonic()
    r = subprocess.run(
        ["memcaslap", "-s", server.address, "-t", "2s", "-c", "4", "-T", "1", "-X", "100"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Run time" in out, out
    assert time.monotonic() - start < 60
    assert not re.search(r"(?i)\berror\b", out), out


@pytest.fixture
def memcached():
    """memcached itself (Debian's), on a free port, to compare with."""
    if shutil.which("memcached") is None:
        pytest.skip("memcached is not installed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(["memcached", "-l", "127.0.0.1", "-p", str(port), "-U", "0", "-u", "root"])
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "memcached did not start"
            time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait()


def test_stats_groups_and_arguments_as_memcached_answers_them(server, memcached):
    """The stats groups python-memcached and other clients ask for (items, slabs, settings,
    sizes) answer in memcached's shapes; python-memcached's get_stats('items'),
    get_slab_stats() and get_stats('settings') work on both."""

    class Peer:
        host, port = "127.0.0.1", memcached

    for peer in (server, Peer):
        c = memcache.Client([f"{peer.host}:{peer.port}"])
        assert c.set("k", "v")
        ((_, items),) = c.get_stats("items")
        assert items["items:1:number"] == "1", items
        ((_, slabs),) = c.get_slab_stats()
        assert int(slabs["1"]["used_chunks"]) >= 1, slabs
        ((_, settings),) = c.get_stats("settings")
        assert int(settings["maxbytes"]) > 0 and settings["cas_enabled"] == "yes", settings
        assert ask(peer, b"stats sizes\r\n", b"END\r\n") == b"STAT sizes_status disabled\r\nEND\r\n"
        assert ask(peer, b"stats bogus\r\n") == b"ERROR\r\n"
        c.disconnect_all()


def test_a_delayed_flush_all_empties_the_bucket_when_its_time_comes(server):
    c = memcache.Client([server.address])
    c.flush_all()
    assert c.set("before", "1")
    assert ask(server, b"flush_all 2\r\n") == b"OK\r\n"
    assert c.get("before") == "1", "not yet"
    deadline = time.monotonic() + 15
    while c.get("before") is not None:
        assert time.monotonic() < deadline, "the delayed flush never came"
        time.sleep(0.1)
    # What is stored after the flush stays.
    assert c.set("after", "2")
    time.sleep(0.5)
    assert c.get("after") == "2"


def test_stats_counts_commands_as_memcached_does(server, memcached):
    """The general `stats` keys sluice answers are memcached's, and the command counters move
    alike on both for the same commands."""

    class Peer:
        host, port = "127.0.0.1", memcached

    def stats(peer) -> dict[str, str]:
        lines = ask(peer, b"stats\r\n", b"END\r\n").decode().splitlines()
        return {line.split()[1]: line.split()[2] for line in lines if line.startswith("STAT ")}

    commands = (
        b"set a 0 0 1\r\n1\r\n"
        b"incr a 5\r\nincr nope 1\r\ndecr a 2\r\ndecr nope 1\r\n"
        b"touch a 100\r\ntouch nope 100\r\n"
        b"delete nope\r\ndelete a\r\n"
        b"gets a\r\nset b 0 0 1\r\nx\r\n"
    )
    counters = [
        "incr_hits", "incr_misses", "decr_hits", "decr_misses", "touch_hits", "touch_misses",
        "cmd_touch", "delete_hits", "delete_misses",
    ]  # fmt: skip
    seen = {}
    for peer in (server, Peer):
        before = stats(peer)
        with socket.create_connection((peer.host, peer.port), timeout=10) as s:
            s.sendall(commands)
            got = b""
            while got.count(b"\r\n") < 11:
                got += s.recv(4096)
        after = stats(peer)
        seen[peer] = {k: int(after[k]) - int(before.get(k, 0)) for k in counters}
    assert seen[server] == seen[Peer], seen
    ours, theirs = stats(server), stats(Peer)
    extra = set(ours) - set(theirs) - {k for k in ours if k.startswith("ep_")}
    assert extra == set(), f"keys memcached does not answer: {extra}"
    assert len(ours) >= 40, len(ours)
