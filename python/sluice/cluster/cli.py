"""`sluice cluster ...`: what a person asks of a cluster (status, the map, adding and removing
nodes, rebalance, failover), through etcd: the orchestrator acts on the requests."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.cluster import vbmap
from sluice.cluster.keys import Keys, dump
from sluice.cluster.topicmap import in_sync_copies

# etcd's client (http.client, ssl) is imported when a cluster command runs: every `sluice`
# command builds this parser, `sluice serve` among them, and a replica's start is timed.
if TYPE_CHECKING:
    from sluice.cluster.etcd import Etcd

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def connect(
    url: str, *, user: str | None = None, password_file: str | None = None, ca: str | None = None
) -> tuple[Etcd, Keys]:
    from sluice.cluster.etcd import Etcd, parse_cluster_url

    endpoints, name = parse_cluster_url(url)
    try:
        password = Path(password_file).read_text().rstrip("\n") if password_file else None
    except OSError as e:
        raise ValueError(f"--etcd-password-file: cannot read {password_file}: {e.strerror}") from None
    return Etcd(endpoints, username=user, password=password, ca_file=ca), Keys(name)


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _state(etcd: Etcd, keys: Keys) -> dict[str, Any]:
    kvs, revision = etcd.get_prefix(keys.root)
    out: dict[str, Any] = {"nodes": {}, "status": {}, "map": None, "rebalance": None, "orchestrator": None}
    for kv in kvs:
        rest = kv.key[len(keys.root) :]
        if rest.startswith("nodes/"):
            out["nodes"][rest[6:]] = kv.json()
        elif rest.startswith("status/"):
            out["status"][rest[7:]] = kv.json()
        elif rest == "map":
            out["map"] = kv.json()
            out["map_revision"] = kv.mod_revision
        elif rest == "rebalance":
            out["rebalance"] = kv.json()
        elif rest == "orchestrator":
            out["orchestrator"] = kv.value.decode()
    out["revision"] = revision
    return out


def _high(st: dict[str, Any], node: str | None, vb: int) -> str:
    """A node's high seqno of `vb`, summed over buckets, from its published status."""
    s = st["status"].get(node or "")
    return str(sum(b["high"][vb] for b in s["buckets"].values())) if s else "?"


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} ({100 * done // max(total, 1)}%)"


def cmd_status(args: argparse.Namespace, etcd: Etcd, keys: Keys) -> int:
    st = _state(etcd, keys)
    doc = st["map"]
    if doc is None:
        print(f"cluster {keys.cluster}: no map yet ({len(st['nodes'])} node(s) registered)")
        return EXIT_FAILURE
    counts = vbmap.summary(doc["chains"])
    print(
        f"cluster {keys.cluster}  map rev {st['map_revision']}  orchestrator {st['orchestrator'] or 'none'}  "
        f"{doc['num_vbuckets']} vbuckets x {1 + doc['replicas']} copies  "
        f"automatic failovers {doc.get('auto_failovers', 0)}"
    )
    rows = [("node", "kv", "group", "health", "active", "replica", "in map")]
    for n in sorted(set(doc["nodes"]) | set(st["nodes"]) | set(doc["wanted"])):
        info = st["nodes"].get(n) or doc["nodes"].get(n, {})
        health = "up" if n in st["nodes"] else "down"
        if n in doc["failed"]:
            health += ", failed over"
        a, r = counts.get(n, (0, 0))
        role = "yes" if n in doc["nodes"] else "no"
        if n in doc["wanted"] and n not in doc["nodes"]:
            role = "to add"
        elif n in doc["nodes"] and n not in doc["wanted"]:
            role = "to remove"
        rows.append((n, info.get("kv", "?"), info.get("group", "") or "-", health, str(a), str(r), role))
    print()
    _table(rows)
    unserved = [vb for vb, c in enumerate(doc["chains"]) if c[0] is None]
    short = sum(1 for c in doc["chains"] if None in c[1:])
    print()
    serving = [counts.get(n, (0, 0)) for n in doc["nodes"] if n not in doc["failed"]] or [(0, 0)]
    actives = [a for a, _ in serving]
    replicas = [r for _, r in serving]
    print(
        f"balance: actives per node {min(actives)}-{max(actives)}, replicas per node "
        f"{min(replicas)}-{max(replicas)}; {short} vbucket(s) short of a replica; "
        f"{len(unserved)} without an active" + (f" ({unserved[:10]})" if unserved else "")
    )
    topics = doc.get("topics", {})
    if topics:
        # Each partition's leader, its copies and those in sync; one whose leader failed with no
        # copy in sync left has none until it returns.
        print()
        rows = [("topic", "partition", "leader", "copies", "in sync")]
        for name in sorted(topics):
            in_sync = in_sync_copies(topics[name])
            for p, chain in enumerate(topics[name]["chains"]):
                leader = chain[0] if chain and chain[0] not in doc["failed"] else None
                copies = [n for n in chain[1:] if n is not None]
                waiting = f"none (waits for {', '.join(in_sync[p])})" if in_sync[p] else "none"
                rows.append(
                    (
                        name,
                        str(p),
                        leader or waiting,
                        ", ".join(copies) or "-",
                        ", ".join(n for n in in_sync[p] if n == leader or n in copies) or "-",
                    )
                )
        _table(rows)
    reb = st["rebalance"]
    if reb:
        line = f"rebalance: {reb.get('state')}"
        if "total" in reb:
            line += " " + _bar(reb.get("done", 0), reb["total"])
        if reb.get("error"):
            line += f": {reb['error']}"
        print(line)
    if args.vbuckets:
        print()
        rows = [("vbucket", "active", "replicas", "active seqno", "replica seqnos")]
        for vb, c in enumerate(doc["chains"]):
            reps = [x for x in c[1:] if x]
            seqs = [_high(st, x, vb) for x in c[:1] + reps]
            rows.append((str(vb), c[0] or "-", ",".join(reps) or "-", seqs[0], ",".join(seqs[1:]) or "-"))
        _table(rows)
    return EXIT_OK


def cmd_map(args: argparse.Namespace, etcd: Etcd, keys: Keys) -> int:
    kv = etcd.get(keys.map)
    if kv is None:
        print(f"sluice cluster map: cluster {keys.cluster} has no map yet", file=sys.stderr)
        return EXIT_FAILURE
    doc = {**kv.json(), "revision": kv.mod_revision}
    if args.json:
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    rows = [("vbucket", *(["active"] + [f"replica {i}" for i in range(1, doc["replicas"] + 1)]))]
    for vb, c in enumerate(doc["chains"]):
        rows.append((str(vb), *(x or "-" for x in c)))
    _table(rows)
    return EXIT_OK


def _change_wanted(etcd: Etcd, keys: Keys, add: list[str], remove: list[str]) -> dict[str, Any]:
    from sluice.cluster.etcd import EtcdError

    for _ in range(20):
        kv = etcd.get(keys.map)
        if kv is None:
            raise EtcdError(f"cluster {keys.cluster} has no map yet: start a node with --cluster first")
        doc = kv.json()
        wanted = [n for n in doc["wanted"] if n not in remove] + [n for n in add if n not in doc["wanted"]]
        if not wanted:
            raise EtcdError("that would remove every node")
        if etcd.put_if(keys.map, dump({**doc, "wanted": wanted}), mod_revision=kv.mod_revision):
            return doc
        time.sleep(0.05)
    raise EtcdError("the map kept changing; try again")


def cmd_add(args: argparse.Namespace, etcd: Etcd, keys: Keys) -> int:
    registered, _ = etcd.get_prefix(keys.node())
    names = {kv.key.rsplit("/", 1)[1] for kv in registered}
    missing = [n for n in args.nodes if n not in names]
    if missing:
        print(
            f"sluice cluster add: not registered in cluster {keys.cluster}: {', '.join(missing)} "
            f"(start them with --cluster; registered: {', '.join(sorted(names)) or 'none'})",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    _change_wanted(etcd, keys, args.nodes, [])
    print(f"added {', '.join(args.nodes)}; `sluice cluster rebalance` moves vbuckets to them")
    return EXIT_OK


def cmd_remove(args: argparse.Namespace, etcd: Etcd, keys: Keys) -> int:
    _change_wanted(etcd, keys, [], args.nodes)
    print(f"removing {', '.join(args.nodes)}; `sluice cluster rebalance` moves their vbuckets away")
    return EXIT_OK


def cmd_rebalance(args: argparse.Namespace, etcd: Etcd, keys: Keys) -> int:
    before = etcd.get(keys.rebalance)
    etcd.put(keys.request("rebalance"), dump({"at": time.time()}))
    if args.no_wait:
        print("rebalance requested")
        return EXIT_OK
    deadline = time.monotonic() + args.timeout
    started = False
    tty = sys.stdout.isatty()
    last = ""
    while time.monotonic() < deadline:
        kv = etcd.get(keys.rebalance)
        if kv is not None and (before is None or kv.mod_revision > before.mod_revision):
            reb = kv.json()
            started = True
            line = f"rebalance {reb.get('state')} " + _bar(reb.get("done", 0), reb.get("total", 0))
            if reb.get("phase") == "waiting":
                line += f" waiting for {', '.join(reb.get('waiting_for', []))} (gone)"
            elif reb.get("state") == "running" and reb.get("phase") not in (None, "moving"):
                # Past the vbuckets' moves: what it waits for (the bar is full then).
                line += f" {reb['phase']}"
            if line != last:
                print(("\r" if tty else "") + line, end="" if tty else "\n", flush=True)
                last = line
            if reb.get("state") != "running":
                if tty:
                    print()
                if reb.get("state") == "done":
                    pauses = sorted(reb.get("pauses_ms", []))
                    if pauses:
                        p50, p99 = (
                            pauses[len(pauses) // 2],
                            pauses[min(len(pauses) - 1, len(pauses) * 99 // 100)],
                        )
                        print(
                            f"moved {len(pauses)} active vbucket(s), {reb.get('items', 0):,} items in "
                            f"{reb.get('finished', time.time()) - reb['started']:.1f} s; writes paused per "
                            f"vbucket p50 {p50:.1f} ms, p99 {p99:.1f} ms"
                        )
                    return EXIT_OK
                print(
                    f"sluice cluster rebalance: {reb.get('state')}: {reb.get('error', '')}", file=sys.stderr
                )
                return EXIT_FAILURE
        time.sleep(0.1)
    print(
        "sluice cluster rebalance: "
        + (
            "still running; `sluice cluster status` shows its progress"
            if started
            else "no orchestrator took it up"
        ),
        file=sys.stderr,
    )
    return EXIT_FAILURE


def cmd_request(what: str, message: str) -> Any:
    def run(args: argparse.Namespace, etcd: Etcd, keys: Keys) -> int:
        target = what.format(node=getattr(args, "node", ""))
        etcd.put(keys.request(target), dump({"at": time.time()}))
        print(message.format(node=getattr(args, "node", "")))
        return EXIT_OK

    return run


def run(args: argparse.Namespace) -> int:
    from sluice.cluster.etcd import EtcdError

    url = args.cluster or os.environ.get("SLUICE_CLUSTER")
    if not url:
        print("sluice cluster: give --cluster etcd://HOST:PORT/NAME (or set SLUICE_CLUSTER)", file=sys.stderr)
        return EXIT_USAGE
    try:
        etcd, keys = connect(url, user=args.etcd_user, password_file=args.etcd_password_file, ca=args.etcd_ca)
        return int(args.cluster_func(args, etcd, keys))
    except ValueError as e:
        print(f"sluice cluster: {e}", file=sys.stderr)
        return EXIT_USAGE
    except EtcdError as e:
        print(f"sluice cluster: {_what_answered(url, str(e)) or e}", file=sys.stderr)
        return EXIT_FAILURE


def _what_answered(url: str, error: str) -> str | None:
    """For etcd unreachable or answering as no etcd does: what is at its first endpoint
    instead (a sluice port, nothing), in one line; None when that says nothing more."""
    from sluice.cluster.etcd import parse_cluster_url
    from sluice.probe import mismatch

    if "unreachable" not in error and "HTTP 404" not in error:
        return None
    try:
        first = parse_cluster_url(url)[0][0]
    except ValueError:
        return None
    return mismatch(
        f"{first.host}:{first.port}",
        "etcd",
        wanted="an etcd client endpoint (etcd://HOST:PORT/NAME, etcd's port 2379)",
    )


def add_parser(sub: Any) -> None:
    c = sub.add_parser(
        "cluster", help="a cluster on etcd: status, map, add/remove nodes, rebalance, failover"
    )
    c.set_defaults(func=run)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--cluster", metavar="URL", help="etcd://HOST:PORT/CLUSTER_NAME (default: $SLUICE_CLUSTER)"
    )
    common.add_argument("--etcd-user", metavar="USER", help="etcd user, if etcd has authentication on")
    common.add_argument("--etcd-password-file", metavar="PATH", help="file holding the etcd user's password")
    common.add_argument("--etcd-ca", metavar="PEM", help="CA to verify etcd's certificate by (etcds://)")
    csub = c.add_subparsers(dest="cluster_command", metavar="ACTION")
    csub.required = True
    s = csub.add_parser("status", parents=[common], help="nodes, health, balance, rebalance progress")
    s.add_argument("--vbuckets", action="store_true", help="also every vbucket's chain and seqnos")
    s.set_defaults(cluster_func=cmd_status)
    m = csub.add_parser("map", parents=[common], help="the vbucket map")
    m.add_argument("--json", action="store_true", help="as JSON, with its revision")
    m.set_defaults(cluster_func=cmd_map)
    a = csub.add_parser("add", parents=[common], help="add registered nodes (then rebalance)")
    a.add_argument("nodes", nargs="+", metavar="NODE")
    a.set_defaults(cluster_func=cmd_add)
    r = csub.add_parser("remove", parents=[common], help="remove nodes (then rebalance)")
    r.add_argument("nodes", nargs="+", metavar="NODE")
    r.set_defaults(cluster_func=cmd_remove)
    rb = csub.add_parser(
        "rebalance", parents=[common], help="move vbuckets to the wanted nodes, with progress"
    )
    rb.add_argument("--no-wait", action="store_true", help="ask for it and return")
    rb.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for it (default: 3600)")
    rb.set_defaults(cluster_func=cmd_rebalance)
    sr = csub.add_parser(
        "stop-rebalance", parents=[common], help="stop the rebalance after the moves under way"
    )
    sr.set_defaults(cluster_func=cmd_request("stop-rebalance", "rebalance stop requested"))
    f = csub.add_parser("failover", parents=[common], help="fail a node over by hand")
    f.add_argument("node", metavar="NODE")
    f.set_defaults(cluster_func=cmd_request("failover/{node}", "failover of {node} requested"))
    rf = csub.add_parser(
        "reset-failovers", parents=[common], help="acknowledge automatic failovers so more may happen"
    )
    rf.set_defaults(cluster_func=cmd_request("reset-failovers", "automatic failover count reset requested"))
