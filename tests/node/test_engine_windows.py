"""The engine's window draws (speculative verification) against one-position decoding (real llama.cpp).

A window is [token, drafts...] at positions p..p+k; the last stage draws a token after every one of
them (Work.window_from). On SmolLM2 every draw must equal the token one-position decoding draws at
that position -- greedy, seeded sampling and penalties alike -- whether the drafts are right or not
(a wrong draft changes only the draws after it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from common.vocab import Vocabulary
from node.engine import EngineConfig, ShardEngine, Work
from node.sampling import SamplingParams
from node.shard import extract_shard

pytestmark = pytest.mark.slow  # loads model weights into llama.cpp

PROMPT = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\nRewrite with type hints:\n"
N_NEW = 16


@pytest.fixture(scope="module")
def route(model_path: Path, node_cache: Path, engine_config: EngineConfig) -> Iterator[list[ShardEngine]]:
    engines = [
        ShardEngine(extract_shard(model_path, a, b, node_cache), engine_config, node_cache)
        for a, b in ((0, 15), (15, 30))
    ]
    yield engines
    for e in engines:
        e.close()


def run(
    engines: list[ShardEngine], sid: str, start: int, tokens: list[int], *, window: bool, history: list[int]
):
    work = Work(sid, start, tokens=np.asarray(tokens, dtype=np.int32))
    (r,) = engines[0].step([work])
    assert r.ok, r.error
    hist = np.asarray([*history, *tokens], dtype=np.int32)
    last = Work(
        sid, start, hidden=r.hidden, sample=not window, history=hist, window_from=start if window else None
    )
    (r,) = engines[1].step([last])
    assert r.ok, r.error
    return r


def plain(engines: list[ShardEngine], sid: str, prompt: list[int]) -> list[int]:
    r = run(engines, sid, 0, prompt, window=False, history=[])
    out = [r.sampled.token_id]
    while len(out) < N_NEW:
        hist = prompt + out[:-1]
        out.append(run(engines, sid, len(hist), [out[-1]], window=False, history=hist).sampled.token_id)
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, penalty_last_n=32),
    ],
    ids=["greedy", "seeded", "penalty"],
)
def test_window_draws_equal_one_position_draws(route: list[ShardEngine], vocab: Vocabulary, params) -> None:
    prompt = vocab.tokenize(PROMPT)
    for e in route:
        e.open_session("plain", sampling=params, kv_budget=256)
        e.open_session("win", sampling=params, kv_budget=256)
    try:
        want = plain(route, "plain", prompt)
        first = run(route, "win", 0, prompt, window=False, history=[]).sampled.token_id
        assert first == want[0]
        got = [first]
        pos = len(prompt)
        k = 1
        while len(got) < N_NEW:
            # Drafts: the right tokens, except that every third window has a wrong last draft.
            right = want[len(got) : len(got) + k]
            drafts = list(right)
            if drafts and k % 3 == 0:
                drafts[-1] = (drafts[-1] + 1) % vocab.n_vocab
            window = [got[-1], *drafts]
            history = prompt + got[:-1]
            r = run(route, "win", pos, window, window=True, history=history)
            draws = [t.token_id for t in r.window]
            assert len(draws) == len(window)
            # Every draw after a right prefix is the plain token at its position.
            agree = 0
            while agree < len(drafts) and drafts[agree] == draws[agree]:
                agree += 1
            for i in range(min(agree + 1, N_NEW - len(got))):
                assert draws[i] == want[len(got) + i], (i, draws, want)
            got += draws[: agree + 1]
            pos += agree + 1
            for e in route:
                e.truncate("win", pos)
            k = k % 5 + 1
        assert got[:N_NEW] == want
    finally:
        for e in route:
            e.release("plain")
            e.release("win")
