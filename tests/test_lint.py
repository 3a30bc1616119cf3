"""The code stays formatted and lint-clean (ruff, rustfmt, clippy), the typed stub of the
native module matches the module as built (mypy's stubtest), and no crate version in Cargo.lock
is under a RustSec advisory (cargo audit)."""

import os
import shutil
import subprocess
import sys
import tarfile
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
# A cold clippy may first wait for the wheel's build (`one_build_at_a_time`).
@pytest.mark.timeout(1200)
def test_clean(cmd: list[str], request: pytest.FixtureRequest) -> None:
    if shutil.which(cmd[0]) is None:
        pytest.fail(f"{cmd[0]} is not installed; `pip install '.[test]'` brings ruff, rustup brings cargo")
    if cmd[:2] == ["cargo", "clippy"]:
        request.getfixturevalue("one_build_at_a_time")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr


# A snapshot of github.com/rustsec/advisory-db's crates/ directory, for machines that cannot
# reach GitHub (this project's CI among them). Refresh it with
# `git -C ADVISORY_DB_CHECKOUT archive HEAD crates | xz > tests/data/rustsec-advisory-db.tar.xz`
# and record the commit here.
ADVISORY_SNAPSHOT = ROOT / "tests" / "data" / "rustsec-advisory-db.tar.xz"
ADVISORY_SNAPSHOT_COMMIT = "bf5c0d245a92671908518d7e765914d437954ed6 (2026-08-21)"


def test_no_advisories(tmp_path: Path) -> None:
    """cargo audit reads the RustSec advisory database, which it fetches from GitHub. A checkout
    named in SLUICE_ADVISORY_DB is used when set; otherwise the snapshot committed beside this
    test (ADVISORY_SNAPSHOT_COMMIT says how old it is). Warnings (unmaintained, unsound, yanked)
    fail too. .ci/run installs cargo-audit."""
    if subprocess.run(["cargo", "audit", "--version"], capture_output=True).returncode != 0:
        pytest.skip("cargo audit is not installed (`cargo install cargo-audit --locked`)")
    db = os.environ.get("SLUICE_ADVISORY_DB")
    if not db:
        with tarfile.open(ADVISORY_SNAPSHOT) as tar:
            tar.extractall(tmp_path, filter="data")
        db = str(tmp_path)
    cmd = ["cargo", "audit", "--deny", "warnings", "--db", db, "--no-fetch"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Loaded" in r.stderr + r.stdout, "cargo audit read no advisories: " + r.stderr
