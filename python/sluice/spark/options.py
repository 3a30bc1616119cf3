"""The options of the ``sluice`` Spark data source, checked in one place.

Spark hands options over as strings in a case-insensitive map; every option is parsed here into
:class:`Options`, and an unknown or malformed one raises :class:`OptionError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice._native import ConfigError

#: Seqno markers of startingOffsets / endingOffsets JSON, as Kafka's source has them.
EARLIEST = -2
LATEST = -1


class OptionError(ConfigError):
    """A data source option is unknown or malformed."""

    def __init__(self, option: str, reason: str) -> None:
        super().__init__(f"sluice data source option '{option}': {reason}")
        self.option = option


@dataclass(frozen=True)
class Offsets:
    """startingOffsets / endingOffsets: "earliest", "latest", or per vbucket a seqno (EARLIEST
    and LATEST allowed) and optionally the vbucket uuid that seqno belongs to."""

    kind: str  # "earliest", "latest" or "json"
    per_vbucket: dict[int, tuple[int, int | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class Options:
    # HOST:PORT of nodes, or one etcd://HOST:PORT/CLUSTER URL (see `current_nodes`).
    nodes: tuple[str, ...]
    bucket: str
    space: str | None  # an iproto space: its bucket, read as typed columns (sluice.spark.space)
    topic: str | None  # a topic's messages instead of a bucket's changes (sluice.spark.topic)
    vbuckets: tuple[int, ...] | None  # None: every vbucket
    prefer_replica: bool
    starting_offsets: Offsets
    ending_offsets: Offsets | None  # batch only
    max_records_per_batch: int | None  # streaming only
    read_on_driver: bool  # streaming only: micro-batches read by the driver (SluiceDriverStreamReader)
    fail_on_data_loss: bool
    include_deletes: bool
    xattrs: bool  # documents' extended attributes as a column of their own (SCHEMA_XATTRS)
    user: str | None
    password: str | None
    num_partitions: int | None  # None: chosen from the data and the cores
    timeout: float

    def current_nodes(self) -> tuple[str, ...]:
        """The nodes to plan over: those given, or the nodes of the cluster's map in etcd now
        (read again at every planning, so a rebalance's new nodes are found)."""
        if len(self.nodes) != 1 or not self.nodes[0].startswith(("etcd://", "etcds://")):
            return self.nodes
        from sluice.cluster.etcd import Etcd, EtcdError, parse_cluster_url
        from sluice.cluster.keys import Keys

        endpoints, name = parse_cluster_url(self.nodes[0])
        try:
            kv = Etcd(endpoints, timeout=self.timeout).get(Keys(name).map)
        except EtcdError as e:
            raise ConfigError(f"sluice data source: cannot read cluster {name}'s map: {e}") from None
        if kv is None:
            raise ConfigError(f"sluice data source: cluster {name} has no map yet")
        doc = kv.json()
        return tuple(doc["nodes"][n]["kv"] for n in sorted(doc["nodes"]) if n not in doc["failed"])

    def node_kwargs(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "username": self.user, "password": self.password, "topic": self.topic}


def _bool(name: str, text: str) -> bool:
    t = text.strip().lower()
    if t in ("true", "1", "yes"):
        return True
    if t in ("false", "0", "no"):
        return False
    raise OptionError(name, f"must be true or false, not {text!r}")


def _positive_int(name: str, text: str) -> int:
    try:
        n = int(text.strip())
    except ValueError:
        raise OptionError(name, f"must be a whole number, not {text!r}") from None
    if n < 1:
        raise OptionError(name, f"must be at least 1, not {n}")
    return n


def _seconds(name: str, text: str) -> float:
    try:
        t = float(text.strip())
    except ValueError:
        raise OptionError(name, f"must be a number of seconds, not {text!r}") from None
    if not 0 < t <= 3600:
        raise OptionError(name, f"must be above 0 and at most 3600 seconds, not {t}")
    return t


def _nodes(name: str, text: str) -> tuple[str, ...]:
    if text.strip().startswith(("etcd://", "etcds://")):
        from sluice.cluster.etcd import parse_cluster_url

        try:
            parse_cluster_url(text.strip())
        except ValueError as e:
            raise OptionError(name, str(e)) from None
        return (text.strip(),)
    nodes = tuple(n.strip() for n in text.split(",") if n.strip())
    if not nodes:
        raise OptionError(name, "must list at least one HOST:PORT")
    for n in nodes:
        host, sep, port = n.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise OptionError(name, f"{n!r} is not HOST:PORT")
    return nodes


def _vbuckets(name: str, text: str) -> tuple[int, ...] | None:
    if text.strip().lower() in ("", "all"):
        return None
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise OptionError(name, f"{part!r} is not a vbucket number or range like 0-63") from None
        if not 0 <= a <= b < 65536:
            raise OptionError(name, f"{part!r} is not a range of vbuckets 0 to 65535")
        out.update(range(a, b + 1))
    return tuple(sorted(out))


def _offsets(name: str, text: str, allowed: tuple[str, ...]) -> Offsets:
    t = text.strip()
    if t.lower() in allowed:
        return Offsets(t.lower())
    try:
        doc = json.loads(t)
    except ValueError:
        choices = " | ".join(allowed)
        raise OptionError(name, f"must be {choices} or JSON, not {text!r}") from None
    if isinstance(doc, dict) and "vbuckets" in doc:
        doc = doc["vbuckets"]
    if not isinstance(doc, dict):
        raise OptionError(name, 'JSON must be an object of vbuckets, like {"0": 12, "1": -2}')
    per: dict[int, tuple[int, int | None]] = {}
    for vb, v in doc.items():
        if not str(vb).isdigit() or int(vb) > 65535:
            raise OptionError(name, f"{vb!r} is not a vbucket number")
        uuid = None
        if isinstance(v, dict):
            uuid = v.get("uuid")
            v = v.get("seqno")
            if uuid is not None and (not isinstance(uuid, int) or uuid < 0):
                raise OptionError(name, f"vbucket {vb}: uuid must be a non-negative integer")
        if not isinstance(v, int) or isinstance(v, bool) or v < EARLIEST:
            raise OptionError(
                name, f"vbucket {vb}: seqno must be an integer >= 0, -2 (earliest) or -1 (latest)"
            )
        per[int(vb)] = (v, uuid)
    return Offsets("json", per)


# The names as users write them; Spark lower-cases the keys it hands over.
_NAMES = (
    "nodes",
    "bucket",
    "space",
    "topic",
    "vbuckets",
    "preferReplica",
    "startingOffsets",
    "endingOffsets",
    "maxRecordsPerBatch",
    "readOnDriver",
    "failOnDataLoss",
    "includeDeletes",
    "xattrs",
    "user",
    "password",
    "numPartitions",
    "timeout",
)
_SPELLING = {n.lower(): n for n in _NAMES}


def parse(options: Mapping[str, str], streaming: bool) -> Options:
    opts = {str(k).lower(): str(v) for k, v in options.items()}
    for k in opts:
        if k not in _SPELLING:
            raise OptionError(k, f"unknown option (known: {', '.join(_NAMES)})")

    def get(key: str, parser: Callable[[str, str], Any], default: Any) -> Any:
        name = _SPELLING[key]
        return parser(name, opts[key]) if key in opts else default

    if streaming and "endingoffsets" in opts:
        raise OptionError("endingOffsets", "applies to batch reads only")
    for key in ("maxrecordsperbatch", "readondriver"):
        if not streaming and key in opts:
            raise OptionError(_SPELLING[key], "applies to streaming reads only")
    # As Kafka's source: a batch read starts at the beginning, a new streaming query at the end.
    starting = get(
        "startingoffsets",
        lambda n, t: _offsets(n, t, ("earliest", "latest")),
        Offsets("latest" if streaming else "earliest"),
    )
    ending = None
    if not streaming:
        ending = get("endingoffsets", lambda n, t: _offsets(n, t, ("latest",)), Offsets("latest"))
    space = opts.get("space")
    if space is not None:
        if not space.strip():
            raise OptionError("space", "must name a space")
        if "bucket" in opts:
            raise OptionError("bucket", "a space is read from its own bucket: give space or bucket, not both")
    topic = opts.get("topic")
    if topic is not None:
        if not topic.strip():
            raise OptionError("topic", "must name a topic")
        if space is not None:
            raise OptionError("topic", "give space or topic, not both")
        if "includedeletes" in opts:
            raise OptionError("includeDeletes", "a topic's messages are never deleted: not with topic")
    if "xattrs" in opts and (space is not None or topic is not None):
        raise OptionError("xattrs", "a space's tuples and a topic's messages have no extended attributes")
    user = opts.get("user")
    password = opts.get("password")
    if (user is None) != (password is None):
        raise OptionError("user" if user is None else "password", "user and password go together")
    return Options(
        nodes=get("nodes", _nodes, ("127.0.0.1:11210",)),
        bucket=opts.get("bucket", "default") or "default",
        space=space.strip() if space is not None else None,
        topic=topic.strip() if topic is not None else None,
        vbuckets=get("vbuckets", _vbuckets, None),
        prefer_replica=get("preferreplica", _bool, True),
        starting_offsets=starting,
        ending_offsets=ending,
        max_records_per_batch=get("maxrecordsperbatch", _positive_int, None),
        read_on_driver=get("readondriver", _bool, False),
        fail_on_data_loss=get("failondataloss", _bool, True),
        include_deletes=get("includedeletes", _bool, True),
        xattrs=get("xattrs", _bool, False),
        user=user,
        password=password,
        num_partitions=get("numpartitions", _positive_int, None),
        timeout=get("timeout", _seconds, 10.0),
    )
