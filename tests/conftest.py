"""Fixtures shared by every test tier."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from node.testmodel import test_model_path


@pytest.fixture(scope="session")
def model_path() -> Path:
    return test_model_path()


@pytest.fixture(scope="session")
def node_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One node cache (shards, fingerprints, compiled capture) for the whole run."""
    return tmp_path_factory.mktemp("node-cache")


@pytest.fixture(autouse=True, scope="session")
def _quiet_llama() -> None:
    logging.getLogger("llama.cpp").setLevel(logging.WARNING)
