"""Policy plugins the TAP benchmark runs (bench/tap_bench.py): what a platform engineer might
write, not tuned for the benchmark."""

from __future__ import annotations

from sluice.policy import DROP, KEEP, AckPolicy, AckStats, FilterBatch, Prefixes, StreamFilter


class AdaptiveAck(AckPolicy):
    """Asks less often while round trips are short, more often when they grow."""

    def on_ack(self, stats: AckStats) -> tuple[int, int] | None:
        if stats.protocol != "tap":
            return None
        if stats.rtt < 0.005:
            interval = min(stats.interval * 2, 4000)
        elif stats.rtt > 0.050:
            interval = max(stats.interval // 2, 100)
        else:
            return None
        return interval, interval * 10


class NoTempKeys(StreamFilter):
    """Keeps temporary keys off the stream, by a rule the daemon applies per key."""

    def filter(self, batch: FilterBatch) -> Prefixes:
        return Prefixes(drop=(b"tmp:",))


class PerKeyFilter(StreamFilter):
    """The same decision, taken in Python for every key."""

    def filter(self, batch: FilterBatch) -> bytes:
        return bytes(DROP if k.startswith(b"tmp:") else KEEP for k in batch.keys)
