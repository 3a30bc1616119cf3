"""TLS on a real `sluice serve`: the TLS KV listener (Python's ssl client doing SASL, SET and
GET), a plain-text client on it, the certificate reloaded on SIGHUP, a replica following its
active over TLS with the active's certificate verified (and a client certificate), and the
admin endpoint over HTTPS with `sluice status --cacert`.

Certificates are made here with the `cryptography` package: a CA, and leaf certificates for
localhost and 127.0.0.1 with chosen serials. pylibmc is not tested over TLS: libmemcached has
no TLS support."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import bmemcached
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from helpers import NO_DEFAULT_PORTS, NUM_VBUCKETS, Node, node_config, run_cli, write_users_config
from mcbp_wire import GET, NOOP, SET, login, read_response, request, set_extras


class Pki:
    """A CA in `root` that issues leaf certificates as PEM files."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.name = subject
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.ca_file = root / f"{name}-ca.pem"
        self.ca_file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, stem: str, serial: int) -> tuple[Path, Path]:
        """A certificate for localhost and 127.0.0.1 (server and client use) in STEM.pem, its key
        in STEM.key."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        cert_file, key_file = self.root / f"{stem}.pem", self.root / f"{stem}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert_file, key_file


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path, "sluice-test")


def tls_config(cert: Path, key: Path, extra: str = "") -> str:
    return f'tls_listen = "127.0.0.1:0"\n[tls]\ncertificate = "{cert}"\nkey = "{key}"\n{extra}'


def tls_address(node: Node) -> tuple[str, int]:
    ready = next(line for line in node.lines if "sluice ready" in line)
    host, _, port = ready.split("(TLS ")[1].split(")")[0].rpartition(":")
    return host, int(port)


def tls_connect(node: Node, cafile: Path) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(cafile))
    raw = socket.create_connection(tls_address(node), timeout=10)
    return context.wrap_socket(raw, server_hostname="localhost")


def serial_of(s: ssl.SSLSocket) -> int:
    return x509.load_der_x509_certificate(s.getpeercert(binary_form=True)).serial_number


def test_sasl_set_and_get_over_tls_and_a_plain_client_on_the_tls_port(tmp_path, pki):
    cert, key = pki.issue("server", 1001)
    cfg = tmp_path / "sluice.toml"
    write_users_config(cfg, '["read"]')
    cfg.write_text(tls_config(cert, key, "admin = false\n") + "\n" + cfg.read_text())
    node = Node(tmp_path / "d", "--config", str(cfg))
    try:
        with tls_connect(node, pki.ca_file) as s:
            assert s.version() in ("TLSv1.2", "TLSv1.3")
            assert serial_of(s) == 1001
            assert login(s, "ada", "wrong") == 0x0020
            assert login(s, "ada", "ada-secret") == 0
            # Pipelined: both requests in one TLS write, both answers in order.
            s.sendall(request(SET, b"k", b"over tls", set_extras(flags=7)) + request(GET, b"k"))
            assert read_response(s)["status"] == 0
            r = read_response(s)
            assert (r["status"], r["value"], r["extras"]) == (0, b"over tls", b"\0\0\0\7")
        # A plain-text client on the TLS port: closed at its first bytes, the server goes on.
        with socket.create_connection(tls_address(node), timeout=10) as raw:
            raw.sendall(request(NOOP))
            answer = b""
            while chunk := raw.recv(4096):
                answer += chunk
            assert not answer.startswith(b"\x81"), "no memcached answer in plain text"
            assert answer == b"" or answer[0] == 0x15, f"a TLS alert or nothing, got {answer[:8]!r}"
        node.wait_for("TLS handshake failed")
        with tls_connect(node, pki.ca_file) as s:
            assert login(s, "ada", "ada-secret") == 0
            s.sendall(request(GET, b"k"))
            assert read_response(s)["value"] == b"over tls"
        # The plain listener is untouched: the same item, in plain text.
        with socket.create_connection((node.host, node.port), timeout=10) as s:
            assert login(s, "ada", "ada-secret") == 0
            s.sendall(request(GET, b"k"))
            assert read_response(s)["value"] == b"over tls"
        with urllib.request.urlopen(f"http://{node.admin}/metrics", timeout=10) as r:
            assert "sluice_tls_handshake_failures_total 1" in r.read().decode()
    finally:
        assert node.stop() == 0, "".join(node.lines)[-2000:]


def test_sighup_gives_new_connections_the_new_certificate_and_keeps_it_on_a_bad_file(tmp_path, pki):
    cert, key = pki.issue("server", 1001)
    cfg = tmp_path / "sluice.toml"
    cfg.write_text(tls_config(cert, key))
    node = Node(tmp_path / "d", "--config", str(cfg))
    try:
        old = tls_connect(node, pki.ca_file)
        assert serial_of(old) == 1001
        pki.issue("server", 2002)  # same paths, new certificate and key
        node.proc.send_signal(signal.SIGHUP)
        node.wait_for("TLS certificate and key read again")
        with tls_connect(node, pki.ca_file) as s:
            assert serial_of(s) == 2002
        # The connection opened before the reload still works.
        old.sendall(request(NOOP))
        assert read_response(old)["status"] == 0
        old.close()
        key.write_text("not a key\n")
        node.proc.send_signal(signal.SIGHUP)
        line = node.wait_for("keeping the TLS certificate in use")
        assert "tls.key" in line and str(key) in line, line
        with tls_connect(node, pki.ca_file) as s:
            assert serial_of(s) == 2002
    finally:
        assert node.stop() == 0, "".join(node.lines)[-2000:]


@pytest.mark.parametrize(
    "toml, reason",
    [
        ('[tls]\ncertificate = "{missing}"\nkey = "{key}"\n', "tls.certificate: cannot read"),
        ('[tls]\ncertificate = "{cert}"\nkey = "{cert}"\n', "tls.key:"),
        ('[tls]\ncertificate = "{cert}"\n', "tls.key: required with tls.certificate"),
        ('tls_listen = "127.0.0.1:0"\n', "tls_listen: set, but no certificate"),
        ("[replication]\ntls = true\n", "replication.ca: required"),
        ('[replication]\ntls = true\nca = "{missing}"\n', "replication.ca: cannot read"),
    ],
)
def test_a_bad_tls_configuration_is_refused_with_the_key(tmp_path, pki, toml, reason):
    cert, key = pki.issue("server", 1)
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml.format(cert=cert, key=key, missing=tmp_path / "missing.pem"))
    r = run_cli("serve", "--config", str(cfg), "--data-dir", str(tmp_path / "d"), *NO_DEFAULT_PORTS)
    assert r.returncode == 2, r.stderr
    assert reason in r.stderr, r.stderr


def https_status(node: Node, cafile: Path) -> dict:
    context = ssl.create_default_context(cafile=str(cafile))
    with urllib.request.urlopen(f"{node.admin}/status", timeout=10, context=context) as r:
        return json.load(r)


def test_a_replica_follows_its_active_over_tls_and_refuses_an_untrusted_one(tmp_path, pki):
    server_cert, server_key = pki.issue("active", 11)
    client_cert, client_key = pki.issue("replica", 12)
    rogue = Pki(tmp_path, "rogue")
    # The active asks every TLS client for a certificate signed by the test CA.
    active_config = node_config(tmp_path, "a")
    active_config.write_text(
        tls_config(server_cert, server_key, f'client_ca = "{pki.ca_file}"\n') + active_config.read_text()
    )
    active = Node(tmp_path / "a", "--config", str(active_config))
    assert active.admin.startswith("https://")
    tls_port = f"127.0.0.1:{tls_address(active)[1]}"
    replication = (
        f'[replication]\ntls = true\nca = "{pki.ca_file}"\n'
        f'certificate = "{client_cert}"\nkey = "{client_key}"\n'
    )
    replica = Node(
        tmp_path / "b",
        "--config",
        str(node_config(tmp_path, "b", extra=replication)),
        "--replica-of",
        tls_port,
    )
    untrusting = Node(
        tmp_path / "c",
        "--config",
        str(node_config(tmp_path, "c", extra=f'[replication]\ntls = true\nca = "{rogue.ca_file}"\n')),
        "--replica-of",
        tls_port,
    )
    try:
        bmemcached.Client([active.address]).set_multi({f"k{i}": f"v{i}" for i in range(200)})
        # wait_converged reads /status over plain HTTP; the active serves HTTPS.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            a = [v["high_seqno"] for v in https_status(active, pki.ca_file)["buckets"][0]["vbuckets"]]
            with urllib.request.urlopen(f"http://{replica.admin}/status", timeout=10) as r:
                b = [v["high_seqno"] for v in json.load(r)["buckets"][0]["vbuckets"]]
            if a == b and sum(a) == 200:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"no convergence over TLS: {a} vs {b}")
        assert len(a) == NUM_VBUCKETS
        with urllib.request.urlopen(f"http://{replica.admin}/status", timeout=10) as r:
            assert json.load(r)["replication"]["replica_of"] == tls_port
        line = untrusting.wait_for("invalid peer certificate")
        assert "UnknownIssuer" in line, line
        with urllib.request.urlopen(f"http://{untrusting.admin}/status", timeout=10) as r:
            assert sum(v["high_seqno"] for v in json.load(r)["buckets"][0]["vbuckets"]) == 0
        # A client of the TLS port without a certificate is refused by the active.
        context = ssl.create_default_context(cafile=str(pki.ca_file))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with context.wrap_socket(
                socket.create_connection(tls_address(active), timeout=10), server_hostname="localhost"
            ) as s:
                s.sendall(request(NOOP))
                read_response(s)
    finally:
        for n in (untrusting, replica, active):
            assert n.stop() == 0, "".join(n.lines)[-2000:]


def test_admin_over_https_with_sluice_status_and_cacert(tmp_path, pki):
    cert, key = pki.issue("server", 5)
    cfg = tmp_path / "sluice.toml"
    cfg.write_text(tls_config(cert, key))
    node = Node(tmp_path / "d", "--config", str(cfg))
    try:
        assert node.admin.startswith("https://127.0.0.1:")
        r = run_cli(
            "status", "--admin", node.admin, "--cacert", str(pki.ca_file), "--data-dir", str(tmp_path / "d")
        )
        assert r.returncode == 0, r.stderr
        assert f"listening on {node.address}" in r.stdout
        # Without the CA the node's certificate is not trusted: a clear failure, exit 1.
        r = run_cli("status", "--admin", node.admin, "--data-dir", str(tmp_path / "d"))
        assert r.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in r.stderr, r.stderr
        # The configuration alone tells the CLI to use HTTPS on admin_listen.
        port = node.admin.rsplit(":", 1)[1]
        cfg.write_text(
            cfg.read_text().replace('tls_listen = "127.0.0.1:0"\n', f'admin_listen = "127.0.0.1:{port}"\n')
        )
        r = run_cli(
            "status", "--config", str(cfg), "--cacert", str(pki.ca_file), "--data-dir", str(tmp_path / "d")
        )
        assert r.returncode == 0, r.stderr
        # Plain HTTP to the HTTPS endpoint gets no HTTP answer (a TLS alert at most).
        with pytest.raises((OSError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://{node.admin.removeprefix('https://')}/status", timeout=10)
        assert https_status(node, pki.ca_file)["tls_listen"] == "{}:{}".format(*tls_address(node))
    finally:
        assert node.stop() == 0, "".join(node.lines)[-2000:]


def test_every_front_speaks_tls_on_a_port_of_its_own(tmp_path, pki):
    """iproto, TANK and Greenstack each get a TLS listener with the node's certificate: a
    handshake with openssl s_client verifies it on every port, and each front's own clients
    work through it: sluice's Client (items and a DCP stream), GreenstackClient, TankConnection
    and tarantool-python's SSL transport."""
    tarantool = pytest.importorskip("tarantool")
    from iproto_helpers import SPACES, USERS, host_port, user_table
    from sluice import Client, GreenstackClient
    from sluice.tank import TankConnection

    cert, key = pki.issue("server", 2001)
    cfg = tmp_path / "sluice.toml"
    cfg.write_text(
        'tls_listen = "127.0.0.1:0"\niproto_tls_listen = "127.0.0.1:0"\ntank_tls_listen = "127.0.0.1:0"\n'
        'greenstack_tls_listen = "127.0.0.1:0"\n'
        f'[tls]\ncertificate = "{cert}"\nkey = "{key}"\nadmin = false\n'
        + SPACES
        + USERS
        + 'topics = { "*" = ["read", "write", "admin"] }\n'
        + "[buckets.default]\nnum_vbuckets = 4\n"
        + user_table("root", "root-secret", '{ "*" = ["read", "write", "stream", "admin"] }')
    )
    node = Node(tmp_path / "d", "--config", str(cfg))
    try:
        fronts = node.status()["fronts"]
        tls = {name: f["tls_listen"] for name, f in fronts.items()}
        assert set(tls) == {"memcached", "iproto", "tank", "greenstack"}, fronts
        assert all(tls.values()), fronts
        assert len(set(tls.values()) | {f["listen"] for f in fronts.values()}) == 8, "a port each"
        assert node.tls_fronts == {
            "iproto": tls["iproto"],
            "TANK": tls["tank"],
            "Greenstack": tls["greenstack"],
        }
        # openssl s_client checks each handshake and certificate, where it is installed.
        for name, address in tls.items() if shutil.which("openssl") else ():
            r = subprocess.run(
                [
                    "openssl",
                    "s_client",
                    "-connect",
                    address,
                    "-CAfile",
                    str(pki.ca_file),
                    "-verify_return_error",
                ],
                input="",
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert "Verify return code: 0 (ok)" in r.stdout, (name, r.stdout[-2000:], r.stderr[-2000:])
        ca = str(pki.ca_file)
        with Client(tls["memcached"], username="root", password="root-secret", cafile=ca) as c:
            c.set(b"k", b"over tls")
            assert c.get(b"k").value == b"over tls"
            with c.stream(start="beginning", end="now", format="python") as stream:
                keys = [change.key for batch in stream for change in batch]
            assert b"k" in keys
        with GreenstackClient(tls["greenstack"], username="root", password="root-secret", cafile=ca) as g:
            g.set(b"g", b"greenstack over tls")
            assert g.get(b"g").value == b"greenstack over tls"
        with TankConnection(tls["tank"], cafile=ca) as t:
            t.create_topic("events", partitions=1)
            t.produce("events", [b"one", b"two"])
            assert [m.content for m in t.consume("events", 0, 0).messages] == [b"one", b"two"]
        host, port = host_port(tls["iproto"])
        conn = tarantool.Connection(
            host, port, user="app", password="secret", transport="ssl", ssl_ca_file=ca
        )
        try:
            conn.insert("users", (1, "ada", 36))
            assert conn.select("users", 1).data == [[1, "ada", 36]]
        finally:
            conn.close()
        # Plain text on a TLS port gets no protocol answer, and the port goes on.
        with socket.create_connection(host_port(tls["tank"]), timeout=10) as raw:
            raw.sendall(b"\x00" * 16)
            answer = b""
            while chunk := raw.recv(4096):
                answer += chunk
            assert answer == b"" or answer[0] == 0x15, answer[:8]
        node.wait_for("closing TLS TANK connection")
    finally:
        assert node.stop() == 0, "".join(node.lines)[-2000:]


def test_a_self_signed_certificate_marked_ca_is_trusted_when_it_is_the_one_given(tmp_path, pki):
    """`openssl req -x509`'s default certificate is self-signed with CA:TRUE: OpenSSL's clients,
    curl and Couchbase's SDKs take it when given it as the CA, and so do sluice's own clients
    (`sluice bench --cacert`), which WebPKI alone would refuse as a CA used as a server's."""
    key_file = tmp_path / "self.key"
    key_file.write_bytes(
        pki.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    cfg = tmp_path / "n.toml"
    cfg.write_text(tls_config(pki.ca_file, key_file))
    node = Node(tmp_path / "d", "--config", str(cfg))
    try:
        host, port = tls_address(node)
        r = run_cli("bench", "--server", f"{host}:{port}", "--cacert", str(pki.ca_file), "--duration", "0.3")
        assert r.returncode == 0 and "errors 0" in r.stdout, r.stdout + r.stderr
        # Another certificate in its place is still refused.
        (tmp_path / "other").mkdir()
        other = Pki(tmp_path / "other", "someone-else")
        server = f"{host}:{port}"
        r = run_cli("bench", "--server", server, "--cacert", str(other.ca_file), "--duration", "0.3")
        assert r.returncode != 0, r.stdout
    finally:
        node.stop()


def test_tls_init_writes_a_ca_and_a_node_certificate_that_serve_and_verify(tmp_path):
    out = tmp_path / "tls"
    r = run_cli("tls", "init", "--dir", str(out), "--name", "localhost", "--ip", "127.0.0.1")
    assert r.returncode == 0, r.stderr
    assert f'certificate = "{out / "node.pem"}"' in r.stdout and f'key = "{out / "node-key.pem"}"' in r.stdout
    for key in ("ca-key.pem", "node-key.pem"):
        assert (out / key).stat().st_mode & 0o777 == 0o600, key
    cert = x509.load_pem_x509_certificate((out / "node.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # Files already there are kept unless --force.
    again = run_cli("tls", "init", "--dir", str(out))
    assert again.returncode == 1 and "--force" in again.stderr and again.stderr.count("\n") == 1
    # A node serves with them; a client that trusts the CA verifies it by name and address.
    config = tmp_path / "sluice.toml"
    config.write_text(tls_config(out / "node.pem", out / "node-key.pem"))
    node = Node(tmp_path / "n", "--config", str(config))
    try:
        context = ssl.create_default_context(cafile=str(out / "ca.pem"))
        for host in ("localhost", "127.0.0.1"):
            with socket.create_connection(tls_address(node)) as raw:
                with context.wrap_socket(raw, server_hostname=host) as s:
                    assert s.version() in ("TLSv1.2", "TLSv1.3")
    finally:
        assert node.stop() == 0
