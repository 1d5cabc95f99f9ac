from __future__ import annotations

from pathlib import Path

import pytest

from common.vocab import Vocabulary
from node.engine import EngineConfig
from node.reference import ReferenceModel

# Small contexts keep the KV allocation (and the test) cheap; one thread each.
ENGINE_CONFIG = EngineConfig(threads=1, max_sessions=6, session_kv_tokens=512, batch_tokens=256)


@pytest.fixture(scope="session")
def engine_config() -> EngineConfig:
    return ENGINE_CONFIG


@pytest.fixture(scope="session")
def vocab(model_path: Path) -> Vocabulary:
    with Vocabulary(model_path) as v:
        yield v


@pytest.fixture(scope="session")
def reference(model_path: Path) -> ReferenceModel:
    """The whole model with the engine's context settings (flash attention, KV type)."""
    with ReferenceModel(model_path, ENGINE_CONFIG.context_settings()) as ref:
        yield ref
