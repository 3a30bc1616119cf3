"""The users of `[users.NAME]`: their credentials (PBKDF2 password hashes, SCRAM keys,
chap-sha1 for iproto) and per-bucket permissions, and how a password is hashed into them."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any

from sluice.config.values import _fail, _str

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised on older interpreters only
    pass


PERMISSIONS = ("read", "write", "stream", "admin", "replication")
# What a user may be granted on a topic.
TOPIC_PERMISSIONS = ("read", "write", "stream", "admin")


_HASH = re.compile(r"pbkdf2-sha256:\d+:[0-9a-f]{16,}:[0-9a-f]{64}")


# SCRAM credentials per mechanism: [users.NAME] key -> (hashlib name, SASL name, key length).
SCRAM_MECHANISMS = {
    "scram_sha512": ("sha512", "SCRAM-SHA512", 64),
    "scram_sha256": ("sha256", "SCRAM-SHA256", 32),
    "scram_sha1": ("sha1", "SCRAM-SHA1", 20),
}


CREDENTIAL_KEYS = ("password_hash", *SCRAM_MECHANISMS, "chap_sha1")


# Tarantool's chap-sha1 (iproto AUTH) checks against sha1(sha1(password)), hex.
_CHAP_SHA1 = re.compile(r"[0-9a-f]{40}")


# The user an iproto session is before it authenticates: [users.guest] holds only its buckets.
GUEST = "guest"


DEFAULT_ITERATIONS = 100_000


def _scram_form(key: str) -> re.Pattern[str]:
    n = SCRAM_MECHANISMS[key][2] * 2
    return re.compile(rf"{key.replace('_', '-')}:\d+:[0-9a-f]{{16,}}:[0-9a-f]{{{n}}}:[0-9a-f]{{{n}}}")


def _user(name: str, table: Any) -> dict[str, Any]:
    """[users.NAME]: credentials (the output of `sluice user hash`: scram_sha512, scram_sha256,
    scram_sha1; from older configurations password_hash; never a password), buckets, a table of
    bucket name (or "*") to a list of permissions among read, write, stream, admin, replication,
    and topics, a table of topic name (or a prefix ending in "*": "logs.*", or "*") to a list of
    permissions among read, write, stream, admin (TANK's produce needs write, consume read,
    CreateTopic admin; a topic's DCP stream needs stream)."""
    path = f"users.{name}"
    if not re.fullmatch(r"[A-Za-z0-9_.@-]{1,128}", name):
        raise _fail(path, f"user name {name!r} must be 1 to 128 of A-Z a-z 0-9 _ . @ -")
    if not isinstance(table, dict):
        raise _fail(path, f"expected a table, got {type(table).__name__}")
    if "password" in table:
        raise _fail(
            f"{path}.password",
            f"passwords are never stored; put the output of `sluice user hash` under [{path}]",
        )
    if name == GUEST:
        for key in table:
            if key not in ("buckets", "topics"):
                raise _fail(
                    f"{path}.{key}",
                    "guest has no credentials: it is who an iproto session is before AUTH, and "
                    "every TANK connection; [users.guest] takes only buckets and topics",
                )
    for key in table:
        if key not in (*CREDENTIAL_KEYS, "buckets", "topics"):
            raise _fail(
                f"{path}.{key}", f"unknown key (known: {', '.join(CREDENTIAL_KEYS)}, buckets, topics)"
            )
    credentials = {}
    for key in CREDENTIAL_KEYS:
        if key not in table:
            continue
        value = _str(f"{path}.{key}", table[key])
        if key == "password_hash" and not _HASH.fullmatch(value):
            raise _fail(
                f"{path}.{key}", "expected pbkdf2-sha256:ITERATIONS:SALT_HEX:HASH_HEX from `sluice user hash`"
            )
        if key == "chap_sha1" and not _CHAP_SHA1.fullmatch(value):
            raise _fail(
                f"{path}.{key}", "expected 40 hex digits, sha1(sha1(password)), from `sluice user hash`"
            )
        if key in SCRAM_MECHANISMS and not _scram_form(key).fullmatch(value):
            raise _fail(
                f"{path}.{key}",
                f"expected {key.replace('_', '-')}:ITERATIONS:SALT_HEX:STOREDKEY_HEX:SERVERKEY_HEX "
                "from `sluice user hash`",
            )
        credentials[key] = value
    if not credentials and name != GUEST:
        raise _fail(path, f"no credentials: put the output of `sluice user hash` under [{path}]")
    buckets = _grants(
        f"{path}.buckets", table.get("buckets", {}), PERMISSIONS, '{ default = ["read", "write"] }'
    )
    topics = _grants(f"{path}.topics", table.get("topics", {}), TOPIC_PERMISSIONS, '{ "events" = ["read"] }')
    for t in topics:
        if "*" in t[:-1]:
            raise _fail(f"{path}.topics.{t}", 'a "*" may only end the name: a prefix such as "logs.*"')
    return {"credentials": credentials, "buckets": buckets, "topics": topics}


def _grants(path: str, raw: Any, known: tuple[str, ...], example: str) -> dict[str, list[str]]:
    """A table of name to a list of permissions among `known`."""
    if not isinstance(raw, dict):
        raise _fail(path, f"expected a table such as {example}")
    grants = {}
    for name, perms in raw.items():
        if not isinstance(perms, list) or not all(isinstance(p, str) for p in perms):
            raise _fail(f"{path}.{name}", "expected a list of permissions")
        bad = [p for p in perms if p not in known]
        if bad:
            raise _fail(f"{path}.{name}", f"unknown permission {bad[0]!r} (known: {', '.join(known)})")
        grants[name] = list(perms)
    return grants


def _user_warnings(name: str, user: Mapping[str, Any]) -> list[str]:
    """What a user's credentials leave out: SCRAM mechanisms it cannot log in with."""
    missing = [SCRAM_MECHANISMS[k][1] for k in SCRAM_MECHANISMS if k not in user["credentials"]]
    if not missing:
        return []
    if "SCRAM-SHA512" in missing:
        why = "SDK logins with the default authenticator will fail"
    else:
        why = "clients that ask for them will fail"
    return [f"users.{name}: no {', '.join(missing)} credentials; {why}: run sluice user hash"]


def hash_password(password: str, iterations: int = DEFAULT_ITERATIONS) -> str:
    """A password_hash as configurations before SCRAM held it: PBKDF2-HMAC-SHA256 with a random
    16-byte salt (SASL PLAIN and the admin endpoint only)."""
    import hashlib
    import os

    salt = os.urandom(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"pbkdf2-sha256:{iterations}:{salt.hex()}:{digest.hex()}"


def user_credentials(password: str, iterations: int = DEFAULT_ITERATIONS) -> dict[str, str]:
    """What `sluice user hash` prints, [users.NAME] key -> value: per SCRAM mechanism
    `scram-shaN:ITERATIONS:SALT_HEX:STOREDKEY_HEX:SERVERKEY_HEX` (RFC 5802: StoredKey = H(ClientKey),
    ServerKey = HMAC(SaltedPassword, "Server Key"); neither the password nor the salted password),
    each with a random 16-byte salt of its own. PLAIN checks against the SCRAM-SHA512 keys. Then
    `chap_sha1`, the hex of sha1(sha1(password)), which Tarantool's chap-sha1 AUTH checks against
    (as Tarantool stores it: unsalted, so guessable offline by whoever reads the file)."""
    import hashlib
    import hmac
    import os

    out = {}
    for key, (hash_name, _, _) in SCRAM_MECHANISMS.items():
        salt = os.urandom(16)
        salted = hashlib.pbkdf2_hmac(hash_name, password.encode(), salt, iterations)
        stored = hashlib.new(hash_name, hmac.digest(salted, b"Client Key", hash_name)).digest()
        server = hmac.digest(salted, b"Server Key", hash_name)
        scheme = key.replace("_", "-")
        out[key] = f"{scheme}:{iterations}:{salt.hex()}:{stored.hex()}:{server.hex()}"
    out["chap_sha1"] = hashlib.sha1(hashlib.sha1(password.encode()).digest()).hexdigest()
    return out
