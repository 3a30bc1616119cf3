"""A small client of etcd's v3 API over its JSON gateway (HTTP, or HTTPS with a CA): keys and
ranges, transactions that compare revisions, leases, and watches. It holds no connection
between calls (a request is one short HTTP exchange) and tries the endpoints in turn, so one
etcd member down costs a retry, not a failure."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# What a member answers while the members elect a leader, or when it lost its own: another try
# (on another member) may succeed.
TRANSIENT = ("leader changed", "no leader", "request timed out", "too many requests", "not capable")


AUTHENTICATE = "/v3/auth/authenticate"

# What a member answers a request whose token expired or is missing: log in (again) and retry.
LOGIN_NEEDED = ("token", "auth", "user name is empty")


class EtcdError(Exception):
    """etcd could not be reached, or refused the request."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int

    def json(self) -> Any:
        return json.loads(self.value)


@dataclass(frozen=True)
class Event:
    """A watched key changed: put (value given) or deleted."""

    kind: str  # "put" or "delete"
    kv: KeyValue


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _prefix_end(prefix: str) -> str:
    """The key just past every key starting with `prefix` (etcd's range end for a prefix)."""
    raw = bytearray(prefix.encode())
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return _b64(bytes(raw))
        raw.pop()
    return _b64(b"\0")


def _kv(d: dict[str, Any]) -> KeyValue:
    try:
        return KeyValue(
            key=base64.b64decode(d["key"]).decode(),
            value=base64.b64decode(d.get("value", "")),
            create_revision=int(d.get("create_revision", 0)),
            mod_revision=int(d.get("mod_revision", 0)),
            lease=int(d.get("lease", 0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise EtcdError(f"etcd: a key-value not understood ({e!r}): {str(d)[:200]}") from None


def _revision(answer: dict[str, Any]) -> int:
    """The store's revision an answer was given at."""
    try:
        return int(answer["header"]["revision"])
    except (KeyError, TypeError, ValueError):
        raise EtcdError(f"etcd: an answer without its revision: {str(answer)[:200]}") from None


#: The most of one answer (or one watch line) read: past it the answer is refused, not held.
MAX_ANSWER_BYTES = 64 << 20


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    https: bool


def parse_endpoints(text: str) -> list[Endpoint]:
    """`http://h:2379,https://h2:2379` or `h:2379,h2:2379`."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "://" not in part:
            part = "http://" + part
        u = urllib.parse.urlsplit(part)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an etcd endpoint: {part!r} (want http://HOST:PORT)")
        out.append(Endpoint(u.hostname, u.port or 2379, u.scheme == "https"))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


class Etcd:
    def __init__(
        self,
        endpoints: list[Endpoint],
        *,
        username: str | None = None,
        password: str | None = None,
        ca_file: str | None = None,
        timeout: float = 2.0,
    ) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        self._credentials = (username, password) if username else None
        self._token: str | None = None
        self._ssl = ssl.create_default_context(cafile=ca_file) if any(e.https for e in endpoints) else None
        self._preferred = 0

    # -- transport

    def _connect(self, e: Endpoint, timeout: float) -> http.client.HTTPConnection:
        if e.https:
            return http.client.HTTPSConnection(e.host, e.port, timeout=timeout, context=self._ssl)
        return http.client.HTTPConnection(e.host, e.port, timeout=timeout)

    def _send(
        self, path: str, body: dict[str, Any], timeout: float
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Sends to the first endpoint that answers; the one that did is tried first next time."""
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            index = (self._preferred + i) % n
            e = self.endpoints[index]
            conn = self._connect(e, timeout)
            try:
                headers = {"Content-Type": "application/json"}
                if self._token:
                    headers["Authorization"] = self._token
                conn.request("POST", path, json.dumps(body), headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as err:
                conn.close()
                errors.append(f"{e.host}:{e.port}: {err}")
                continue
            self._preferred = index
            return conn, resp
        raise EtcdError("etcd unreachable: " + "; ".join(errors))

    def call(self, path: str, body: dict[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
        """One request; retried (on the next endpoint) while the members elect a leader, and
        once after logging in again when a token expired."""
        deadline = time.monotonic() + (timeout or self.timeout)
        authenticated = False
        if self._credentials and self._token is None and path != AUTHENTICATE:
            self._authenticate()
            authenticated = True
        while True:
            conn, resp = self._send(path, body, timeout or self.timeout)
            try:
                raw = resp.read(MAX_ANSWER_BYTES + 1)
            except (OSError, http.client.HTTPException) as err:
                raise EtcdError(f"etcd: {path}: {err}") from None
            finally:
                conn.close()
            if len(raw) > MAX_ANSWER_BYTES:
                raise EtcdError(f"etcd: {path}: an answer over {MAX_ANSWER_BYTES >> 20} MiB")
            try:
                answer = json.loads(raw or b"{}")
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                raise EtcdError(f"etcd: {path}: HTTP {resp.status}: {raw[:200]!r}")
            if resp.status == 200 and "error" not in answer:
                return answer
            message = answer.get("message") or answer.get("error") or raw[:200].decode("utf-8", "replace")
            # A refused login is the answer itself, not an expired token to log in again for.
            relogin = path != AUTHENTICATE and not authenticated
            if self._credentials and relogin and any(t in message for t in LOGIN_NEEDED):
                self._authenticate()
                authenticated = True
                continue
            if any(t in message for t in TRANSIENT) and time.monotonic() < deadline:
                self._preferred = (self._preferred + 1) % len(self.endpoints)
                time.sleep(0.05)
                continue
            raise EtcdError(f"etcd: {path}: {message}")

    def _authenticate(self) -> None:
        assert self._credentials is not None
        user, password = self._credentials
        self._token = None
        answer = self.call(AUTHENTICATE, {"name": user, "password": password})
        if not isinstance(answer.get("token"), str):
            raise EtcdError(f"etcd: a login answered without a token: {str(answer)[:200]}")
        self._token = answer["token"]

    # -- keys

    def get(self, key: str) -> KeyValue | None:
        kvs = self.call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, and the store's revision when read."""
        a = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        return [_kv(d) for d in a.get("kvs", [])], _revision(a)

    def put(self, key: str, value: str | bytes, *, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return _revision(self.call("/v3/kv/put", body))

    def delete(self, key: str) -> None:
        self.call("/v3/kv/deleterange", {"key": _b64(key)})

    def put_if(
        self, key: str, value: str | bytes, *, mod_revision: int | None = None, lease: int = 0
    ) -> int | None:
        """Puts `value` if the key's mod revision is `mod_revision` (0 or None: the key does not
        exist). Returns the new revision, or None when the key had moved on."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        if mod_revision:
            compare = {"key": _b64(key), "target": "MOD", "mod_revision": str(mod_revision)}
        else:
            compare = {"key": _b64(key), "target": "CREATE", "create_revision": "0"}
        a = self.call("/v3/kv/txn", {"compare": [compare], "success": [{"request_put": put}]})
        return _revision(a) if a.get("succeeded") else None

    # -- leases

    def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be longer than asked)."""
        a = self.call("/v3/lease/grant", {"TTL": str(ttl)})
        return int(a["ID"]), int(a["TTL"])

    def keepalive(self, lease: int) -> int:
        """Renews the lease; returns its TTL, 0 when it has expired."""
        a = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(a.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        try:
            self.call("/v3/kv/lease/revoke", {"ID": str(lease)})
        except EtcdError as e:
            if "not found" not in str(e):
                raise

    # -- watches

    def watch(
        self, prefix: str, start_revision: int, stop: threading.Event, *, idle: float = 1.0
    ) -> Iterator[tuple[list[Event], int]]:
        """Changes under `prefix` from `start_revision` on, as (events, revision) until `stop`
        is set. A connection is held at most `idle` seconds without an event, then opened again
        from the last revision seen, so that `stop` is looked at and a dead member is left."""
        revision = start_revision
        while not stop.is_set():
            body = {
                "create_request": {
                    "key": _b64(prefix),
                    "range_end": _prefix_end(prefix),
                    "start_revision": str(revision),
                }
            }
            try:
                conn, resp = self._send("/v3/watch", body, idle)
            except EtcdError:
                stop.wait(idle)
                continue
            try:
                while not stop.is_set():
                    line = resp.readline(MAX_ANSWER_BYTES + 1)
                    if not line:
                        break
                    if len(line) > MAX_ANSWER_BYTES:
                        raise EtcdError(f"etcd: a watch event over {MAX_ANSWER_BYTES >> 20} MiB")
                    result = _watch_result(line)
                    if result.get("canceled"):
                        # The revisions asked for are compacted away (or the watch was refused):
                        # the caller must read the keys whole again.
                        raise EtcdError(f"etcd canceled the watch: {result.get('cancel_reason') or result}")
                    events = _events(result)
                    if events:
                        revision = _revision(result) + 1
                        yield events, revision - 1
            except (TimeoutError, OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()


def _watch_result(line: bytes) -> dict[str, Any]:
    """The `result` of one line of a watch's stream."""
    try:
        answer = json.loads(line)
    except ValueError:
        raise EtcdError(f"etcd: a watch line not understood: {line[:200]!r}") from None
    result = answer.get("result", {}) if isinstance(answer, dict) else None
    if not isinstance(result, dict):
        raise EtcdError(f"etcd: a watch line not understood: {line[:200]!r}")
    return result


def _events(result: dict[str, Any]) -> list[Event]:
    try:
        return [
            Event("delete" if e.get("type") == "DELETE" else "put", _kv(e["kv"]))
            for e in result.get("events", [])
        ]
    except (AttributeError, KeyError, TypeError):
        raise EtcdError(f"etcd: watch events not understood: {str(result)[:200]}") from None


def parse_cluster_url(url: str) -> tuple[list[Endpoint], str]:
    """`etcd://HOST:PORT[,HOST:PORT]/NAME` (etcds:// for HTTPS) to (endpoints, cluster name)."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("etcd", "etcds"):
        raise ValueError(f"{url!r}: want etcd://HOST:PORT/CLUSTER_NAME")
    name = u.path.strip("/")
    if not name or "/" in name:
        raise ValueError(f"{url!r}: the path names the cluster: etcd://HOST:PORT/CLUSTER_NAME")
    scheme = "https" if u.scheme == "etcds" else "http"
    return parse_endpoints(",".join(f"{scheme}://{h}" for h in u.netloc.split(","))), name
