"""The crates depend one way (proto <- core <- server <- tools <- py); within each crate no two
modules import each other, directly or around a loop (tests/import_graph.py), nor do two files
of one module, nor two files of the Python package; and the server's modules sit in layers, each
importing only from the layers below: the protocol-neutral streams know no front, the KV front
no stream front, and no front the server that starts them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from import_graph import cycles, file_cycles, graph

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
    "sluice-tools": {"sluice-proto", "sluice-core", "sluice-server"},
    "sluice-py": {"sluice-proto", "sluice-core", "sluice-server", "sluice-tools"},
}


@pytest.mark.parametrize("crate", sorted(ALLOWED))
def test_crates_depend_one_way(crate: str) -> None:
    manifest = tomllib.loads((ROOT / "rust" / crate / "Cargo.toml").read_text())
    deps = set(manifest.get("dependencies", {}))
    ours = {d for d in deps if d.startswith("sluice-")}
    assert ours <= ALLOWED[crate], f"{crate} depends on {sorted(ours - ALLOWED[crate])}"


@pytest.mark.parametrize("crate", ["sluice-proto", "sluice-core", "sluice-server"])
def test_no_module_cycles(crate: str) -> None:
    assert cycles(graph(ROOT / "rust" / crate)) == []


def test_no_file_imports_another_in_a_circle() -> None:
    """One file per node, so that two files of one module (iproto/select.rs and iproto/write.rs,
    say) that use each other show, which the graph of top-level modules folds away: for every
    crate, and for python/sluice."""
    found = file_cycles(ROOT)
    assert found == [], "files importing each other:\n" + "\n".join(found)


# sluice-server's modules, lowest layer first.
SERVER_LAYERS = [
    # leaves: no other module of the crate
    {"armed", "metrics", "ratelimit", "space", "tls", "stream", "topic_placement"},
    {"router"},  # a cluster's router for clients that read no map (iproto, memcached text)
    {"clustermap"},  # the map clients are served, with the topics' partition leaders
    {"scram"},  # SCRAM's messages and keys (base64 on the wire)
    {"auth"},  # users, their credentials (PBKDF2 hashes, SCRAM keys) and permissions
    # counters, plugins, pre-login bounds, a Tarantool followed, failed logins slowed
    {"stats", "policy", "limits", "upstream", "throttle"},
    {"request"},  # the request layer every front shares: replies after the WAL, permissions
    {"listener"},  # the accept loop of the fronts on listeners of their own
    {"driver"},  # the one connection driver every front's sessions run in
    {"kv"},  # the memcached front's requests: binary KV and sub-document, and the text protocol
    # what a memcached connection is handed to (SASL, change streams)
    {"login", "dcp", "tap"},
    {"topic_replica"},  # a replica's copy of its active's topics, over DCP
    {"replica"},  # following another node through the DCP consumer
    {"cluster"},  # converging on a cluster map: vbucket states and per-vbucket replication
    {"config"},  # the server's settings
    {"front"},  # the registry's terms: what a front declares and is built from
    {"connection"},  # the memcached port as a front: one connection and its handoffs
    {"iproto"},  # Tarantool's iproto front (its AUTH shares login's throttle)
    {"tank"},  # TANK's front: topics (no login)
    {"greenstack"},  # Greenstack's front: lanes, fences, out-of-order replies
    {"settings"},  # the settings as they cross from Python, checked once
    {"admin"},  # the HTTP endpoint that reports on all of the above
    {"server"},  # builds every front's context and runs the listeners
]


def test_server_modules_import_only_from_lower_layers() -> None:
    edges = graph(ROOT / "rust" / "sluice-server")
    layer = {m: i for i, mods in enumerate(SERVER_LAYERS) for m in mods}
    assert set(edges) == set(layer), "a module of sluice-server is missing from SERVER_LAYERS"
    upward = sorted(f"{m} -> {d}" for m, deps in edges.items() for d in deps if layer[d] >= layer[m])
    assert upward == []
