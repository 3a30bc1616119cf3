"""The crates depend one way (proto <- core <- server <- tools <- py), and within the crates reshaped so
far no two modules import each other, directly or around a loop (tests/import_graph.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from import_graph import cycles, graph

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# What each crate may depend on, of the workspace's own.
ALLOWED = {
    "sluice-proto": set(),
    "sluice-core": {"sluice-proto"},
    "sluice-server": {"sluice-proto", "sluice-core"},
    "sluice-tools": {"sluice-proto", "sluice-server"},
    "sluice-py": {"sluice-proto", "sluice-core", "sluice-server", "sluice-tools"},
}


@pytest.mark.parametrize("crate", sorted(ALLOWED))
def test_crates_depend_one_way(crate: str) -> None:
    manifest = tomllib.loads((ROOT / "rust" / crate / "Cargo.toml").read_text())
    deps = set(manifest.get("dependencies", {}))
    ours = {d for d in deps if d.startswith("sluice-")}
    assert ours <= ALLOWED[crate], f"{crate} depends on {sorted(ours - ALLOWED[crate])}"


@pytest.mark.parametrize("crate", ["sluice-proto", "sluice-core"])
def test_no_module_cycles(crate: str) -> None:
    assert cycles(graph(ROOT / "rust" / crate)) == []
