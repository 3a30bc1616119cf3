"""Logging in from the official Couchbase Python SDK (its C++ core underneath) on a real
`sluice serve`: the default PasswordAuthenticator (SCRAM-SHA512), PLAIN when the application
asks for it, any name on a node without users, and AuthenticationException for bad
credentials."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sluice
from couchbase.auth import PasswordAuthenticator
from couchbase.cluster import Cluster
from couchbase.exceptions import AuthenticationException
from couchbase.options import ClusterOptions, ClusterTimeoutOptions
from helpers import Node


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A node with user ada (password ada-secret) as `sluice user hash` makes her."""
    tmp = tmp_path_factory.mktemp("sdk")
    creds = sluice.config.user_credentials("ada-secret", iterations=1000)
    cfg = tmp / "sluice.toml"
    cfg.write_text(
        "[users.ada]\n"
        + "".join(f'{k} = "{v}"\n' for k, v in creds.items())
        + 'buckets = { "*" = ["read", "write"] }\n'
    )
    node = Node(tmp / "d", "--config", str(cfg))
    yield node
    assert node.stop() == 0


@pytest.fixture(scope="module")
def open_node(tmp_path_factory):
    """The embedded default: no users, loopback only."""
    node = Node(tmp_path_factory.mktemp("sdk-open") / "d")
    yield node
    assert node.stop() == 0


def cluster(node: Node, user: str, password: str, **auth_options) -> Cluster:
    timeouts = ClusterTimeoutOptions(
        connect_timeout=timedelta(seconds=10), bootstrap_timeout=timedelta(seconds=10)
    )
    return Cluster(
        f"couchbase://{node.host}:{node.port}",
        ClusterOptions(PasswordAuthenticator(user, password, **auth_options), timeout_options=timeouts),
    )


@pytest.mark.parametrize(
    ("user", "password", "options"),
    [
        ("ada", "wrong", {}),
        ("nobody", "ada-secret", {}),
        ("ada", "wrong", {"allowed_sasl_mechanisms": ["PLAIN"]}),
        ("ada", "wrong", {"allowed_sasl_mechanisms": ["SCRAM-SHA1"]}),
    ],
)
def test_bad_credentials_raise_authentication_exception(secured, user, password, options):
    with pytest.raises(AuthenticationException):
        cluster(secured, user, password, **options)


@pytest.mark.parametrize(
    "options",
    [{}, {"allowed_sasl_mechanisms": ["SCRAM-SHA256"]}, {"allowed_sasl_mechanisms": ["PLAIN"]}],
    ids=["default-scram-sha512", "scram-sha256", "plain"],
)
def test_the_sdk_logs_in_and_works(secured, options):
    c = cluster(secured, "ada", "ada-secret", **options)
    try:
        coll = c.bucket("default").default_collection()
        coll.upsert("sdk-auth", {"by": "sdk"})
        assert coll.get("sdk-auth").content_as[dict] == {"by": "sdk"}
    finally:
        c.close()


@pytest.mark.parametrize(("user", "password"), [("", ""), ("anyone", "anything")])
def test_any_login_works_on_a_node_without_users(open_node, user, password):
    c = cluster(open_node, user, password)
    try:
        coll = c.bucket("default").default_collection()
        coll.upsert("open", "v")
        assert coll.get("open").content_as[str] == "v"
    finally:
        c.close()
