"""Fixtures for the end-to-end tests (helpers live in helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"
