"""What both the member and the orchestrator it may run read: the node's cluster settings and
the lease its registration lives under. Kept apart from both so that the member can start the
orchestrator without the two modules importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.cluster.etcd import Etcd

# etcd's shortest lease: shorter asks are raised to it. The orchestrator counts a gone node's
# failover timeout from its last renewal, one lease before the key vanished.
LEASE_TTL = 2


@dataclass
class ClusterSettings:
    etcd: Etcd
    cluster: str
    node: str
    kv: str
    # Its TANK listener as other nodes reach it ("" when it has none).
    tank: str = ""
    # Its iproto listener as other nodes reach it ("" when it has none).
    iproto: str = ""
    group: str = ""
    replicas: int = 1
    auto_failover_timeout: float = 10.0
    max_auto_failovers: int = 1
    admin: str | None = None
    num_vbuckets: int = 64
    buckets: list[str] = field(default_factory=lambda: ["default"])
