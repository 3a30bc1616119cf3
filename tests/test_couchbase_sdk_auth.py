"""Logging in from the official Couchbase Python SDK (its C++ core underneath) on a real
`sluice serve`: the default PasswordAuthenticator (SCRAM-SHA512), PLAIN when the application
asks for it, any name on a node without users, and AuthenticationException for bad
credentials.

The SDK's bootstrap goes on after the login with GET_ERROR_MAP and GET_CLUSTER_CONFIG: the
tests that need a whole bootstrap are skipped while the node does not answer GET_CLUSTER_CONFIG
(0xb5) with success. A refused login fails before that, so those tests always run."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sluice
from helpers import Node
from mcbp_wire import connect, login, read_response, request

couchbase = pytest.importorskip("couchbase")
from couchbase.auth import PasswordAuthenticator  # noqa: E402
from couchbase.cluster import Cluster  # noqa: E402
from couchbase.exceptions import AuthenticationException  # noqa: E402
from couchbase.options import ClusterOptions, ClusterTimeoutOptions  # noqa: E402

GET_CLUSTER_CONFIG = 0xB5


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


def serves_cluster_config(node: Node, user: str, password: str) -> bool:
    with connect(node) as s:
        assert login(s, user, password) == 0
        s.sendall(request(GET_CLUSTER_CONFIG))
        return read_response(s)["status"] == 0


def needs_bootstrap(node: Node, user: str = "ada", password: str = "ada-secret") -> None:
    if not serves_cluster_config(node, user, password):
        pytest.skip("the node does not answer GET_CLUSTER_CONFIG yet: the SDK cannot bootstrap")


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
    needs_bootstrap(secured)
    c = cluster(secured, "ada", "ada-secret", **options)
    try:
        coll = c.bucket("default").default_collection()
        coll.upsert("sdk-auth", {"by": "sdk"})
        assert coll.get("sdk-auth").content_as[dict] == {"by": "sdk"}
    finally:
        c.close()


@pytest.mark.parametrize(("user", "password"), [("", ""), ("anyone", "anything")])
def test_any_login_works_on_a_node_without_users(open_node, user, password):
    needs_bootstrap(open_node, user, password)
    c = cluster(open_node, user, password)
    try:
        coll = c.bucket("default").default_collection()
        coll.upsert("open", "v")
        assert coll.get("open").content_as[str] == "v"
    finally:
        c.close()
