"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sim.reference import Reference


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Iterator[Reference]:
    """The whole model in one plain llama.cpp context: what a split swarm must reproduce."""
    ref = Reference(model_path)
    yield ref
    ref.close()
