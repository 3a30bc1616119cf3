"""Couchbase's Python SDK as an application uses it, for the tests that run it against
`sluice serve`: a connected cluster with every wait bounded."""

from __future__ import annotations

from datetime import timedelta

from couchbase.auth import PasswordAuthenticator
from couchbase.cluster import Cluster
from couchbase.options import ClusterOptions, ClusterTimeoutOptions

# The SDK's kv timeout in the tests, in seconds.
KV_TIMEOUT = 5


def sdk_cluster(
    node, user: str, password: str, mechanisms: list[str] | None = None, transactions=None
) -> Cluster:
    """Cluster.connect to `node`'s KV port as `user`; `mechanisms` limits the SASL mechanisms
    the SDK may use (None: its default, SCRAM-SHA512 on plain TCP); `transactions` is a
    TransactionConfig for `cluster.transactions`."""
    if mechanisms is None:
        auth = PasswordAuthenticator(user, password)
    else:
        auth = PasswordAuthenticator(user, password, allowed_sasl_mechanisms=mechanisms)
    timeouts = ClusterTimeoutOptions(
        bootstrap_timeout=timedelta(seconds=10),
        kv_timeout=timedelta(seconds=KV_TIMEOUT),
        connect_timeout=timedelta(seconds=10),
    )
    options = ClusterOptions(auth, timeout_options=timeouts)
    if transactions is not None:
        options = ClusterOptions(auth, timeout_options=timeouts, transaction_config=transactions)
    cluster = Cluster.connect(f"couchbase://{node.host}:{node.port}", options)
    cluster.wait_until_ready(timedelta(seconds=15))
    return cluster
