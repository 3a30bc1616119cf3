"""What the iproto tests share: a node with two spaces and users for them, and raw iproto
packets for the wire-level tests."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgpack
import sluice
from helpers import Node, start_node

USERS_SPACE = 512
PAIRS_SPACE = 513
NUM_VBUCKETS = 8

# `users`: [id, name, age, ...]; `pairs`: a two-part primary key [a, b].
SPACES = f"""
[buckets.users]
num_vbuckets = {NUM_VBUCKETS}
[buckets.pairs]
num_vbuckets = {NUM_VBUCKETS}

[spaces.users]
id = {USERS_SPACE}
format = [
  {{ name = "id", type = "unsigned" }},
  {{ name = "name", type = "string" }},
  {{ name = "age", type = "unsigned", is_nullable = true }},
]

[spaces.pairs]
id = {PAIRS_SPACE}
format = [
  {{ name = "a", type = "unsigned" }},
  {{ name = "b", type = "string" }},
  {{ name = "v", type = "any", is_nullable = true }},
]
primary_key = ["a", "b"]
"""


def user_table(name: str, password: str, buckets: str) -> str:
    """[users.NAME] with every credential `sluice user hash` prints (cheap iterations)."""
    creds = sluice.config.user_credentials(password, iterations=1000)
    lines = [f"[users.{name}]"] + [f'{k} = "{v}"' for k, v in creds.items()]
    return "\n".join(lines) + f"\nbuckets = {buckets}\n"


# app may read and write both spaces; guest may read `pairs` only.
USERS = user_table("app", "secret", '{ users = ["read", "write"], pairs = ["read", "write", "stream"] }') + (
    '[users.guest]\nbuckets = { pairs = ["read"] }\n'
)


def start_iproto_node(tmp_path: Path, name: str = "n", *args: str, users: bool = True) -> Node:
    return start_node(tmp_path, name, *args, extra=SPACES + (USERS if users else ""))


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def packet(header: dict, body: dict | None = None) -> bytes:
    """An iproto packet: the length (smallest uint), the header map, the body map if any."""
    payload = msgpack.packb(header) + (msgpack.packb(body) if body is not None else b"")
    return msgpack.packb(len(payload)) + payload


def chap_scramble(password: str, salt: bytes) -> bytes:
    s1 = hashlib.sha1(password.encode()).digest()
    s2 = hashlib.sha1(s1).digest()
    mask = hashlib.sha1(salt[:20] + s2).digest()
    return bytes(a ^ b for a, b in zip(s1, mask, strict=True))
