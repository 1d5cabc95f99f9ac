"""How a shard's weights are loaded (``EngineConfig.load_mode``), with real llama.cpp.

``read`` (the node's default) leaves no mapping of the shard file in the
process: on a CPU build that repacks quantized weights, a mapping stayed
resident beside the repacked copy and doubled the node's memory (measured on a
Q4_0 shard of the 7B-class test model: 1 856 MiB resident mapped, 1 010 MiB
read; ``sim/bench_join.py``). Every mode computes the same numbers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.llama import LOAD_MODES, LlamaError, load_model
from node.config import LOAD_MODE_NAMES
from node.engine import EngineConfig, ShardEngine, Work
from node.shard import extract_shard


def mapped(path: Path) -> bool:
    """Whether this process maps ``path`` now."""
    return any(line.rstrip().endswith(str(path)) for line in Path("/proc/self/maps").read_text().splitlines())


def first_hidden(engine: ShardEngine) -> np.ndarray:
    engine.open_session("s")
    try:
        (res,) = engine.step([Work("s", 0, tokens=np.array([1, 504, 3458, 282], dtype=np.int32))])
        assert res.ok, res.error
        return np.array(res.hidden, copy=True)
    finally:
        engine.release("s")


@pytest.mark.slow  # loads model weights into llama.cpp
def test_read_maps_nothing_mmap_maps_the_shard_and_both_compute_the_same(
    model_path: Path, node_cache: Path, engine_config: EngineConfig
) -> None:
    files = extract_shard(model_path, 0, 10, node_cache)
    hidden = {}
    assert set(LOAD_MODE_NAMES) == set(LOAD_MODES)  # the node's choices are what llama.cpp is given
    for mode in LOAD_MODE_NAMES:
        config = EngineConfig(**{**engine_config.__dict__, "load_mode": mode})
        engine = ShardEngine(files, config, node_cache)
        try:
            assert mapped(files.path) == (mode == "mmap"), mode
            hidden[mode] = first_hidden(engine)
        finally:
            engine.close()
    assert EngineConfig().load_mode == "read"
    assert np.array_equal(hidden["read"], hidden["mmap"])
    assert np.array_equal(hidden["direct"], hidden["mmap"])


def test_an_unknown_load_mode_is_refused(model_path: Path) -> None:
    with pytest.raises(LlamaError, match="load_mode must be one of"):
        load_model(model_path, load_mode="lazy")
