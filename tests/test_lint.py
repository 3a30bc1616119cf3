"""The code stays formatted and lint-clean (ruff, rustfmt, clippy), and the typed stub of the
native module matches the module as built (mypy's stubtest)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "cmd",
    [
        ["ruff", "check", "python", "bench", "tests", "examples"],
        ["ruff", "format", "--check", "python", "bench", "tests", "examples"],
        ["cargo", "fmt", "--all", "--check"],
        [
            "cargo",
            "clippy",
            "-q",
            "--workspace",
            "--all-targets",
            "--features",
            "sluice-core/mimalloc",
            "--",
            "-D",
            "warnings",
        ],
        [sys.executable, "-m", "mypy.stubtest", "sluice._native"],
    ],
    ids=["ruff-check", "ruff-format", "cargo-fmt", "cargo-clippy", "stubtest"],
)
def test_clean(cmd: list[str]) -> None:
    if shutil.which(cmd[0]) is None:
        pytest.fail(f"{cmd[0]} is not installed; `pip install '.[test]'` brings ruff, rustup brings cargo")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
