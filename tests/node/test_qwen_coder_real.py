"""Qwen2.5-Coder-1.5B-Instruct Q4_K_M (real weights, ``qwen2``, 28 layers) split over a KV pool.

Opt-in: the model is 1.1 GB (22 chunk packages, ``node.testmodel.qwen_coder_model_path``), so these
tests run only with ``SWARM_QWEN_TESTS=1`` and the model available (installed ``qwen`` extra,
``SWARM_QWEN_CODER_WHEELS`` or ``SWARM_QWEN_CODER_MODEL``). A 2,100-token code prompt -- past the
per-sequence layout's 2,048-position slots -- through ``[0,14) + [14,28)``, each stage on a pool
of 4,096 positions: the logits after the prompt are bit-identical to the whole model in one plain
llama.cpp context, and so are 8 greedy tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from common.vocab import Vocabulary
from node import testmodel
from node.engine import EngineConfig, ShardEngine, Work
from node.llama_runtime import ContextSettings
from node.reference import ReferenceModel
from node.shard import extract_shard

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("SWARM_QWEN_TESTS") != "1",
        reason="Qwen2.5-Coder (1.1 GB) is opt-in: SWARM_QWEN_TESTS=1",
    ),
]

POOL = EngineConfig(
    threads=1, max_sessions=4, session_kv_tokens=1 << 30, batch_tokens=256, kv_pool_tokens=4096
)
N_NEW = 8
CODE = (
    "def parse_record(line: str) -> dict[str, str]:\n"
    '    """Split one CSV line of the ledger into its named fields."""\n'
    "    name, captain, goods, arrived, left = line.strip().split(',')\n"
    "    return {'name': name, 'captain': captain, 'goods': goods, 'arrived': arrived, 'left': left}\n\n"
)


@pytest.fixture(scope="module")
def qwen_path() -> Path:
    try:
        return testmodel.qwen_coder_model_path()
    except testmodel.TestModelMissing as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def prompt(qwen_path: Path) -> list[int]:
    with Vocabulary(qwen_path) as v:
        text = ""
        while len(v.tokenize(text)) < 2100:
            text += CODE
        return v.tokenize(text + "def summarise(records):\n")


@pytest.fixture(scope="module")
def stages(qwen_path: Path, node_cache: Path) -> Iterator[list[ShardEngine]]:
    made = [
        ShardEngine(extract_shard(qwen_path, a, b, node_cache), POOL, node_cache)
        for a, b in ((0, 14), (14, 28))
    ]
    yield made
    for e in made:
        e.close()


@pytest.mark.timeout(3600)
def test_a_2100_token_prompt_through_a_pooled_split_is_bit_exact(
    qwen_path: Path, stages: list[ShardEngine], prompt: list[int]
) -> None:
    assert 2100 <= len(prompt) < 2300 and all(s.session_kv_limit == 4096 for s in stages)
    for s in stages:
        s.open_session("q")

    def through(start: int, toks: list[int]) -> np.ndarray:
        w = [Work("q", start, tokens=np.array(toks, dtype=np.int32))]
        h = stages[0].step(w)[0]
        assert h.ok, h.error
        r = stages[1].step([Work("q", start, hidden=h.hidden, return_logits=True)])[0]
        assert r.ok, r.error
        return r.logits

    logits = None
    for off in range(0, len(prompt), 256):
        logits = through(off, prompt[off : off + 256])
    got = [int(np.argmax(logits))]
    first = logits
    while len(got) < N_NEW:
        got.append(int(np.argmax(through(len(prompt) + len(got) - 1, [got[-1]]))))
    settings = ContextSettings(n_threads=1, n_seq_max=1, n_ctx=4096, n_batch=256, n_ubatch=256)
    with ReferenceModel(qwen_path, settings) as ref:
        want, want_first = ref.greedy(prompt, N_NEW)
    assert first.tobytes() == want_first.tobytes()
    assert got == want
    for s in stages:
        s.release("q")
        assert s.statistics().kv_pool.used_blocks == 0
