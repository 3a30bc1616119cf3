"""DCP streaming throughput into the native consumer. Writes bench/results/dcp.{json,md,png}.

    python bench/dcp_bench.py [--items 1000000] [--runs 3]

For every source (memory, backfill) x value size (100 B, 1 KiB) x consumers (1, 4), each run
opens a fresh embedded engine (wal.mode none) and server in this process, loads --items items
(16-byte keys b"key:%012d"), then streams them from seqno 0 to the high seqno with
sluice._native.DcpConsumer, counting rows without converting them. Rates are items (and
payload: key + value bytes) over the wall time from the first consumer's start to the last
one's end. 4 consumers split the 64 vbuckets in quarters (no fan-out: every item is sent once).

- backfill: nothing holds the checkpoints while loading, so they are freed and the streams
  start by backfill.
- memory: a pinning DCP connection, opened before the load, holds a cursor at seqno 0 on every
  vbucket and never reads, so the checkpoints keep every item for the measured streams.

The admin endpoint's sluice_dcp_items_total{source=...} counts where the items came from; a
run fails unless the intended source sent at least 99% of them.
This machine is shared and noisy: every figure is the median of --runs runs, all runs kept.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import sluice
from _common import MC_HEADER, RESULTS, admin_get, pyplot, write_json
from sluice._native import DcpConsumer, Server

SOURCES = ("memory", "backfill")
VALUE_SIZES = (100, 1024)
CONSUMERS = (1, 4)
NUM_VBUCKETS = 64  # the default bucket's
KEY_SIZE = len(b"key:%012d" % 0)
LOAD_CHUNK = 10_000
# Targets: items/s by source with 100-byte values; MB/s (10^6 bytes of key + value) with 1 KiB.
TARGET_ITEMS_PER_S = {"memory": 3_000_000, "backfill": 1_500_000}
TARGET_MB_PER_S_1KIB = 1000
MIN_SOURCE_SHARE = 0.99
# A stream that delivers nothing for this long has stalled.
STALL_S = 30.0
# Progress lines: one per run, with the items each source sent (admin metrics).
PROGRESS = "{:<9} {:>6} {:>9} {:>3} {:>12} {:>7} {:>21} {:>11} {:>11}"


def open_engine(data_dir: str, items: int) -> sluice.EmbeddedEngine:
    # Bucket settings are not top-level keys, so they cannot be open_engine overrides.
    cfg = sluice.Config.from_dict(
        {
            "data_dir": data_dir,
            "wal": {"mode": "none"},
            "snapshot": {"interval": 0},
            "expiry_pager_interval": 3600,
            # One checkpoint per vbucket for the whole load.
            "checkpoint": {"max_items": max(items, 1)},
            # Room for every item twice (item store and pinned checkpoints) with no cursor
            # dropped for checkpoint memory.
            "buckets": {"default": {"memory_quota": "8GiB", "checkpoint_memory_ratio": 0.5}},
        }
    )
    return sluice.open_engine(cfg)


def load(engine: sluice.EmbeddedEngine, items: int, value_size: int) -> None:
    value = b"v" * value_size
    for start in range(0, items, LOAD_CHUNK):
        engine.set_many([(b"key:%012d" % i, value) for i in range(start, min(start + LOAD_CHUNK, items))])


def items_by_source(admin_address: str) -> dict[str, int]:
    text = admin_get(admin_address, "/metrics")
    counts = {}
    for source in SOURCES:
        prefix = f'sluice_dcp_items_total{{source="{source}"}} '
        counts[source] = next(
            int(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)
        )
    return counts


# DCP frames by hand (layouts as in tests/dcp_wire.py), for the pinning connection only.
REQUEST, RESPONSE = 0x80, 0x81
DCP_OPEN, DCP_STREAM_REQ, DCP_STREAM_END, DCP_CONTROL = 0x50, 0x53, 0x55, 0x5E
MAX_SEQNO = 2**64 - 1


class PinningConnection:
    """A DCP producer connection whose streams from seqno 0 never advance their cursors.

    Its flow-control window (connection_buffer_size 1) is closed before any stream has data: a
    first stream on vbucket 0 that ends at seqno 0 sends only its STREAM_END, which exceeds the
    window and is never acknowledged. The streams opened after that hold cursors at 0 that the
    producer never reads (it reads a cursor only to fill an open window), so every change
    loaded afterwards stays in the checkpoints.
    """

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self._call(DCP_OPEN, key=b"bench:pin", extras=struct.pack(">II", 0, 1))  # flag 1: producer
        self._call(DCP_CONTROL, key=b"connection_buffer_size", value=b"1")
        self._call(DCP_STREAM_REQ, extras=self._stream_extras(end=0), vbucket=0)
        magic, opcode, _, _ = self._read_frame()
        if (magic, opcode) != (REQUEST, DCP_STREAM_END):
            raise RuntimeError(f"pinning connection: expected STREAM_END, got {magic:#x} {opcode:#x}")
        for vb in range(NUM_VBUCKETS):
            self._call(DCP_STREAM_REQ, extras=self._stream_extras(end=MAX_SEQNO), vbucket=vb)

    @staticmethod
    def _stream_extras(end: int) -> bytes:
        # flags, reserved, start, end, vbucket uuid, snapshot start, snapshot end
        return struct.pack(">IIQQQQQ", 0, 0, 0, end, 0, 0, 0)

    def _call(
        self, opcode: int, key: bytes = b"", value: bytes = b"", extras: bytes = b"", vbucket: int = 0
    ) -> None:
        body = len(extras) + len(key) + len(value)
        head = MC_HEADER.pack(REQUEST, opcode, len(key), len(extras), 0, vbucket, body, 0, 0)
        self.sock.sendall(head + extras + key + value)
        magic, got, status, payload = self._read_frame()
        if (magic, got, status) != (RESPONSE, opcode, 0):
            raise RuntimeError(f"pinning connection: opcode {opcode:#x} got status {status:#x}: {payload!r}")

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("pinning connection closed by the server")
            buf += chunk
        return bytes(buf)

    def _read_frame(self) -> tuple[int, int, int, bytes]:
        magic, opcode, _, _, _, status, body, _, _ = MC_HEADER.unpack(self._recv(MC_HEADER.size))
        return magic, opcode, status, self._recv(body)

    def close(self) -> None:
        self.sock.close()


def drain(consumer: DcpConsumer) -> tuple[int, float]:
    """Counts the consumer's rows until its streams finish; returns them and the end time."""
    rows = 0
    last = time.monotonic()
    while True:
        ev = consumer.next_event(1.0)
        if ev is None:
            if time.monotonic() - last > STALL_S:
                raise RuntimeError(f"stream stalled: nothing for {STALL_S:.0f} s after {rows:,} rows")
            continue
        last = time.monotonic()
        if ev[0] == "batch":
            rows += ev[1].num_rows
        elif ev[0] == "finished":
            return rows, time.perf_counter()
        else:
            raise RuntimeError(f"unexpected event {ev!r}")


def run_once(source: str, value_size: int, consumers: int, items: int) -> dict:
    with tempfile.TemporaryDirectory() as d, open_engine(d, items) as engine:
        server = Server(
            engine, json.dumps({"listeners": {"listen": "127.0.0.1:0"}, "admin_listen": "127.0.0.1:0"})
        )
        pin = None
        try:
            if source == "memory":
                pin = PinningConnection(server.address)
            t = time.perf_counter()
            load(engine, items, value_size)
            load_s = time.perf_counter() - t
            admin = server.admin_address
            assert admin is not None
            before = items_by_source(admin)
            vbs = [
                list(range(i * NUM_VBUCKETS // consumers, (i + 1) * NUM_VBUCKETS // consumers))
                for i in range(consumers)
            ]
            with ThreadPoolExecutor(consumers) as pool:
                t0 = time.perf_counter()
                streams = [
                    DcpConsumer(server.address, name=f"bench:dcp:{i}", vbuckets=v, to_latest=True)
                    for i, v in enumerate(vbs)
                ]
                try:
                    done = list(pool.map(drain, streams))
                finally:
                    for c in streams:
                        c.close()
            seconds = max(end for _, end in done) - t0
            after = items_by_source(admin)
        finally:
            if pin is not None:
                pin.close()
            server.stop()
    received = sum(rows for rows, _ in done)
    if received != items:
        raise RuntimeError(f"{source}: received {received:,} items, loaded {items:,}")
    sent = {s: after[s] - before[s] for s in SOURCES}
    if sent[source] < MIN_SOURCE_SHARE * items:
        raise RuntimeError(f"{source} run: items by source {sent}, expected {items:,} from {source}")
    return {
        "items": received,
        "per_consumer": [rows for rows, _ in done],
        "seconds": seconds,
        "items_per_s": received / seconds,
        "mb_per_s": received * (KEY_SIZE + value_size) / seconds / 1e6,
        "from_memory": sent["memory"],
        "from_backfill": sent["backfill"],
        "load_s": load_s,
    }


def target(source: str, value_size: int) -> tuple[str, int]:
    """The figure a configuration is held to and its minimum: items/s for small values, MB/s
    for 1 KiB values."""
    if value_size >= 1024:
        return "mb_per_s", TARGET_MB_PER_S_1KIB
    return "items_per_s", TARGET_ITEMS_PER_S[source]


def show_target(source: str, value_size: int) -> str:
    key, minimum = target(source, value_size)
    return f"≥ {minimum:,} {'MB/s' if key == 'mb_per_s' else 'items/s'}"


def write_outputs(res: dict) -> None:
    write_json(RESULTS / "dcp.json", res)
    rows = [
        "| source | value | consumers | items/s | MB/s | runs (items/s) | target | met | from the source |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["configs"]:
        key, minimum = target(c["source"], c["value_size"])
        share = min(r[f"from_{c['source']}"] / r["items"] for r in c["runs"])
        all_runs = ", ".join(f"{r['items_per_s']:,.0f}" for r in c["runs"])
        rows.append(
            f"| {c['source']} | {c['value_size']:,} B | {c['consumers']} | {c['items_per_s']:,.0f} | "
            f"{c['mb_per_s']:,.0f} | {all_runs} | {show_target(c['source'], c['value_size'])} | "
            f"{'yes' if c[key] >= minimum else 'no'} | {share:.1%} |"
        )
    md = (
        f"# DCP streaming into the native consumer\n\n`python bench/dcp_bench.py --items {res['items']} "
        f"--runs {res['runs']}` on {res['machine']}, {res['date']}.\n\n"
        f"{res['items']:,} items ({KEY_SIZE}-byte keys) streamed from seqno 0 to the high seqno by "
        "`sluice._native.DcpConsumer` (default batch and buffer sizes), rows counted without "
        "conversion; server and consumers in one process. items/s and MB/s (10^6 bytes of key + "
        "value) are medians over the runs, from the first consumer's start to the last one's end. "
        "Targets: items/s with 100-byte values, MB/s with 1 KiB values. "
        "4 consumers split the 64 vbuckets in quarters (each item is sent once; not a fan-out). "
        '"from the source": the share of items the intended source sent (admin metrics), lowest '
        "run.\n\n" + "\n".join(rows) + "\n"
    )
    (RESULTS / "dcp.md").write_text(md)
    print(md)
    plt = pyplot()
    if plt is None:
        return
    groups = [(s, v) for s in SOURCES for v in VALUE_SIZES]
    by_key = {(c["source"], c["value_size"], c["consumers"]): c for c in res["configs"]}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key, scale, unit in (
        (axes[0], "items_per_s", 1e6, "million items/s"),
        (axes[1], "mb_per_s", 1, "MB/s (key + value)"),
    ):
        width = 0.8 / len(CONSUMERS)
        for j, n in enumerate(CONSUMERS):
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(groups))]
            vals = [by_key[(s, v, n)][key] / scale for s, v in groups]
            ax.bar(xs, vals, width, label=f"{n} consumer{'s' if n > 1 else ''}")
        for i, (s, v) in enumerate(groups):
            t_key, minimum = target(s, v)
            if t_key == key:
                ax.hlines(minimum / scale, i - 0.45, i + 0.45, colors="red", linestyles="--")
        ax.set_xticks(range(len(groups)), [f"{s}\n{v:,} B" for s, v in groups])
        ax.set_ylabel(f"{unit} (median)")
        ax.legend(fontsize=8)
    axes[0].set_title(f"DCP into the native consumer, {res['items']:,} items (red: target)")
    fig.tight_layout()
    fig.savefig(RESULTS / "dcp.png", dpi=110)
    print(f"wrote {RESULTS / 'dcp.png'}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    res: dict = {
        "items": args.items,
        "runs": args.runs,
        "key_size": KEY_SIZE,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}",
        "configs": [],
    }
    print(
        PROGRESS.format(
            "source", "value", "consumers", "run", "items/s", "MB/s", "target", "memory", "backfill"
        )
    )
    for source in SOURCES:
        for value_size in VALUE_SIZES:
            for consumers in CONSUMERS:
                runs = []
                for i in range(args.runs):
                    r = run_once(source, value_size, consumers, args.items)
                    runs.append(r)
                    print(
                        PROGRESS.format(
                            source,
                            value_size,
                            consumers,
                            i + 1,
                            f"{r['items_per_s']:,.0f}",
                            f"{r['mb_per_s']:,.0f}",
                            show_target(source, value_size),
                            f"{r['from_memory']:,}",
                            f"{r['from_backfill']:,}",
                        ),
                        flush=True,
                    )
                res["configs"].append(
                    {
                        "source": source,
                        "value_size": value_size,
                        "consumers": consumers,
                        "items_per_s": statistics.median(r["items_per_s"] for r in runs),
                        "mb_per_s": statistics.median(r["mb_per_s"] for r in runs),
                        "runs": runs,
                    }
                )
    write_outputs(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
