"""Fixtures for the end-to-end tests (helpers live in helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


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
