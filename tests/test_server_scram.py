"""SASL SCRAM-SHA1, -SHA256 and -SHA512 on a real `sluice serve`, byte for byte with a client
written from RFC 5802 (mcbp_wire.Scram): logins with stored keys (never the password), failures
that look the same for a wrong password and an unknown user, exchanges out of order or
malformed; what a node without users answers; `sluice user hash` and the configuration check."""

from __future__ import annotations

import hashlib
import itertools
import socket
import subprocess
import sys

import pytest
import sluice
from helpers import Node
from mcbp_wire import (
    AUTH_CONTINUE,
    AUTH_ERROR,
    GET,
    NOOP,
    SASL_AUTH,
    SASL_LIST_MECHS,
    SASL_STEP,
    Scram,
    connect,
    login,
    read_response,
    request,
    scram_login,
)

MECHANISMS = ["SCRAM-SHA512", "SCRAM-SHA256", "SCRAM-SHA1"]
KEY_ENOENT = 0x01


def credentials_toml(password: str, iterations: int = 1000) -> str:
    creds = sluice.config.user_credentials(password, iterations=iterations)
    return "".join(f'{k} = "{v}"\n' for k, v in creds.items())


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """Users: ada with SCRAM keys (password ada-secret), old with only a password_hash (PLAIN)."""
    tmp = tmp_path_factory.mktemp("scram")
    cfg = tmp / "sluice.toml"
    old = sluice.config.hash_password("old-secret", iterations=1000)
    cfg.write_text(
        "[users.ada]\n" + credentials_toml("ada-secret") + 'buckets = { default = ["read"] }\n'
        f'[users.old]\npassword_hash = "{old}"\nbuckets = {{ default = ["read"] }}\n'
    )
    n = Node(tmp / "d", "--config", str(cfg))
    yield n
    assert n.stop() == 0


_sources = itertools.count(1)


def fresh(node: Node) -> socket.socket:
    """A connection from a loopback address of its own: failed logins slow down the next ones
    from the same address (login.rs), and the tests here share one node."""
    n = next(_sources)
    return socket.create_connection(
        (node.host, node.port), timeout=10, source_address=(f"127.0.{n // 250 + 1}.{n % 250 + 1}", 0)
    )


def start(sock, mechanism: str, user: str, nonce: str = "abc") -> dict:
    sock.sendall(request(SASL_AUTH, mechanism.encode(), f"n,,n={user},r={nonce}".encode()))
    return read_response(sock)


def step(sock, mechanism: str, message: bytes) -> dict:
    sock.sendall(request(SASL_STEP, mechanism.encode(), message))
    return read_response(sock)


def test_every_mechanism_is_listed(node):
    with fresh(node) as s:
        s.sendall(request(SASL_LIST_MECHS))
        assert read_response(s)["value"] == b"SCRAM-SHA512 SCRAM-SHA256 SCRAM-SHA1 PLAIN"


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_scram_logs_in_with_stored_keys_and_a_nonce_with_spaces(node, mechanism):
    with fresh(node) as s:
        s.sendall(request(GET, b"k"))
        assert read_response(s)["status"] == AUTH_ERROR, "nothing before the login"
        client = Scram(mechanism, "ada", "ada-secret", nonce="a nonce with  spaces")
        s.sendall(request(SASL_AUTH, mechanism.encode(), client.first()))
        first = read_response(s)
        assert first["status"] == AUTH_CONTINUE
        assert first["value"].startswith(b"r=a nonce with  spaces")
        assert b",s=" in first["value"] and first["value"].endswith(b",i=1000")
        last = step(s, mechanism, client.final(first["value"]))
        assert (last["status"], last["value"]) == (0, client.expected_signature)
        s.sendall(request(GET, b"k"))
        assert read_response(s)["status"] == KEY_ENOENT, "logged in: a miss, not AUTH_ERROR"


def test_plain_checks_against_the_scram_keys_and_old_hashes_still_work(node):
    with fresh(node) as s:
        assert login(s, "ada", "ada-secret") == 0
        assert login(s, "ada", "wrong") == AUTH_ERROR
        assert login(s, "old", "old-secret") == 0


def test_wrong_password_unknown_user_and_missing_keys_fail_alike(node):
    answers = {}
    for user, password in [("ada", "wrong"), ("nobody", "x"), ("old", "old-secret")]:
        with fresh(node) as s:
            r = scram_login(s, "SCRAM-SHA512", user, password)
            answers[user] = (r["opcode"], r["status"], r["value"])
    assert answers["ada"] == (SASL_STEP, AUTH_ERROR, b"Auth failure")
    assert answers["nobody"] == answers["ada"] == answers["old"]
    warning = "config: users.old: no SCRAM-SHA512, SCRAM-SHA256, SCRAM-SHA1 credentials; SDK logins"
    assert any(warning in line for line in node.lines), "sluice serve logs it at start"
    # An unknown user's salt and iteration count are as stable as a real one's.
    with fresh(node) as s:
        one = start(s, "SCRAM-SHA256", "nobody")["value"]
        two = start(s, "SCRAM-SHA256", "nobody")["value"]
        other = start(s, "SCRAM-SHA256", "nobody2")["value"]
    salt = lambda v: v.split(b",", 1)[1]  # noqa: E731
    assert salt(one) == salt(two) != salt(other) and one.endswith(b",i=1000")
    assert node.metric("sluice_auth_failures_total") >= 3


def test_steps_out_of_order_and_a_wrong_nonce_are_refused(node):
    with fresh(node) as s:
        r = step(s, "SCRAM-SHA512", b"c=biws,r=abc,p=AAAA")
        assert r["status"] == AUTH_ERROR and b"without a SCRAM exchange" in r["value"]
        client = Scram("SCRAM-SHA256", "ada", "ada-secret")
        s.sendall(request(SASL_AUTH, b"SCRAM-SHA256", client.first()))
        first = read_response(s)
        r = step(s, "SCRAM-SHA512", client.final(first["value"]))
        assert r["status"] == AUTH_ERROR and b"exchange under way is SCRAM-SHA256" in r["value"]
        # The exchange ended with that refusal: a second STEP has nothing to continue.
        r = step(s, "SCRAM-SHA256", client.final(first["value"]))
        assert r["status"] == AUTH_ERROR and b"without a SCRAM exchange" in r["value"]
        s.sendall(request(SASL_AUTH, b"SCRAM-SHA256", client.first()))
        first = read_response(s)
        r = step(s, "SCRAM-SHA256", client.final(first["value"], nonce="c nonce 0123forged"))
        assert r["status"] == AUTH_ERROR and b"nonce" in r["value"]
        # Still usable: a proper login afterwards.
        assert scram_login(s, "SCRAM-SHA256", "ada", "ada-secret")["status"] == 0
        r = step(s, "SCRAM-SHA256", client.final(first["value"]))
        assert r["status"] == AUTH_ERROR, "a STEP after a finished login"


@pytest.mark.parametrize(
    ("auth", "final", "why"),
    [
        (b"n,,r=abc", None, b"the user (n=) comes first"),
        (b"n,,n=ada", None, b"the nonce (r=)"),
        (b"p=tls-unique,,n=ada,r=abc", None, b"channel binding"),
        (b"n,,n=a=zz,r=abc", None, b"=2C or =3D"),
        (b"\xff\xfe", None, b"not UTF-8"),
        (b"", None, b"expected n,,n=USER,r=NONCE"),
        (None, b"c=biws,r=abc", b"no proof"),
        (None, b"c=biws,r={nonce},p=AAAA", b"length"),
        (None, b"c=biws,r={nonce},p=***", b"not base64"),
        (None, b"c=eSws,r={nonce},p=AAAA", b"GS2 header"),
        (None, b"", b"no proof"),
    ],
)
def test_malformed_messages_get_auth_error_with_a_reason(node, auth, final, why):
    with fresh(node) as s:
        if auth is not None:
            s.sendall(request(SASL_AUTH, b"SCRAM-SHA512", auth))
        else:
            nonce = start(s, "SCRAM-SHA512", f"malformed{next(_sources)}")["value"].split(b",")[0][2:]
            s.sendall(request(SASL_STEP, b"SCRAM-SHA512", final.replace(b"{nonce}", nonce)))
        r = read_response(s)
        assert r["status"] == AUTH_ERROR and why in r["value"], r
        s.sendall(request(NOOP))
        assert read_response(s)["status"] == 0, "the connection goes on"


def test_a_failed_proof_is_slowed_down_like_a_wrong_plain_password(node):
    import time

    with fresh(node) as s:
        before = node.metric("sluice_auth_failures_total")
        assert scram_login(s, "SCRAM-SHA1", "throttled", "x")["status"] == AUTH_ERROR
        assert start(s, "SCRAM-SHA1", "throttled")["status"] == AUTH_CONTINUE, "the first message waits not"
        t = time.monotonic()
        r = step(s, "SCRAM-SHA1", b"c=biws,r=x,p=AAAA")
        assert r["status"] == AUTH_ERROR and time.monotonic() - t > 0.05, "the proof waits its turn"
        assert node.metric("sluice_auth_failures_total") == before + 2


def test_a_node_without_users_lets_every_login_in(tmp_path):
    n = Node(tmp_path / "d")
    try:
        with connect(n) as s:
            for mechanism in MECHANISMS:
                # Couchbase's SDKs take a SUCCESS to the first message as the end of the login.
                r = start(s, mechanism, "anyone")
                assert (r["status"], r["value"]) == (0, b"Authenticated"), mechanism
            assert login(s, "", "") == 0
            assert login(s, "who", "ever") == 0
            r = step(s, "SCRAM-SHA512", b"c=biws,r=x,p=AAAA")
            assert r["status"] == AUTH_ERROR and b"without a SCRAM exchange" in r["value"]
            s.sendall(request(SASL_AUTH, b"CRAM-MD5", b"x"))
            r = read_response(s)
            assert r["status"] == AUTH_ERROR and b"unknown mechanism" in r["value"]
            s.sendall(request(SASL_LIST_MECHS))
            assert read_response(s)["value"] == b"SCRAM-SHA512 SCRAM-SHA256 SCRAM-SHA1 PLAIN"
    finally:
        assert n.stop() == 0


def sluice_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def test_user_hash_output_is_a_working_user(tmp_path):
    r = sluice_cli("user", "hash", stdin="pa ss\n")
    assert r.returncode == 0 and "pa ss" not in r.stdout, r.stderr
    lines = r.stdout.splitlines()
    # The SCRAM keys, then iproto's chap-sha1 hash (sha1(sha1(password)), as Tarantool stores it).
    assert [line.split(" = ")[0] for line in lines] == [
        "scram_sha512",
        "scram_sha256",
        "scram_sha1",
        "chap_sha1",
    ]
    assert all(
        line.split('"')[1].startswith(line.split(" = ")[0].replace("_", "-") + ":100000:")
        for line in lines[:3]
    )
    chap = hashlib.sha1(hashlib.sha1(b"pa ss").digest()).hexdigest()
    assert lines[3] == f'chap_sha1 = "{chap}"'
    cfg = tmp_path / "sluice.toml"
    cfg.write_text("[users.eve]\n" + r.stdout + 'buckets = { default = ["read"] }\n')
    check = sluice_cli("config", "check", str(cfg))
    assert check.returncode == 0 and "warning" not in check.stderr, check.stderr
    n = Node(tmp_path / "d", "--config", str(cfg))
    try:
        with connect(n) as s:
            assert scram_login(s, "SCRAM-SHA512", "eve", "pa ss")["status"] == 0
            assert login(s, "eve", "pa ss") == 0
    finally:
        assert n.stop() == 0


def test_config_check_warns_of_a_user_without_scram_keys_and_refuses_one_without_any(tmp_path):
    old = sluice.config.hash_password("x", iterations=1000)
    cfg = tmp_path / "old.toml"
    cfg.write_text(f'[users.ada]\npassword_hash = "{old}"\n')
    r = sluice_cli("config", "check", str(cfg))
    assert r.returncode == 0, r.stderr
    assert (
        "users.ada: no SCRAM-SHA512, SCRAM-SHA256, SCRAM-SHA1 credentials; SDK logins with the "
        "default authenticator will fail: run sluice user hash"
    ) in r.stderr
    creds = sluice.config.user_credentials("x", iterations=1000)
    cfg.write_text(f'[users.ada]\nscram_sha512 = "{creds["scram_sha512"]}"\n')
    r = sluice_cli("config", "check", str(cfg))
    assert r.returncode == 0 and "users.ada: no SCRAM-SHA256, SCRAM-SHA1 credentials; clients" in r.stderr
    cfg.write_text('[users.ada]\nbuckets = { default = ["read"] }\n')
    r = sluice_cli("config", "check", str(cfg))
    assert r.returncode == 2 and "users.ada: no credentials" in r.stderr, r.stderr
    cfg.write_text(f'[users.ada]\nscram_sha256 = "{creds["scram_sha512"]}"\n')
    r = sluice_cli("config", "check", str(cfg))
    assert r.returncode == 2 and "users.ada.scram_sha256: expected scram-sha256:" in r.stderr, r.stderr
