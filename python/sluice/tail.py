"""`sluice tail`: the live change stream of a bucket (over DCP) or a topic (over TANK) as JSON
lines, with the backfill's progress on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sluice import _native
from sluice.options import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, load_for
from sluice.probe import mismatch


def _parse_vbuckets(text: str) -> list[int]:
    """ "0,3,8-11" -> [0, 3, 8, 9, 10, 11]."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad vbucket list item {part!r} (use 0,3,8-11)")
        out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return out


def _text_or_base64(name: str, data: bytes, row: dict) -> None:
    import base64

    try:
        row[name] = data.decode("utf-8")
    except UnicodeDecodeError:
        row[name + "_base64"] = base64.b64encode(data).decode("ascii")


def _tuple_json(data: bytes) -> object:
    """A MessagePack value (an iproto tuple or key) as JSON-able objects: bytes (a varbinary, a
    string that is not UTF-8) become {"base64": ...}, a UUID or decimal its text, another
    extension {"ext": type, "base64": ...}; a map key that is a number, boolean or nil its JSON
    text, one that is bytes or a container "base64:" and its MessagePack bytes."""

    return json.loads(_native.msgpack_json(data))


class _BackfillProgress:
    """Progress of the backfills on stderr: a line at most every `every` seconds while one runs,
    and one when they have finished: none runs and the stream is idle or over (a vbucket whose
    backfill has not begun yet must not make the others look done)."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self.last = -every
        self.finished_reported = False

    def update(self, positions: dict, idle: bool = False) -> None:
        disk = [(seq, a, b) for seq, a, b, is_disk in positions.values() if is_disk]
        if not disk:
            return
        total = sum(b - a + 1 for _, a, b in disk)
        done = sum(max(0, min(seq, b) - a + 1) for seq, a, b in disk)
        running = sum(1 for seq, _, b in disk if seq < b)
        now = time.monotonic()
        if running:
            self.finished_reported = False
            if now - self.last < self.every:
                return
            pct = 100 * done / total
            line = f"backfill: {running} vbuckets running, {done:,} of {total:,} seqnos ({pct:.0f}%)"
        elif not self.finished_reported and idle:
            self.finished_reported = True
            line = f"backfill: done, {total:,} seqnos from {len(disk)} vbuckets"
        else:
            return
        self.last = now
        print(line, file=sys.stderr, flush=True)


def _replica_vbuckets_if_no_active(
    address: str, bucket: str, user: str | None, password: str | None
) -> list[int] | None:
    """None (every active vbucket) when the node has an active vbucket in `bucket`; else the
    vbuckets it holds as a replica, announced on stderr."""
    login = {"bucket": bucket, "username": user, "password": password}
    if _native.vbucket_positions(address, state="active", **login):
        return None
    replicas = sorted(vb for vb, _, _ in _native.vbucket_positions(address, state="replica", **login))
    if replicas:
        print(
            f"sluice tail: {address} has no active vbucket in bucket {bucket!r} (a replica node): "
            f"streaming the {len(replicas)} vbucket(s) it replicates",
            file=sys.stderr,
            flush=True,
        )
        return replicas
    return None


def cmd_tail_topic(args: argparse.Namespace) -> int:
    """Follows a topic's partitions over TANK's protocol and prints their messages."""

    from sluice.client import write_atomically
    from sluice.tank import TAIL, NotLeader, OutOfRange, TankConnection, TankError

    misplaced = [
        flag
        for flag, given in (
            ("--vbuckets", args.vbuckets),
            ("--tuples", args.tuples),
            ("--user", args.user),
            ("--password-stdin", args.password_stdin),
            ("--bucket", args.bucket != "default"),
        )
        if given
    ]
    if misplaced:
        print(f"sluice tail: {', '.join(misplaced)} are for buckets, not --topic", file=sys.stderr)
        return EXIT_USAGE
    address = args.address or load_for(args).values["tank_listen"]
    if not address:
        print("sluice tail: no TANK listener (tank_listen is off): give --address", file=sys.stderr)
        return EXIT_USAGE
    try:
        saved = json.loads(Path(args.state).read_text()) if args.state and Path(args.state).exists() else {}
        positions = {int(p): int(seq) for p, seq in saved.get("partitions", {}).items()}
    except (ValueError, OSError, AttributeError) as e:
        print(f"sluice tail: --state {args.state}: not a topic position file ({e})", file=sys.stderr)
        return EXIT_USAGE
    printed = 0
    out = sys.stdout
    # A connection per broker: in a sluice cluster each partition is read from its leader.
    conns: dict[str, TankConnection] = {}

    def conn(at: str) -> TankConnection:
        if at not in conns:
            conns[at] = TankConnection(at)
        return conns[at]

    try:
        tank = conn(address)
        known = tank.ranges(args.topic) if args.topic in dict(tank.topics()) else None
        if known is None:
            print(f"sluice tail: topic {args.topic!r} is unknown at {address}", file=sys.stderr)
            return EXIT_FAILURE
        try:
            wanted = _parse_vbuckets(args.partitions) if args.partitions else range(len(known))
        except ValueError as e:
            print(f"sluice tail: --partitions: {e}", file=sys.stderr)
            return EXIT_USAGE
        start = 0 if args.start == "beginning" else TAIL
        seqs = {p: positions.get(p, start) for p in wanted if p < len(known)}
        if len(seqs) != len(wanted):
            print(f"sluice tail: topic {args.topic!r} has {len(known)} partition(s)", file=sys.stderr)
            return EXIT_USAGE
        # A partition no broker leads yet (a topic just created in a cluster) is waited for.
        while leaderless := sorted(p for p in seqs if known[p] is None):
            print(f"sluice tail: no broker leads partition(s) {leaderless} now", file=sys.stderr)
            time.sleep(1.0)
            if None not in [tank.leaders(args.topic)[p] for p in leaderless]:
                known = tank.ranges(args.topic)
        # --until-now: each partition's high-water mark at the start.
        until = {p: (known[p] or (0, 0))[1] for p in seqs} if args.until_now else None
        if until is not None:
            seqs = {p: s for p, s in seqs.items() if s != TAIL and until[p] and s <= until[p]}
        leaders = tank.leaders(args.topic)
        header = False
        while seqs:
            by_leader: dict[str | None, dict[int, int]] = {}
            for p, seq in seqs.items():
                by_leader.setdefault(leaders[p], {})[p] = seq
            fetched = []
            for leader, asked in by_leader.items():
                if leader is None:
                    # Its leader is failed over: asked again until one leads it.
                    print(f"sluice tail: no broker leads partition(s) {sorted(asked)} now", file=sys.stderr)
                    time.sleep(1.0)
                    leaders = tank.leaders(args.topic)
                    continue
                try:
                    fetched += conn(leader).consume_partitions(
                        args.topic, asked, max_wait=1.0 / len(by_leader), min_bytes=1
                    )
                except NotLeader:
                    leaders = tank.leaders(args.topic)
                except OutOfRange as e:
                    # Retention dropped messages this position had not read: go on from the oldest.
                    print(f"sluice tail: {e}; going on from {e.first_available}", file=sys.stderr)
                    seqs[e.partition] = e.first_available
                except TankError as e:
                    if leader == address:
                        raise
                    # The leader went away: the node given says where the partitions are now
                    # (a new leader, or none until one leads them).
                    print(f"sluice tail: {leader}: {e}; asking {address} for the leaders", file=sys.stderr)
                    conns.pop(leader).close()
                    time.sleep(0.5)
                    leaders = tank.leaders(args.topic)
            for f in fetched:
                for m in f.messages:
                    if until is not None and m.seq > until[f.partition]:
                        break
                    if args.format == "json":
                        row = {"partition": f.partition, "seq": m.seq, "ts": m.ts}
                        if m.key is not None:
                            _text_or_base64("key", m.key, row)
                        if not args.no_values:
                            _text_or_base64("content", m.content, row)
                        out.write(json.dumps(row) + "\n")
                    else:
                        if not header:
                            out.write(f"{'partition':>9}  {'seq':>12}  {'ts':>13}  key  content\n")
                            header = True
                        key = (m.key or b"").decode("utf-8", "backslashreplace")
                        text = "" if args.no_values else m.content.decode("utf-8", "backslashreplace")
                        out.write(f"{f.partition:>9}  {m.seq:>12}  {m.ts:>13}  {key or '-'}  {text}\n")
                    printed += 1
                    if args.max and printed >= args.max:
                        return EXIT_OK
                seqs[f.partition] = positions[f.partition] = f.next_seq
                if until is not None and f.next_seq > until[f.partition]:
                    del seqs[f.partition]
            out.flush()
            if args.state:
                write_atomically(args.state, json.dumps({"topic": args.topic, "partitions": positions}))
    except TankError as e:
        print(f"sluice tail: {mismatch(address, 'tank') or e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        sys.stderr.close()
    finally:
        for c in conns.values():
            c.close()
    return EXIT_OK


def _login_hint(e: Exception, user: str | None) -> str:
    """A hint for a refusal that comes from logging in as nobody, or as a user without the
    permission (memcached statuses 0x20 AUTH_ERROR and 0x24 EACCESS)."""
    text = str(e)
    if "status 0x20" not in text and "status 0x24" not in text:
        return ""
    if user is None:
        return " (the node has users: pass --user NAME, a user with the stream permission on the bucket)"
    return f" ({user} lacks the stream permission on the bucket, or its password is wrong)"


def _stream_failed(address: str, e: Exception, user: str | None) -> str:
    """Why the stream from `address` failed: what answers there when it is not a memcached
    port (the admin endpoint, another front, a port that says nothing), else the error with a
    hint for a missing login."""
    return mismatch(address, "kv") or f"{e}{_login_hint(e, user)}"


def cmd_tail(args: argparse.Namespace) -> int:
    """Follows a bucket's DCP stream (or with --topic, a topic's partitions) and prints its
    changes."""

    from sluice.client import Client, split_xattrs

    if args.topic:
        return cmd_tail_topic(args)

    try:
        vbuckets = _parse_vbuckets(args.vbuckets) if args.vbuckets else None
    except ValueError as e:
        print(f"sluice tail: --vbuckets: {e}", file=sys.stderr)
        return EXIT_USAGE
    address = args.address or load_for(args).values["listen"]
    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else None
    client = Client(address, bucket=args.bucket, username=args.user, password=password)
    if vbuckets is None:
        # "Every active vbucket" of a replica node is none: there, tail follows the vbuckets it
        # replicates instead (the copy it serves, as the Spark source reads replicas), and says so.
        try:
            vbuckets = _replica_vbuckets_if_no_active(address, args.bucket, args.user, password)
        except _native.SluiceError as e:
            print(f"sluice tail: {_stream_failed(address, e, args.user)}", file=sys.stderr)
            return EXIT_FAILURE
    state = args.state if args.state and Path(args.state).exists() else None
    progress = _BackfillProgress()
    printed = 0
    table_header = False
    try:
        stream = client.stream(
            vbuckets,
            start=args.start,
            end="now" if args.until_now else None,
            state=state,
            rollback="resume",
            format="python",
            values=not args.no_values,
            xattrs=args.xattrs,
            skip_empty=False,
            follow_moves=not args.no_follow,
        )
    except ValueError as e:
        print(f"sluice tail: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except _native.SluiceError as e:
        print(f"sluice tail: {_stream_failed(address, e, args.user)}", file=sys.stderr)
        return EXIT_FAILURE
    out = sys.stdout
    try:
        with stream:
            for batch in stream:
                for c in batch:
                    if args.tuples:
                        try:
                            key = _tuple_json(c.key)
                            tup = _tuple_json(c.value) if c.op == "mutation" and not args.no_values else None
                        except ValueError as e:
                            print(
                                f"sluice tail: --tuples: vbucket {c.vbucket} seqno {c.seqno} is not an "
                                f"iproto tuple ({e}): is {args.bucket!r} the bucket of a space?",
                                file=sys.stderr,
                            )
                            return EXIT_FAILURE
                    value = c.value
                    if args.xattrs:
                        xattrs, value = split_xattrs(c.value, c.datatype)
                    if args.format == "json":
                        row = {"vbucket": c.vbucket, "seqno": c.seqno, "op": c.op}
                        if args.tuples:
                            row["key"] = key
                            if tup is not None:
                                row["tuple"] = tup
                        else:
                            _text_or_base64("key", c.key, row)
                        if not args.no_values and c.op == "mutation" and not args.tuples:
                            _text_or_base64("value", value, row)
                        if args.xattrs:
                            row["xattrs"] = xattrs
                        row.update(cas=c.cas, rev_seqno=c.rev_seqno, flags=c.flags, expiry=c.expiry)
                        out.write(json.dumps(row) + "\n")
                    else:
                        if not table_header:
                            out.write(f"{'vbucket':>7}  {'seqno':>12}  {'op':<10}  {'rev':>6}  key\n")
                            table_header = True
                        if args.tuples:
                            text = json.dumps(key) + ("  " + json.dumps(tup) if tup is not None else "")
                        else:
                            text = c.key.decode("utf-8", "backslashreplace")
                        out.write(f"{c.vbucket:>7}  {c.seqno:>12}  {c.op:<10}  {c.rev_seqno:>6}  {text}\n")
                    printed += 1
                    if args.max and printed >= args.max:
                        break
                out.flush()
                for vb, seqno in stream.rollbacks:
                    print(f"sluice tail: vbucket {vb} rolled back to seqno {seqno}", file=sys.stderr)
                stream.rollbacks.clear()
                if args.state:
                    stream.save_state(args.state)
                progress.update(stream.positions(), idle=not batch)
                if args.max and printed >= args.max:
                    break
            progress.update(stream.positions(), idle=True)
    except _native.SluiceError as e:
        print(f"sluice tail: {_stream_failed(address, e, args.user)}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # A reader like `head` went away: what was printed is in the state file already.
        sys.stderr.close()
    return EXIT_OK
