"""The memcached binary protocol on the wire, written from BinaryProtocol.md's layouts, not from
sluice's encoder: the 24-byte header, requests as bytes (plain and with flexible framing extras),
frames read off a socket. Shared by every test that talks to a `sluice serve` byte for byte."""

from __future__ import annotations

import socket
import struct

HEADER = struct.Struct(">BBHBBHIIQ")  # magic, opcode, keylen, extlen, datatype, vb/status, body, opaque, cas

GET, SET, ADD, DELETE, INCR, FLUSH, NOOP, VERSION, GETK, GETKQ, SETQ, STAT, HELLO = (
    0x00,
    0x01,
    0x02,
    0x04,
    0x05,
    0x08,
    0x0A,
    0x0B,
    0x0C,
    0x0D,
    0x11,
    0x10,
    0x1F,
)
SASL_LIST_MECHS, SASL_AUTH, SASL_STEP, GET_ALL_VB_SEQNOS, GET_REPLICA = 0x20, 0x21, 0x22, 0x48, 0x83
AUTH_ERROR, AUTH_CONTINUE = 0x20, 0x21
GET_LOCKED, UNLOCK_KEY, GET_META = 0x94, 0x95, 0xA0
# Sub-document commands (kv_engine docs/SubDocument.md).
(
    SUBDOC_GET,
    SUBDOC_EXISTS,
    SUBDOC_DICT_ADD,
    SUBDOC_DICT_UPSERT,
    SUBDOC_DELETE,
    SUBDOC_REPLACE,
    SUBDOC_ARRAY_PUSH_LAST,
    SUBDOC_ARRAY_PUSH_FIRST,
    SUBDOC_ARRAY_INSERT,
    SUBDOC_ARRAY_ADD_UNIQUE,
    SUBDOC_COUNTER,
    SUBDOC_MULTI_LOOKUP,
    SUBDOC_MULTI_MUTATION,
    SUBDOC_GET_COUNT,
    SUBDOC_REPLACE_BODY_WITH_XATTR,
) = range(0xC5, 0xD4)
PATH_MKDIR_P, PATH_XATTR = 0x01, 0x04
DOC_MKDOC, DOC_ADD, DOC_ACCESS_DELETED = 0x01, 0x02, 0x04


def request(
    opcode: int,
    key: bytes = b"",
    value: bytes = b"",
    extras: bytes = b"",
    opaque: int = 0,
    vbucket: int = 0,
    cas: int = 0,
    magic: int = 0x80,
) -> bytes:
    body = len(extras) + len(key) + len(value)
    return (
        HEADER.pack(magic, opcode, len(key), len(extras), 0, vbucket, body, opaque, cas)
        + extras
        + key
        + value
    )


def flex_request(
    opcode: int, framing: bytes, key: bytes, value: bytes, extras: bytes, opaque: int = 0
) -> bytes:
    """Magic 0x08: byte 2 holds the framing extras' length, byte 3 the key length."""
    body = len(framing) + len(extras) + len(key) + len(value)
    head = struct.pack(
        ">BBBBBBHIIQ", 0x08, opcode, len(framing), len(key), len(extras), 0, 0, body, opaque, 0
    )
    return head + framing + extras + key + value


def durability_framing(level: int = 1, timeout_ms: int | None = None) -> bytes:
    """The durability frame info (id 1): level 1 majority, 2 majority and persist on the active,
    3 persist to majority; with a timeout, 2 more bytes."""
    info = bytes([level]) if timeout_ms is None else bytes([level]) + struct.pack(">H", timeout_ms)
    return bytes([0x10 | len(info)]) + info


def read_frame(sock: socket.socket) -> dict:
    """One frame: `word` is the vbucket of a request and the status of a response."""
    head = recv_exact(sock, 24)
    magic, opcode, keylen, extlen, datatype, word, body, opaque, cas = HEADER.unpack(head)
    payload = recv_exact(sock, body)
    return {
        "magic": magic,
        "opcode": opcode,
        "word": word,
        "opaque": opaque,
        "cas": cas,
        "datatype": datatype,
        "extras": payload[:extlen],
        "key": payload[extlen : extlen + keylen],
        "value": payload[extlen + keylen :],
        "size": 24 + body,
        "raw": head + payload,
    }


def read_response(sock: socket.socket) -> dict:
    """One frame read as a response: its header's vbucket field is the `status`."""
    frame = read_frame(sock)
    frame["status"] = frame.pop("word")
    return frame


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def connect(node) -> socket.socket:
    """A client socket to a node's memcached port (anything with `host` and `port`)."""
    return socket.create_connection((node.host, node.port), timeout=10)


def subdoc(
    opcode: int,
    key: bytes,
    path: bytes,
    value: bytes = b"",
    flags: int = 0,
    expiry: int | None = None,
    doc_flags: int | None = None,
    cas: int = 0,
) -> bytes:
    """A single-path sub-document request: extras are the path length, the path flags, then
    the expiry and the doc flags when given; the body is key, path, value."""
    extras = struct.pack(">HB", len(path), flags)
    if expiry is not None:
        extras += struct.pack(">I", expiry)
    if doc_flags is not None:
        extras += bytes([doc_flags])
    return request(opcode, key, path + value, extras, cas=cas)


def lookup_spec(opcode: int, path: bytes, flags: int = 0) -> bytes:
    """One MULTI_LOOKUP spec: opcode, flags, path length (u16), path."""
    return struct.pack(">BBH", opcode, flags, len(path)) + path


def mutation_spec(opcode: int, path: bytes, value: bytes = b"", flags: int = 0) -> bytes:
    """One MULTI_MUTATION spec: opcode, flags, path length (u16), value length (u32), path,
    value."""
    return struct.pack(">BBHI", opcode, flags, len(path), len(value)) + path + value


def lookup_results(body: bytes) -> list[tuple[int, bytes]]:
    """A MULTI_LOOKUP reply's results: (status, value) for each spec."""
    out, at = [], 0
    while at < len(body):
        st, n = struct.unpack_from(">HI", body, at)
        out.append((st, body[at + 6 : at + 6 + n]))
        at += 6 + n
    return out


def set_extras(flags: int = 0, expiry: int = 0) -> bytes:
    return struct.pack(">II", flags, expiry)


def sasl_plain(user: str, password: str) -> bytes:
    """SASL_AUTH with the PLAIN mechanism: NUL, user, NUL, password."""
    return request(SASL_AUTH, b"PLAIN", f"\0{user}\0{password}".encode())


def login(sock: socket.socket, user: str, password: str) -> int:
    """SASL PLAIN on `sock`; the status of the answer."""
    sock.sendall(sasl_plain(user, password))
    return read_response(sock)["status"]


class Scram:
    """The client's side of SCRAM (RFC 5802), written from the RFC's formulas with hashlib and
    hmac, not from sluice's server: the client-first message, the client-final one for a
    server-first message, and the server signature the client expects."""

    HASHES = {"SCRAM-SHA512": "sha512", "SCRAM-SHA256": "sha256", "SCRAM-SHA1": "sha1"}

    def __init__(self, mechanism: str, user: str, password: str, nonce: str = "c nonce 0123") -> None:
        self.mechanism, self.hash = mechanism, self.HASHES[mechanism]
        self.password = password
        name = user.replace("=", "=3D").replace(",", "=2C")
        self.first_bare = f"n={name},r={nonce}"
        self.expected_signature = b""

    def first(self) -> bytes:
        return b"n,," + self.first_bare.encode()

    def final(self, server_first: bytes, nonce: str | None = None) -> bytes:
        """The client-final message; `nonce` replaces the combined nonce the server sent."""
        import base64
        import hashlib
        import hmac

        attrs = dict(a.split("=", 1) for a in server_first.decode().split(","))
        salted = hashlib.pbkdf2_hmac(
            self.hash, self.password.encode(), base64.b64decode(attrs["s"]), int(attrs["i"])
        )
        client_key = hmac.digest(salted, b"Client Key", self.hash)
        without_proof = f"c=biws,r={attrs['r'] if nonce is None else nonce}"
        auth = f"{self.first_bare},{server_first.decode()},{without_proof}".encode()
        signature = hmac.digest(hashlib.new(self.hash, client_key).digest(), auth, self.hash)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        server_key = hmac.digest(salted, b"Server Key", self.hash)
        self.expected_signature = b"v=" + base64.b64encode(hmac.digest(server_key, auth, self.hash))
        return f"{without_proof},p={base64.b64encode(proof).decode()}".encode()


def scram_login(sock: socket.socket, mechanism: str, user: str, password: str) -> dict:
    """A whole SCRAM login on `sock`: the last reply (AUTH's when it is not AUTH_CONTINUE, else
    STEP's). A successful one must carry the server signature the client computed."""
    client = Scram(mechanism, user, password)
    sock.sendall(request(SASL_AUTH, mechanism.encode(), client.first()))
    first = read_response(sock)
    if first["status"] != AUTH_CONTINUE:
        return first
    sock.sendall(request(SASL_STEP, mechanism.encode(), client.final(first["value"])))
    last = read_response(sock)
    if last["status"] == 0:
        assert last["value"] == client.expected_signature, "the server's signature does not verify"
    return last


def get_many(host: str, port: int, keys: list[bytes]) -> dict[bytes, bytes]:
    """GETK of every key, pipelined: key -> value for those found."""
    found: dict[bytes, bytes] = {}
    with socket.create_connection((host, port)) as s:
        s.settimeout(60)
        for at in range(0, len(keys), 500):
            chunk = keys[at : at + 500]
            s.sendall(b"".join(request(GETK, k, opaque=i) for i, k in enumerate(chunk)))
            for _ in chunk:
                r = read_response(s)
                if r["status"] == 0:
                    found[r["key"]] = r["value"]
    return found
