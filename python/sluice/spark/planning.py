"""Planning on the Spark driver: which node serves each vbucket, where each vbucket stands, the
offsets of a streaming query, whether a vbucket's history changed under it, and how vbucket
ranges are grouped into Spark partitions.

Offsets are canonical JSON (Spark compares them as strings): ``{"v": 1, "vbuckets": {"0":
{"seqno": 12, "uuid": 987}, ...}}`` with the vbuckets in numeric order and the same key order
every time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from sluice._native import SluiceError, vbucket_positions
from sluice.spark.options import EARLIEST, LATEST, Offsets, Options

log = logging.getLogger("sluice.spark")

FailoverLog = Sequence[tuple[int, int]]  # newest first: (uuid, seqno)


class DataLossError(SluiceError):
    """A vbucket's history changed under the query (failover or rollback): rows it read may be
    gone from the node, or rows may exist that it never saw."""

    def __init__(self, vbucket: int, why: str) -> None:
        super().__init__(
            f"vbucket {vbucket}: {why}. Some changes may be lost to this query; set the option "
            "failOnDataLoss=false to go on from the point where the histories agree"
        )
        self.vbucket = vbucket


@dataclass(frozen=True)
class VbucketSource:
    """Where a vbucket is read from, and where it stands there."""

    vbucket: int
    node: str
    state: str  # "active" or "replica"
    high_seqno: int
    failover: tuple[tuple[int, int], ...]

    @property
    def uuid(self) -> int:
        return self.failover[0][0]


def locate(opts: Options) -> dict[int, VbucketSource]:
    """Asks every node for its active and replica vbuckets; picks a replica where preferReplica
    allows and one holds the vbucket, else the active. Nodes that cannot be reached are skipped
    (logged) as long as another serves each wanted vbucket."""
    found: dict[int, VbucketSource] = {}
    errors: list[str] = []
    states = ("replica", "active") if opts.prefer_replica else ("active",)
    for node in opts.current_nodes():
        for state in states:
            try:
                positions = vbucket_positions(node, state=state, timeout=opts.timeout, **opts.node_kwargs())
            except SluiceError as e:
                errors.append(f"{node}: {e}")
                log.warning("sluice node %s: %s", node, e)
                break
            for vb, high, failover in positions:
                if opts.vbuckets is not None and vb not in opts.vbuckets:
                    continue
                rank = states.index(state)
                have = found.get(vb)
                if have is None or rank < states.index(have.state):
                    found[vb] = VbucketSource(vb, node, state, high, tuple(failover))
    if not found and errors:
        raise SluiceError("no sluice node answered: " + "; ".join(errors))
    wanted = opts.vbuckets if opts.vbuckets is not None else sorted(found)
    missing = [vb for vb in wanted if vb not in found]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        why = f"; unreachable: {'; '.join(errors)}" if errors else ""
        raise SluiceError(
            f"no node of {', '.join(opts.nodes)} serves vbucket(s) {shown} of {_what(opts)}{why}"
        )
    if not found:
        raise SluiceError(f"{_what(opts)} has no vbuckets on {', '.join(opts.nodes)}")
    return found


def _what(opts: Options) -> str:
    return f"topic '{opts.topic}' (partitions as vbuckets)" if opts.topic else f"bucket '{opts.bucket}'"


def uuid_at(failover: FailoverLog, seqno: int) -> int:
    """The uuid of the history branch that holds ``seqno``."""
    for uuid, start in failover:
        if start <= seqno:
            return uuid
    return failover[-1][0]


def diverged(failover: FailoverLog, high: int, uuid: int, seqno: int) -> tuple[int, str] | None:
    """Whether a reader at (uuid, seqno) still follows the vbucket's history. None if it does;
    else the seqno up to which it does and why not (DCP's rollback rule, plus: a uuid change
    at all is a failover, where writes not replicated in time are lost)."""
    uuids = [u for u, _ in failover]
    if uuid not in uuids:
        if seqno == 0:
            return None
        return 0, f"its history no longer holds uuid {uuid} (the node's failover log was reset)"
    i = uuids.index(uuid)
    if i == 0:
        if seqno > high:
            return high, f"the node holds seqnos up to {high}, and this query read up to {seqno}"
        return None
    branch = failover[i - 1][1]
    if seqno > branch:
        return branch, (
            f"a failover at seqno {branch} replaced uuid {uuid} by {failover[i - 1][0]}, and this "
            f"query read up to seqno {seqno} of the old history: the changes after {branch} were "
            "rolled back"
        )
    return seqno, (
        f"a failover at seqno {branch} replaced uuid {uuid} by {failover[0][0]}: changes the old "
        "active held but had not replicated are lost"
    )


@dataclass(frozen=True)
class Position:
    seqno: int
    uuid: int


def offset_json(positions: dict[int, Position]) -> dict:
    """The canonical offset document (vbuckets in numeric order, fixed key order)."""
    return {
        "v": 1,
        "vbuckets": {
            str(vb): {"seqno": positions[vb].seqno, "uuid": positions[vb].uuid} for vb in sorted(positions)
        },
    }


def parse_offset(doc: dict) -> dict[int, Position]:
    return {int(vb): Position(int(p["seqno"]), int(p["uuid"])) for vb, p in doc["vbuckets"].items()}


def resolve(offsets: Offsets, sources: dict[int, VbucketSource], default: str) -> dict[int, Position]:
    """startingOffsets / endingOffsets made concrete for every vbucket served."""
    out = {}
    for vb, src in sources.items():
        seqno, uuid = offsets.per_vbucket.get(vb, (EARLIEST if default == "earliest" else LATEST, None))
        if offsets.kind == "earliest":
            seqno = EARLIEST
        elif offsets.kind == "latest":
            seqno = LATEST
        if seqno == EARLIEST:
            seqno = 0
        elif seqno == LATEST:
            seqno = src.high_seqno
        out[vb] = Position(seqno, uuid if uuid is not None else uuid_at(src.failover, seqno))
    return out


def check_history(
    positions: dict[int, Position], sources: dict[int, VbucketSource], fail_on_data_loss: bool
) -> dict[int, Position]:
    """Each position checked against its vbucket's current history: unchanged where it still
    follows it; where not, DataLossError, or (failOnDataLoss=false) a warning and the point
    where the histories agree, on the current history's uuid."""
    out = dict(positions)
    for vb, pos in positions.items():
        src = sources.get(vb)
        if src is None:
            continue
        d = diverged(src.failover, src.high_seqno, pos.uuid, pos.seqno)
        if d is None:
            continue
        agree, why = d
        if fail_on_data_loss:
            raise DataLossError(vb, why)
        log.warning("vbucket %d: %s; going on from seqno %d", vb, why, agree)
        out[vb] = Position(agree, uuid_at(src.failover, agree))
    return out


@dataclass(frozen=True)
class VbucketRange:
    """Changes after ``start`` (on history ``uuid``) up to and including ``end``."""

    vbucket: int
    uuid: int
    start: int
    end: int


#: Changes a partition is given at least (below this a partition's fixed cost, a Python worker
#: and a connection, outweighs what splitting gains) and at most (so that a large read is spread
#: over many tasks, as Spark splits files at 128 MiB).
MIN_ROWS_PER_PARTITION = 10_000
MAX_ROWS_PER_PARTITION = 1_000_000


def partitions_for(ranges: list[tuple[str, VbucketRange]], cores: int | None = None) -> int:
    """numPartitions when the option is not set, chosen as Spark sizes file splits: the changes
    spread over the cores (those of this machine unless given), each partition holding between
    MIN_ and MAX_ROWS_PER_PARTITION of them; never more partitions than vbucket ranges."""
    span = sum(r.end - r.start for _, r in ranges)
    cores = cores or os.cpu_count() or 1
    per_partition = min(MAX_ROWS_PER_PARTITION, max(MIN_ROWS_PER_PARTITION, -(-span // cores)))
    return max(1, min(len(ranges), -(-span // per_partition)))


def group(
    ranges: list[tuple[str, VbucketRange]], num_partitions: int
) -> list[tuple[str, list[VbucketRange]]]:
    """Ranges into at most ``num_partitions`` groups of one node each, balanced by seqno span
    (largest first onto the lightest group)."""
    by_node: dict[str, list[VbucketRange]] = {}
    for node, r in ranges:
        by_node.setdefault(node, []).append(r)
    total = sum(len(rs) for rs in by_node.values())
    out: list[tuple[str, list[VbucketRange]]] = []
    for node, rs in sorted(by_node.items()):
        # Each node gets groups in proportion to its ranges, at least one.
        n = max(1, min(len(rs), round(num_partitions * len(rs) / total)))
        groups: list[list[VbucketRange]] = [[] for _ in range(n)]
        load = [0] * n
        for r in sorted(rs, key=lambda r: (r.start - r.end, r.vbucket)):
            i = load.index(min(load))
            groups[i].append(r)
            load[i] += r.end - r.start
        out.extend((node, sorted(g, key=lambda r: r.vbucket)) for g in groups if g)
    return out
