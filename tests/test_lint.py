"""The code stays formatted and lint-clean: ruff for Python, rustfmt for Rust."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "cmd",
    [
        ["ruff", "check", "python", "bench", "tests"],
        ["ruff", "format", "--check", "python", "bench", "tests"],
        ["cargo", "fmt", "--all", "--check"],
    ],
    ids=["ruff-check", "ruff-format", "cargo-fmt"],
)
def test_clean(cmd: list[str]) -> None:
    if shutil.which(cmd[0]) is None:
        pytest.fail(f"{cmd[0]} is not installed; `pip install '.[test]'` brings ruff, rustup brings cargo")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
