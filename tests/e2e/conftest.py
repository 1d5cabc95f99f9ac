"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from node import testmodel
from sim.reference import Reference

# The marks of a Qwen2.5-Coder test module: slow, and opt-in (never in CI: 1.1 GB, long runs).
QWEN_OPT_IN = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("SWARM_QWEN_TESTS") != "1",
        reason="Qwen2.5-Coder (1.1 GB) is opt-in: SWARM_QWEN_TESTS=1",
    ),
]


@pytest.fixture(scope="module")
def qwen() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M (``node.testmodel.qwen_coder_model_path``), or a skip."""
    try:
        return testmodel.qwen_coder_model_path()
    except Exception as err:  # noqa: BLE001 - any reason the model is not there is a skip
        pytest.skip(f"Qwen2.5-Coder not available: {err}")


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Iterator[Reference]:
    """The whole model in one plain llama.cpp context: what a split swarm must reproduce."""
    ref = Reference(model_path)
    yield ref
    ref.close()
