"""One definition per default: config.py takes the default of every key with a Rust counterpart
from `sluice._native.DEFAULTS`, which sluice-py reads from the Rust `Default`s the native
settings start from. These tests fail when config.py spells such a default itself and it
differs, when the Rust side exports a default config.py has no key for, or when a key gains or
loses its Rust counterpart unnoticed."""

from pathlib import Path

import pytest
from sluice import _native
from sluice.config import BUCKET_KEYS, ENGINE_KEYS, Key

# Keys the native settings have no default for: addresses and files the Rust side takes as
# "absent" (None), resolved on the Python side ("auto", ""), and the policy plugins' import paths.
# (A registered front's `<name>_listen` has its default from the front's declaration.)
PYTHON_ONLY = {
    "admin_listen",
    "tls.certificate",
    "tls.key",
    "tls.client_ca",
    "replication.replica_of",
    "replication.user",
    "replication.password_file",
    "replication.ca",
    "replication.certificate",
    "replication.key",
    "tarantool_upstream.address",
    "tarantool_upstream.user",
    "tarantool_upstream.password_file",
    "tarantool_upstream.spaces",
    "tarantool_upstream.anonymous",
    "policy.ack",
    "policy.retransmit",
    "policy.slow_consumer",
    "policy.filter",
    # The cluster's keys: the Python side keeps the node's place in the cluster.
    *(k.name for k in ENGINE_KEYS if k.python_only),
}


def _config_keys() -> dict[str, Key]:
    keys = {k.name: k for k in ENGINE_KEYS}
    keys.update({f"buckets.{k.name}": k for k in BUCKET_KEYS})
    return keys


def test_every_native_default_is_a_config_key() -> None:
    unknown = set(_native.DEFAULTS) - set(_config_keys())
    assert not unknown, f"DEFAULTS has keys config.py does not define: {sorted(unknown)}"


def test_keys_without_a_native_default_are_the_python_only_ones() -> None:
    assert set(_config_keys()) - set(_native.DEFAULTS) == PYTHON_ONLY


def test_config_defaults_equal_the_rust_defaults() -> None:
    for name, key in _config_keys().items():
        if name not in _native.DEFAULTS:
            continue
        # Through the key's own parser and check: the Rust default must also be a valid value.
        native = key.value(name, _native.DEFAULTS[name])
        assert type(key.default) is type(native), (name, key.default, native)
        assert key.default == native, (name, key.default, native)


def test_native_defaults_are_read_only() -> None:
    with pytest.raises(TypeError):
        _native.DEFAULTS["buckets.num_vbuckets"] = 1  # type: ignore[index]
    assert _native.DEFAULTS["buckets.num_vbuckets"] == 64


def test_native_settings_without_keywords_take_the_defaults(tmp_path: Path) -> None:
    d = _native.DEFAULTS
    bucket = _native.BucketSettings("b")
    assert bucket.num_vbuckets == d["buckets.num_vbuckets"]
    settings = _native.EngineSettings(tmp_path / "data")
    assert settings.wal_mode == d["wal.mode"]
    assert settings.bucket_names == ["default"]
    with _native.EmbeddedEngine(settings) as engine:
        stats = engine.stats()
        assert stats["memory_quota"] == d["buckets.memory_quota"]
        quota = d["buckets.memory_quota"]
        assert stats["high_watermark"] == int(quota * d["buckets.high_watermark"])
        assert stats["checkpoint_quota"] == int(quota * d["buckets.checkpoint_memory_ratio"])
        assert len(engine.high_seqnos()) == d["buckets.num_vbuckets"]
