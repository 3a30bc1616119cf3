"""Bad input: keys and values the engine refuses, and configuration it rejects, through the
Python API and through the `sluice` command. Every refusal leaves the data intact and names
what was wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import sluice
from helpers import NO_DEFAULT_PORTS, open_engine, run_cli
from sluice import Config


def _assert_intact(e: sluice.EmbeddedEngine, expected: dict[bytes, bytes], high: list[int]) -> None:
    """The refused call changed nothing, and the engine still takes writes."""
    for k, v in expected.items():
        assert e.get(k).value == v
    assert e.high_seqnos() == high
    m = e.set(b"after-bad-call", b"ok", durability="persist")
    assert e.get(b"after-bad-call").value == b"ok"
    e.delete(b"after-bad-call")
    assert m.seqno == high[m.vbucket] + 1


@pytest.fixture
def engine_with_items(data_dir: Path):
    cfg = Config.from_dict(
        {
            "data_dir": str(data_dir),
            "snapshot": {"interval": 0},
            "buckets": {"default": {"max_item_size": 1024}},
        }
    )
    with sluice.EmbeddedEngine(cfg.to_native()) as e:
        items = {b"item-%d" % i: b"value-%d" % i for i in range(50)}
        for k, v in items.items():
            e.set(k, v)
        yield e, items


@pytest.mark.parametrize("key", [b"", b"k" * 251, b"k" * 1000], ids=["empty", "251-bytes", "1000-bytes"])
def test_invalid_keys_are_refused(engine_with_items, key):
    e, items = engine_with_items
    calls = [
        lambda: e.set(key, b"v"),
        lambda: e.set(key, b"v", mode="add"),
        lambda: e.set(key, b"v", durability="persist"),
        lambda: e.get(key),
        lambda: e.delete(key),
        lambda: e.set_many([(b"good-1", b"v"), (key, b"v"), (b"good-2", b"v")]),
    ]
    for call in calls:
        # `high` after each call: the refusals must not consume seqnos either.
        high = e.high_seqnos()
        with pytest.raises(sluice.InvalidKeyError) as info:
            call()
        msg = str(info.value)
        assert "key" in msg and (("empty" in msg) if not key else (str(len(key)) in msg and "250" in msg))
        _assert_intact(e, items, high)
    assert e.get(b"good-1") is None and e.get(b"good-2") is None, "set_many is all or nothing on bad keys"


def test_key_of_250_bytes_is_accepted(engine_with_items):
    e, _ = engine_with_items
    key = bytes(range(1, 251))  # 250 bytes, not UTF-8
    m = e.set(key, b"v", durability="persist")
    it = e.get(key)
    assert it.key == key and it.value == b"v" and it.seqno == m.seqno
    e.delete(key)
    assert e.get(key) is None
    assert e.get_meta(key).deleted


def test_value_over_max_item_size(engine_with_items):
    e, items = engine_with_items
    e.set(b"exactly-max", b"x" * 1024)
    assert len(e.get(b"exactly-max").value) == 1024
    items = {**items, b"exactly-max": b"x" * 1024}
    for call in [
        lambda: e.set(b"too-big", b"x" * 1025),
        lambda: e.set(b"item-1", b"x" * 1025),  # overwriting an existing item
        lambda: e.set(b"item-1", b"x" * 5000, mode="replace", durability="persist"),
        lambda: e.set_many([(b"ok", b"v"), (b"too-big", b"x" * 1025)]),
    ]:
        high = e.high_seqnos()
        with pytest.raises(sluice.TooBigError, match="1024"):
            call()
        _assert_intact(e, items, high)
    assert e.get(b"too-big") is None and e.get(b"ok") is None


def test_default_max_item_size_is_20_mib(data_dir):
    with open_engine(data_dir) as e:
        e.set(b"big", b"\0" * (20 << 20))
        with pytest.raises(sluice.TooBigError, match=str((20 << 20) + 1)):
            e.set(b"bigger", b"\0" * ((20 << 20) + 1))
        assert len(e.get(b"big").value) == 20 << 20
        assert e.get(b"bigger") is None


# (document, key path the message must name)
BAD_CONFIGS = [
    ({"buckets": {"default": {"num_vbuckets": "64"}}}, "buckets.default.num_vbuckets"),
    ({"buckets": {"default": {"num_vbuckets": True}}}, "buckets.default.num_vbuckets"),
    ({"buckets": {"default": {"num_vbuckets": 0}}}, "buckets.default.num_vbuckets"),
    ({"buckets": {"default": {"num_vbuckets": 1025}}}, "buckets.default.num_vbuckets"),
    ({"buckets": {"other": {"num_vbuckets": -1}}}, "buckets.other.num_vbuckets"),
    ({"buckets": {"default": {"colour": "blue"}}}, "buckets.default.colour"),
    ({"buckets": {"default": {"memory_quota": "lots"}}}, "buckets.default.memory_quota"),
    ({"buckets": {"default": {"memory_quota": "10 parsecs"}}}, "buckets.default.memory_quota"),
    ({"buckets": {"default": {"memory_quota": "1KiB"}}}, "buckets.default.memory_quota"),
    ({"buckets": {"default": {"memory_quota": "99999999999GiB"}}}, "buckets.default.memory_quota"),
    ({"buckets": {"default": {"max_item_size": "65MiB"}}}, "buckets.default.max_item_size"),
    ({"buckets": {"default": {"high_watermark": 0}}}, "buckets.default.high_watermark"),
    ({"buckets": {"default": {"high_watermark": 1.5}}}, "buckets.default.high_watermark"),
    ({"buckets": {"default": {"durability": "always"}}}, "buckets.default.durability"),
    ({"buckets": {"default": {"eviction": "lfu"}}}, "buckets.default.eviction"),
    ({"buckets": {"default": {"eviction": True}}}, "buckets.default.eviction"),
    ({"buckets": {"bad name": {}}}, "buckets.bad name"),
    ({"buckets": {"default": 5}}, "buckets.default"),
    ({"buckets": []}, "buckets"),
    ({"wal": {"mode": "sometimes"}}, "wal.mode"),
    ({"wal": {"mode": 1}}, "wal.mode"),
    ({"wal": {"segment_size": "1KiB"}}, "wal.segment_size"),
    ({"wal": {"segment_size": "64 MeB"}}, "wal.segment_size"),
    ({"wal": {"segment_size": "99999999999GiB"}}, "wal.segment_size"),
    ({"wal": {"segment_size": -4096}}, "wal.segment_size"),
    ({"wal": {"flush": True}}, "wal.flush"),
    ({"wal": "fsync"}, "wal"),
    ({"snapshot": {"interval": "soon"}}, "snapshot.interval"),
    ({"snapshot": {"interval": "10 fortnights"}}, "snapshot.interval"),
    ({"snapshot": {"interval": -1}}, "snapshot.interval"),
    ({"snapshot": {"interval": float("inf")}}, "snapshot.interval"),
    ({"snapshot": {"count": 0}}, "snapshot.count"),
    ({"snapshot": {"count": 1.5}}, "snapshot.count"),
    ({"checkpoint": {"period": "0s"}}, "checkpoint.period"),
    ({"checkpoint": {"max_items": 2**64}}, "checkpoint.max_items"),
    ({"expiry_pager_interval": "0ms"}, "expiry_pager_interval"),
    ({"tombstone_purge_age": float("nan")}, "tombstone_purge_age"),
    ({"force_recovery": "yes"}, "force_recovery"),
    ({"data_dir": 5}, "data_dir"),
    ({"data_dir": ""}, "data_dir"),
    ({"verbose": True}, "verbose"),
]


@pytest.mark.parametrize(
    ("doc", "path"), BAD_CONFIGS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_CONFIGS)]
)
def test_bad_config_names_the_key(doc, path, tmp_path):
    doc = dict(doc)
    doc.setdefault("data_dir", str(tmp_path / "d"))
    with pytest.raises(sluice.ConfigError) as info:
        # Validation may happen in Python or in the native settings; either way it is a
        # ConfigError naming the key, raised before anything touches the disk.
        Config.from_dict(doc).to_native()
    assert f"{path}:" in str(info.value)
    assert not (tmp_path / "d").exists()


def test_good_config_values(tmp_path):
    cfg = Config.from_dict(
        {
            "data_dir": str(tmp_path / "d"),
            "force_recovery": False,
            "expiry_pager_interval": "500ms",
            "tombstone_purge_age": "3d",
            "wal": {"mode": "fsync", "segment_size": "1MiB"},
            "snapshot": {"count": 3, "interval": "10m"},
            "checkpoint": {"max_items": 100, "period": 2},
            "buckets": {
                "default": {"memory_quota": "2GB", "max_item_size": 1_000_000, "high_watermark": 1},
                "b.2-x%": {"num_vbuckets": 1024, "durability": "persist", "eviction": "lru"},
            },
        }
    )
    assert cfg.values["wal.segment_size"] == 1 << 20
    assert cfg.values["expiry_pager_interval"] == 0.5
    assert cfg.values["tombstone_purge_age"] == 3 * 86400
    assert cfg.values["snapshot.interval"] == 600
    assert cfg.buckets["default"]["memory_quota"] == 2_000_000_000
    native = cfg.to_native()
    assert native.wal_mode == "fsync"
    assert sorted(native.bucket_names) == ["b.2-x%", "default"]


def test_overrides_are_validated(tmp_path):
    with pytest.raises(sluice.ConfigError, match="wal.mode:"):
        sluice.open_engine(data_dir=str(tmp_path / "d"), wal__mode="maybe")
    with pytest.raises(sluice.ConfigError, match="no_such_key:"):
        sluice.open_engine(data_dir=str(tmp_path / "d"), no_such_key=1)
    assert not (tmp_path / "d").exists()


TOML_CASES = [
    ("[buckets.default]\nnum_vbuckets = 0\n", "buckets.default.num_vbuckets"),
    ("[buckets.default]\nnum_vbuckets = 1025\n", "buckets.default.num_vbuckets"),
    ('[buckets.default]\nnum_vbuckets = "many"\n', "buckets.default.num_vbuckets"),
    ('[wal]\nmode = "sometimes"\n', "wal.mode"),
    ('[wal]\nsegment_size = "big"\n', "wal.segment_size"),
    ('[snapshot]\ninterval = "often"\n', "snapshot.interval"),
    ("[wal]\nflush = true\n", "wal.flush"),
    ('colour = "blue"\n', "colour"),
    ('[buckets.default]\nmemory_quota = "99999999999GiB"\n', "buckets.default.memory_quota"),
]


@pytest.mark.parametrize(("text", "path"), TOML_CASES, ids=[p for _, p in TOML_CASES])
def test_config_check_and_serve_reject_bad_files(tmp_path, text, path):
    cfg = tmp_path / "sluice.toml"
    cfg.write_text(f'data_dir = "{tmp_path / "d"}"\n' + text)
    r = run_cli("config", "check", str(cfg))
    assert r.returncode == 2, r.stderr
    assert f"{path}:" in r.stderr and str(cfg) in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    r = run_cli("serve", "--config", str(cfg), *NO_DEFAULT_PORTS)
    assert r.returncode == 2, r.stderr
    assert f"{path}:" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "d").exists(), "nothing is created for a rejected configuration"


def test_config_check_accepts_a_good_file(tmp_path):
    cfg = tmp_path / "sluice.toml"
    cfg.write_text(
        'data_dir = "d"\n[wal]\nmode = "fsync"\n[buckets.default]\n[buckets.users]\nnum_vbuckets = 16\n'
    )
    r = run_cli("config", "check", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout and "users" in r.stdout


def test_invalid_toml_and_unreadable_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[wal\nmode = fsync\n")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b'mode = "\xff\xfe"\n')
    missing = tmp_path / "missing.toml"
    for f, words in [
        (bad, "not valid TOML"),
        (binary, "UTF-8"),
        (missing, "cannot read config file"),
        (tmp_path, "cannot read config file"),
    ]:
        for args in (
            ["config", "check", str(f)],
            ["serve", "--config", str(f), "--data-dir", str(tmp_path / "d"), *NO_DEFAULT_PORTS],
        ):
            r = run_cli(*args)
            assert r.returncode == 2, (args, r.stderr)
            assert words in r.stderr and str(f) in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
    assert not (tmp_path / "d").exists()


def test_usage_errors_exit_2():
    for args in ([], ["bogus"], ["config"], ["serve", "--no-such-flag"], ["wal-dump"]):
        r = run_cli(*args)
        assert r.returncode == 2, args
        assert "usage:" in r.stderr
