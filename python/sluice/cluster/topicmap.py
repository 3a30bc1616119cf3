"""Where a cluster's topic partitions live: per partition a chain of node names (its leader
first, then the nodes that copy it, None for a slot no node fills) and the copies in sync (the
leader among them). Pure functions, as `vbmap` is for vbuckets: a failover promotes the most
advanced copy in sync, or leaves the partition without a leader when none is left; a copy joins
those in sync once it holds what its leader holds; a returning node takes its place back.

The copies in sync are what a produce asking for acks from all copies waits for, and the only
ones a failover may promote, so that what was acknowledged so is never lost. A leader that
fails with no copy in sync stays the partition's only copy in sync: the partition has no leader
(TANK clients are told so) until it returns, rather than one that lacks acknowledged
messages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Chain = list[str | None]
# Per node, per topic: each partition's high-water mark there.
Held = Mapping[str, Mapping[str, Sequence[int]]]


def replicas_of(settings: str, default: int) -> int:
    """How many copies besides its leader a topic's partitions get: its `replication.factor`
    setting minus one (Kafka's name; the node checked it when the topic was created), or the
    cluster's `replicas`."""
    for line in settings.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "replication.factor" and value.strip().isdigit():
            return max(0, int(value) - 1)
    return default


def in_sync_copies(topic: Mapping[str, Any]) -> list[list[str]]:
    """A placed topic's copies in sync, per partition (a map from before the map kept them:
    every copy placed)."""
    return [list(s) for s in topic.get("isr") or [[n for n in c if n is not None] for c in topic["chains"]]]


def hwm(held: Held, node: str, topic: str, partition: int) -> int:
    marks = held.get(node, {}).get(topic, [])
    return marks[partition] if partition < len(marks) else -1


def fail_over(
    topics: Mapping[str, Mapping[str, Any]], failed: str, held: Held, alive: set[str]
) -> tuple[dict[str, dict[str, Any]], dict[str, list[int]], list[tuple[str, int]]]:
    """Takes `failed` out of every partition: where it led, the copy in sync and alive that
    holds the most (`held`) leads instead. Returns the topics, the partitions it held per topic
    (to take it back), and the partitions left without a leader."""
    out: dict[str, dict[str, Any]] = {}
    had: dict[str, list[int]] = {}
    orphaned: list[tuple[str, int]] = []
    for name, t in topics.items():
        chains = [list(c) for c in t["chains"]]
        in_sync = in_sync_copies(t)
        for p, chain in enumerate(chains):
            if failed not in chain:
                continue
            had.setdefault(name, []).append(p)
            led = chain[0] == failed
            rest = [n for n in in_sync[p] if n != failed]
            if not led:
                chains[p] = [n if n != failed else None for n in chain]
                in_sync[p] = rest
                continue
            candidates = [n for n in rest if n in alive]
            if not candidates:
                # Its copy is the only one known to hold every acknowledged message.
                chains[p] = [None, *[n for n in chain[1:]]]
                in_sync[p] = [failed, *rest]
                orphaned.append((name, p))
                continue
            best = max(candidates, key=lambda n: (hwm(held, n, name, p), -chain.index(n)))
            chains[p] = [best, *[n for n in chain[1:] if n != best], None]
            in_sync[p] = rest
        # A leader change under way ends with the failover: the partition is led as it decided.
        handover = {
            k: v for k, v in t.get("handover", {}).items() if failed not in (v, t["chains"][int(k)][0])
        }
        out[name] = {**t, "chains": chains, "isr": in_sync, "handover": handover}
    return out, had, orphaned


def take_back(
    topics: Mapping[str, Mapping[str, Any]], node: str, had: Mapping[str, Sequence[int]]
) -> dict[str, dict[str, Any]]:
    """A failed-over node returns: it leads again the partitions it was the last copy in sync
    of, and copies again those it held where their chains have a free slot (not in sync until
    it catches up: `admit_caught_up`)."""
    out: dict[str, dict[str, Any]] = {}
    for name, t in topics.items():
        chains = [list(c) for c in t["chains"]]
        in_sync = in_sync_copies(t)
        for p in had.get(name, []):
            if p >= len(chains) or node in chains[p]:
                continue
            chain = chains[p]
            if chain[0] is None and node in in_sync[p]:
                chain[0] = node
            elif None in chain[1:]:
                chain[chain.index(None, 1)] = node
        out[name] = {**t, "chains": chains, "isr": in_sync}
    return out


def admit_caught_up(
    topics: Mapping[str, Mapping[str, Any]],
    held: Held,
    alive: set[str],
    branches: Held | None = None,
    led: Held | None = None,
    held_before: Held | None = None,
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, int, str]]]:
    """Each copy alive, not in sync, that holds at least what its leader holds (as both last
    published) joins those in sync; with `held_before` (what each node published the time
    before its last), at least what its leader held then: under a steady producer a copy that
    keeps up seldom holds what its leader holds at the same moment, and the two statuses are
    not taken together. With `branches` and `led` (per node and topic, the partitions its
    status says it leads), only a copy on its leader's branch of history, as the leader
    published it since it leads (a copy that holds more on another branch, taken by an old
    leader, has not been cut back yet; a leader's status from before it led shows the branch
    it copied). Returns the topics and what joined: (topic, partition, node)."""
    out: dict[str, dict[str, Any]] = {}
    joined: list[tuple[str, int, str]] = []
    for name, t in topics.items():
        in_sync = in_sync_copies(t)
        for p, chain in enumerate(t["chains"]):
            leader = chain[0]
            if leader is None or leader not in alive:
                continue
            lead_hwm = hwm(held, leader, name, p)
            if held_before is not None and lead_hwm >= 0:
                before = hwm(held_before, leader, name, p)
                lead_hwm = before if 0 <= before <= lead_hwm else lead_hwm
            for n in chain[1:]:
                if n is None or n in in_sync[p] or n not in alive or lead_hwm < 0:
                    continue
                if branches is not None:
                    branch = hwm(branches, n, name, p)
                    if branch < 0 or branch != hwm(branches, leader, name, p):
                        continue
                    if led is not None and p not in led.get(leader, {}).get(name, []):
                        continue
                if hwm(held, n, name, p) >= lead_hwm:
                    in_sync[p].append(n)
                    joined.append((name, p, n))
        out[name] = {**t, "isr": in_sync}
    return out, joined
