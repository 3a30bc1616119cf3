"""The distribution as users install it: a wheel built from this tree, named sluice-kv (the
name `sluice` on PyPI is an unrelated project), installed with the spark extra into a fresh
virtualenv, gives the `sluice` command and the `sluice` import package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sluice

REPO = Path(__file__).resolve().parent.parent


def _target_dir() -> Path:
    return Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))


def _maturin() -> list[str] | None:
    if shutil.which("maturin"):
        return ["maturin"]
    probe = subprocess.run([sys.executable, "-m", "maturin", "--version"], capture_output=True)
    return [sys.executable, "-m", "maturin"] if probe.returncode == 0 else None


# The build may first wait for a cold clippy (`one_build_at_a_time`).
@pytest.mark.timeout(1200)
def test_the_wheel_installs_as_sluice_kv_with_the_spark_extra(tmp_path, one_build_at_a_time):
    maturin = _maturin()
    if maturin is None:
        pytest.skip("maturin is not installed: no wheel can be built (pip install maturin)")
    # The profile the tree was last built with, so the build reuses its compiled crates
    # (`pip install .` builds release, `maturin develop --profile dev` dev): seconds, not minutes.
    release = _target_dir() / "release"
    profile = "release" if release.is_dir() and any(release.glob("*sluice_py*")) else "dev"
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [*maturin, "build", "--profile", profile, "--out", str(wheels), "--interpreter", sys.executable],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    [wheel] = wheels.glob("*.whl")
    assert wheel.name.startswith(f"sluice_kv-{sluice.__version__}-"), wheel.name

    # A fresh venv that sees the system's packages (pyspark, pyarrow, pandas are there) and no
    # index: the extra's requirements must resolve from what is installed, the package from
    # the wheel.
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120
    )
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    seen = subprocess.run(
        [str(python), "-c", "import pyspark, pyarrow, pandas"], capture_output=True, text=True
    )
    if seen.returncode != 0:
        pytest.skip(
            f"the base interpreter ({sys.base_prefix}) has no pyspark, pyarrow or pandas, and without "
            f"an index the spark extra cannot resolve: {seen.stderr.strip().splitlines()[-1]}"
        )
    # The test run's own sluice-kv may sit in the system's packages, where pip would call the
    # requirement met: the wheel goes into the venv first, then the extra resolves around it.
    pip = [str(python), "-m", "pip", "install", "--no-index", "--find-links", str(wheels)]
    for args in (["--ignore-installed", "--no-deps", "sluice-kv"], ["sluice-kv[spark]"]):
        install = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=300)
        assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    version = subprocess.run(
        [str(bin_dir / "sluice"), "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0 and version.stdout.strip() == f"sluice {sluice.__version__}", version
    where = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m, sluice, sluice.spark; "
            "print(m.version('sluice-kv')); print(sluice.__file__)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    dist_version, package = where.stdout.split()
    assert dist_version == sluice.__version__
    assert Path(package).is_relative_to(venv), f"sluice imported from {package}, not the wheel"
