"""The vbucket map: for every vbucket a chain of node names, the active first, then its
replicas (None for a slot no node fills). Pure functions: a balanced map that moves as little as
it can from the one in use, a failover, a returning node taken back as replica.

Balanced means: actives spread so that no two nodes differ by more than one, replicas likewise,
no node twice in a chain, and where nodes name server groups, the copies of a vbucket in as many
different groups as there are."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

Chain = list[str | None]


def _targets(nodes: Sequence[str], total: int, held: Counter[str]) -> dict[str, int]:
    """How many of `total` each node should hold: total // n each, one more for total % n of
    them, those holding the most already first (fewer moves)."""
    n = len(nodes)
    base, extra = divmod(total, n)
    order = sorted(nodes, key=lambda x: (-held[x], nodes.index(x)))
    return {x: base + (1 if i < extra else 0) for i, x in enumerate(order)}


def _spread(chain: Chain, groups: Mapping[str, str]) -> int:
    """How many server groups a chain's copies are in."""
    return len({groups.get(x) for x in chain if x is not None})


def balance(
    nodes: Sequence[str],
    num_vbuckets: int,
    replicas: int,
    *,
    current: Sequence[Chain] | None = None,
    groups: Mapping[str, str] | None = None,
) -> list[Chain]:
    """A balanced map over `nodes`, keeping as much of `current` as balance allows."""
    if not nodes:
        raise ValueError("a map needs at least one node")
    nodes = list(nodes)
    groups = groups or {}
    width = 1 + replicas
    copies = min(width, len(nodes))
    current = list(current or [])
    old = [list(current[vb]) if vb < len(current) else [] for vb in range(num_vbuckets)]

    # Actives.
    kept_active = Counter(c[0] for c in old if c and c[0] in nodes)
    want = _targets(nodes, num_vbuckets, kept_active)
    actives: list[str | None] = [None] * num_vbuckets
    count: Counter[str] = Counter()
    for vb, c in enumerate(old):
        if c and c[0] in nodes and count[c[0]] < want[c[0]]:
            actives[vb] = c[0]
            count[c[0]] += 1
    for vb in range(num_vbuckets):
        if actives[vb] is None:
            # Prefer a node already holding a copy (its move is a short catch-up).
            holders = [x for x in old[vb][1:] if x in nodes and count[x] < want[x]]
            pick = holders[0] if holders else max(nodes, key=lambda x: (want[x] - count[x], -nodes.index(x)))
            actives[vb] = pick
            count[pick] += 1

    # Replicas.
    chains: list[Chain] = [[a] for a in actives]
    slots = num_vbuckets * (copies - 1)
    kept_replicas = Counter(x for c in old for x in c[1:] if x in nodes)
    rwant = _targets(nodes, slots, kept_replicas) if slots else dict.fromkeys(nodes, 0)
    rcount: Counter[str] = Counter()

    def fits(x: str, chain: Chain) -> bool:
        return x not in chain and rcount[x] < rwant[x]

    def group_free(x: str, chain: Chain) -> bool:
        return not groups or groups.get(x) not in {groups.get(y) for y in chain if y is not None}

    for vb, c in enumerate(old):
        for x in c[1:copies]:
            if x in nodes and fits(x, chains[vb]) and group_free(x, chains[vb]):
                chains[vb].append(x)
                rcount[x] += 1
    for vb in range(num_vbuckets):
        chain = chains[vb]
        while len(chain) < copies:
            candidates = [x for x in nodes if x not in chain]
            preferred = [x for x in candidates if rcount[x] < rwant[x]] or candidates
            preferred = [x for x in preferred if group_free(x, chain)] or preferred
            pick = max(preferred, key=lambda x: (rwant[x] - rcount[x], -nodes.index(x)))
            chain.append(pick)
            rcount[pick] += 1
    # Greedy filling can leave a node short where every vbucket it could take already had
    # it in its chain: swap replicas from the fullest to the emptiest until within one.
    for _ in range(slots):
        over = max(nodes, key=lambda x: (rcount[x], -nodes.index(x)))
        under = min(nodes, key=lambda x: (rcount[x], nodes.index(x)))
        if rcount[over] - rcount[under] <= 1:
            break
        for chain in chains:
            if over in chain[1:] and under not in chain:
                swapped = [under if y == over else y for y in chain]
                if _spread(swapped, groups) >= _spread(chain, groups):
                    chain[chain.index(over)] = under
                    rcount[over] -= 1
                    rcount[under] += 1
                    break
        else:
            break
    for chain in chains:
        chain.extend([None] * (width - len(chain)))
    return chains


def fail_over(
    chains: Sequence[Chain], failed: str, seqnos: Mapping[str, Mapping[int, int]], alive: set[str]
) -> tuple[list[Chain], list[int]]:
    """Takes `failed` out of every chain: where it was active, the replica alive with the
    highest seqno (from `seqnos`, node -> vbucket -> seqno) is promoted. Returns the new map and
    the vbuckets that had no replica to promote (left without an active)."""
    out: list[Chain] = []
    lost = []
    for vb, c in enumerate(chains):
        chain = [x if x != failed else None for x in c]
        if c and c[0] == failed:
            candidates = [x for x in c[1:] if x is not None and x in alive]
            if candidates:
                best = max(candidates, key=lambda x: (seqnos.get(x, {}).get(vb, -1), -c.index(x)))
                rest = [x for x in chain[1:] if x != best]
                chain = [best, *rest, None]
            else:
                lost.append(vb)
        out.append(chain)
    return out, lost


def take_back(chains: Sequence[Chain], node: str, held: Sequence[int]) -> list[Chain]:
    """A failed-over node returns: it becomes a replica again of the vbuckets it held (`held`)
    where their chains have a free slot, and active again of those nobody could take over."""
    out = [list(c) for c in chains]
    for vb in held:
        if vb >= len(out) or node in out[vb]:
            continue
        if out[vb][0] is None:
            # No replica was there to promote: its copy is the only one.
            out[vb][0] = node
        elif None in out[vb][1:]:
            out[vb][out[vb].index(None, 1)] = node
    return out


def held_by(chains: Sequence[Chain], node: str) -> list[int]:
    return [vb for vb, c in enumerate(chains) if node in c]


def summary(chains: Sequence[Chain]) -> dict[str, tuple[int, int]]:
    """Per node: (actives, replicas)."""
    out: dict[str, list[int]] = {}
    for c in chains:
        for i, x in enumerate(c):
            if x is not None:
                out.setdefault(x, [0, 0])[0 if i == 0 else 1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}
