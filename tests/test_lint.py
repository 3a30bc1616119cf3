"""The code stays formatted and lint-clean (ruff, rustfmt, clippy), the typed stub of the
native module matches the module as built (mypy's stubtest), and no crate version in Cargo.lock
is under a RustSec advisory (cargo audit)."""

import os
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


def test_no_advisories() -> None:
    """cargo audit reads the RustSec advisory database, which it fetches from GitHub. Machines
    that cannot reach GitHub (this project's CI among them) name a local checkout of
    github.com/rustsec/advisory-db in SLUICE_ADVISORY_DB, or skip: the skip says why. Warnings
    (unmaintained, unsound, yanked) fail too."""
    if subprocess.run(["cargo", "audit", "--version"], capture_output=True).returncode != 0:
        pytest.skip("cargo audit is not installed (`cargo install cargo-audit --locked`)")
    db = os.environ.get("SLUICE_ADVISORY_DB")
    if not db:
        pytest.skip(
            "no RustSec advisory database here: cargo audit fetches it from GitHub; "
            "set SLUICE_ADVISORY_DB to a checkout of rustsec/advisory-db"
        )
    cmd = ["cargo", "audit", "--deny", "warnings", "--db", db, "--no-fetch"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
