"""SASL PLAIN and per-bucket permissions on a real `sluice serve`, users from the configuration
as password hashes (the form from before SCRAM, which keeps working), and SIGHUP changing them
live. SCRAM: test_server_scram.py."""

from __future__ import annotations

import signal
import struct

import bmemcached
import pytest
import sluice
from helpers import Node, write_users_config
from mcbp_wire import (
    FLUSH,
    GET,
    NOOP,
    SASL_LIST_MECHS,
    SET,
    connect,
    login,
    read_response,
    request,
    set_extras,
)


@pytest.fixture
def secured(tmp_path):
    cfg = tmp_path / "sluice.toml"
    write_users_config(cfg, '["read"]')
    node = Node(tmp_path / "d", "--config", str(cfg))
    node.config = cfg
    yield node
    assert node.stop() == 0


def test_nothing_before_authentication_and_wrong_passwords_fail(secured):
    with connect(secured) as s:
        s.sendall(request(NOOP) + request(SASL_LIST_MECHS))
        assert read_response(s)["status"] == 0
        assert read_response(s)["value"].split()[-1] == b"PLAIN"
        s.sendall(request(GET, b"k"))
        assert read_response(s)["status"] == 0x0020, "unauthenticated: AUTH_ERROR"
        assert login(s, "ada", "wrong") == 0x0020
        assert login(s, "nobody", "ada-secret") == 0x0020
        assert login(s, "ada", "ada-secret") == 0
        s.sendall(request(SET, b"k", b"v", set_extras()) + request(GET, b"k"))
        assert read_response(s)["status"] == 0
        assert read_response(s)["value"] == b"v"


def test_a_real_client_logs_in_with_plain(secured):
    c = bmemcached.Client([secured.address], "ada", "ada-secret")
    assert c.set("from-client", "x") and c.get("from-client") == "x"
    c.disconnect_all()


def test_permissions_per_bucket_and_sighup_changes_them_live(secured):
    with connect(secured) as s:
        assert login(s, "bob", "bob-secret") == 0
        s.sendall(request(GET, b"k") + request(SET, b"k", b"v", set_extras()))
        assert read_response(s)["status"] == 0x0001, "read allowed (a miss)"
        assert read_response(s)["status"] == 0x0024, "write refused: EACCESS"
        s.sendall(request(FLUSH))
        assert read_response(s)["status"] == 0x0024
        write_users_config(secured.config, '["read", "write"]')
        secured.proc.send_signal(signal.SIGHUP)
        secured.wait_for("users updated now")
        s.sendall(request(SET, b"k", b"v", set_extras()))
        assert read_response(s)["status"] == 0, "the same connection, new permissions"
    # A reload that changed the users is not then called unchanged; one that changed nothing is.
    secured.proc.send_signal(signal.SIGHUP)
    secured.wait_for("the configuration is unchanged")
    assert "".join(secured.lines).count("the configuration is unchanged") == 1, secured.lines[-5:]
    with connect(secured) as s:
        assert login(s, "root", "root-secret") == 0
        s.sendall(request(FLUSH, extras=struct.pack(">I", 0)))
        assert read_response(s)["status"] == 0, "admin may flush"


@pytest.mark.parametrize(
    ("table", "path"),
    [
        ('[users.ada]\npassword = "plain"\n', "passwords are never stored"),
        ('[users.ada]\npassword_hash = "md5:x"\n', "users.ada.password_hash"),
        (
            '[users.ada]\npassword_hash = "{h}"\nbuckets = {{ default = ["fly"] }}\n',
            "users.ada.buckets.default",
        ),
        ('[users.ada]\npassword_hash = "{h}"\nbuckets = {{ nope = ["read"] }}\n', "users.ada.buckets.nope"),
        (
            '[users.ada]\npassword_hash = "{h}"\ntopics = {{ feed = ["replication"] }}\n',
            "users.ada.topics.feed",
        ),
        ('[users.guest]\ntopics = {{ "a*b" = ["read"] }}\n', "users.guest.topics.a*b"),
    ],
)
def test_bad_user_config_names_the_key(tmp_path, table, path):
    import subprocess
    import sys

    f = tmp_path / "bad.toml"
    f.write_text(table.format(h=sluice.config.hash_password("x", iterations=1000)))
    r = subprocess.run(
        [sys.executable, "-m", "sluice", "config", "check", str(f)], capture_output=True, text=True
    )
    assert r.returncode == 2 and path in r.stderr, r.stderr


def test_user_hash_reads_stdin_and_never_prints_the_password():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "sluice", "user", "hash"], input="s3cret\n", capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.startswith('scram_sha512 = "scram-sha512:100000:')
    assert "s3cret" not in r.stdout


def test_pylibmc_logs_in_with_sasl_plain(secured):
    import os
    import subprocess
    import sys

    # The pylibmc wheel bundles libsasl2 without mechanism plugins; the system's (Debian's
    # libsasl2-modules, installed by .ci/run) provide PLAIN. libsasl reads SASL_PATH when pylibmc
    # is imported, hence a process of its own.
    plugins = "/usr/lib/x86_64-linux-gnu/sasl2"
    if not os.path.exists(os.path.join(plugins, "libplain.so")):
        pytest.skip("libsasl2-modules is not installed (.ci/run installs it)")
    code = f"""
import pylibmc
c = pylibmc.Client([{secured.address!r}], binary=True, username="ada", password="ada-secret")
assert c.set("via-pylibmc", b"1") and c.get("via-pylibmc") == b"1"
bad = pylibmc.Client([{secured.address!r}], binary=True, username="ada", password="wrong")
try:
    bad.set("k", b"x")
except pylibmc.Error:
    print("refused")
"""
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, SASL_PATH=plugins),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "refused", r.stdout + r.stderr
