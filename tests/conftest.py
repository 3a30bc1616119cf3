"""Fixtures for the end-to-end tests (helpers live in helpers.py)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from sluice import _native


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def server(tmp_path: Path):
    """A running `sluice serve` on a free port, stopped with SIGTERM (and checked to exit 0)."""
    from helpers import Node

    node = Node(tmp_path / "node")
    yield node
    assert node.stop() == 0, "".join(node.lines)[-2000:]


@pytest.fixture
def clocked_server(tmp_path: Path):
    """`server` with fault injection on (SLUICE_ERRINJ): a test moves its clock on with
    `node.inject("clock_offset_secs", N)` rather than sleeping through an expiry."""
    from helpers import Node

    node = Node(tmp_path / "node", env=dict(os.environ, SLUICE_ERRINJ=""))
    yield node
    assert node.stop() == 0, "".join(node.lines)[-2000:]


@pytest.fixture
def clock():
    """Moves the wall clock of this process's engines on (the `clock_offset_secs` injection
    point), and back when the test ends."""

    class Clock:
        offset = 0

        def advance(self, seconds: int) -> None:
            self.offset += seconds
            _native.errinj_set("clock_offset_secs", self.offset)

    c = Clock()
    yield c
    _native.errinj_set("clock_offset_secs", 0)


# The suite runs in worker processes side by side (pytest-xdist, `--dist loadfile`, set in
# pyproject.toml). A file's tests stay together on one worker (module fixtures such as Spark's
# session or a shared node are built once, and a file's tests keep their order: the README's
# examples build on each other). The heaviest files are handed out first, so the longest one
# does not start last; their tests are marked `slow` (Spark, clusters on etcd, kill -9 loads,
# builds): `-m "not slow"` runs the rest in about a minute and a half. The two tests that
# compile (clippy, the wheel) take `one_build_at_a_time`, so two builds never compete for the
# two cores: cargo's own lock is per profile, and they build different ones.
HEAVY_FIRST = [
    "test_spark.py",
    "test_cluster.py",
    "test_cli_messages.py",
    "test_readme_examples.py",
    "test_cluster_topics.py",
    "test_cluster_router.py",
    "test_packaging.py",
    "test_lint.py",
    "test_kill9_server.py",
    "test_topics_on_disk.py",
    "test_replication.py",
    "test_couchbase_sdk_kv.py",
    "test_greenstack.py",
    "test_greenstack_client.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).name in HEAVY_FIRST:
            item.add_marker(pytest.mark.slow)

    def rank(item: pytest.Item) -> int:
        name = Path(str(item.fspath)).name
        return HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST)

    items.sort(key=rank)


@pytest.fixture
def one_build_at_a_time():
    """Holds a lock shared by every worker of the run (and any other run on this tree) while
    the test compiles."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", Path(__file__).resolve().parent.parent / "target"))
    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".tests-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
