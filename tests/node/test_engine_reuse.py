"""The real engine: a session started from another's KV (copied or taken over) computes exactly what
the source would; n > 1 choices and grammars on the last stage (SmolLM2, llama.cpp, one thread)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import llguidance
import numpy as np
import pytest

from common.vocab import Vocabulary
from node.engine import EngineConfig, ShardEngine, Work
from node.sampling import SamplingParams, sample
from node.shard import extract_shard, read_model_meta

pytestmark = pytest.mark.slow  # loads model weights into llama.cpp


@pytest.fixture(scope="module")
def whole(model_path: Path, node_cache: Path, engine_config: EngineConfig) -> Iterator[ShardEngine]:
    n = read_model_meta(model_path, node_cache).n_layers
    with ShardEngine(extract_shard(model_path, 0, n, node_cache), engine_config, node_cache) as engine:
        yield engine


TOKENS = np.random.default_rng(3).integers(100, 2000, 60).astype(np.int32)


def logits_after(engine: ShardEngine, sid: str, start: int, tokens: np.ndarray) -> np.ndarray:
    (r,) = engine.step([Work(sid, start, tokens=tokens, return_logits=True)])
    assert r.error is None, r.error
    assert r.logits is not None
    return r.logits


def test_copied_and_taken_over_kv_continue_exactly(whole: ShardEngine) -> None:
    whole.open_session("src")
    logits_after(whole, "src", 0, TOKENS[:50])
    want = logits_after(whole, "src", 50, TOKENS[50:52])  # the source went on past the fork point
    whole.open_session("copy", source="src", positions=50)
    assert whole.kv_len("copy") == 50 and whole.kv_len("src") == 52
    assert np.array_equal(logits_after(whole, "copy", 50, TOKENS[50:52]), want)
    whole.open_session("moved", source="src", positions=50, move=True)
    assert not whole.has_session("src")
    assert np.array_equal(logits_after(whole, "moved", 50, TOKENS[50:52]), want)
    for sid in ("copy", "moved"):
        whole.release(sid)


def test_choices_and_a_grammar_on_the_last_stage(whole: ShardEngine, model_path: Path) -> None:
    with Vocabulary(model_path) as vocab:
        prompt = vocab.tokenize(
            "<|im_start|>user\nA JSON object with a city.<|im_end|>\n<|im_start|>assistant\n",
            add_special=False,
            parse_special=True,
        )
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        }
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        p = len(prompt)
        params = SamplingParams(temperature=0.9, seed=11, grammar=grammar, completion_start=p, choices=3)
        whole.open_session("g", sampling=params)
        history = list(prompt)
        (r,) = whole.step(
            [
                Work(
                    "g",
                    0,
                    tokens=np.asarray(prompt, np.int32),
                    sample=True,
                    return_logits=True,
                    history=np.asarray(history, np.int32),
                )
            ]
        )
        assert r.sampled is not None and len(r.choices) == 2
        # Each extra choice is what the same draw with seed + i gives.
        assert r.logits is not None
        for i, choice in enumerate(r.choices, start=1):
            from node.constraints import GrammarConstraint

            alone = SamplingParams(temperature=0.9, seed=11 + i, grammar=grammar, completion_start=p)
            constraint = GrammarConstraint(whole._lltokenizer, grammar, whole.n_vocab)  # noqa: SLF001
            assert (
                sample(r.logits, alone, p, np.asarray(history, np.int32), constraint).token_id
                == choice.token_id
            )
        out: list[int] = []
        token = r.sampled.token_id
        while not whole.is_eog(token) and len(out) < 40:
            out.append(token)
            history.append(token)
            (r,) = whole.step(
                [
                    Work(
                        "g",
                        len(history) - 1,
                        tokens=np.asarray([token], np.int32),
                        sample=True,
                        history=np.asarray(history, np.int32),
                    )
                ]
            )
            assert r.sampled is not None
            token = r.sampled.token_id
        assert whole.is_eog(token)
        assert set(json.loads(vocab.detokenize(out))) == {"city"}
        whole.release("g")
