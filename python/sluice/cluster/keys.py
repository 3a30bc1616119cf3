"""Where a cluster keeps its state in etcd, under /sluice/CLUSTER/:

- nodes/NAME: a node's registration (its KV address, group, incarnation: new at every start),
  under the node's lease: the key vanishes when the node stops renewing it;
- status/NAME: the node's vbuckets (state, high and persisted seqnos), every half second, under
  the same lease; the orchestrator picks the replica to promote from it;
- orchestrator: the elected orchestrator's name, under its lease;
- map: the vbucket map (nodes, chains, replicas, wanted members, failed-over nodes, the count of
  automatic failovers); its mod revision is the map's revision clients see;
- rebalance: the rebalance under way or last run, with its target and progress;
- request/...: what `sluice cluster` asks of the orchestrator (rebalance, failover NODE);
- task/NAME and result/NAME: a vbucket move the orchestrator asks a node to carry out, and how
  it went."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Keys:
    cluster: str

    @property
    def root(self) -> str:
        return f"/sluice/{self.cluster}/"

    def node(self, name: str = "") -> str:
        return f"{self.root}nodes/{name}"

    def status(self, name: str = "") -> str:
        return f"{self.root}status/{name}"

    def task(self, name: str = "") -> str:
        return f"{self.root}task/{name}"

    def result(self, name: str = "") -> str:
        return f"{self.root}result/{name}"

    def request(self, what: str = "") -> str:
        return f"{self.root}request/{what}"

    @property
    def map(self) -> str:
        return f"{self.root}map"

    @property
    def orchestrator(self) -> str:
        return f"{self.root}orchestrator"

    @property
    def rebalance(self) -> str:
        return f"{self.root}rebalance"


def dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)
