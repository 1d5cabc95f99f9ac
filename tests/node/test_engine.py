"""The layer-range engine against the whole model: parity, isolation, refusals (real llama.cpp)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from common.vocab import Vocabulary
from node.engine import EngineConfig, ShardEngine, Work, WorkResult
from node.errors import (
    EngineError,
    InputShapeError,
    KVBudgetError,
    PositionError,
    SessionLimitError,
    UnknownSessionError,
)
from node.reference import ReferenceModel
from node.shard import extract_shard

pytestmark = pytest.mark.slow  # loads model weights into llama.cpp

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "1, 2, 3, 4,",
]
N_NEW = 64


class Route:
    """Engines for consecutive shards, driven like a gateway would drive them."""

    def __init__(self, engines: list[ShardEngine]) -> None:
        self.engines = engines

    def open(self, sid: str) -> None:
        for e in self.engines:
            e.open_session(sid)

    def release(self, sid: str) -> None:
        for e in self.engines:
            e.release(sid)

    def step(self, items: list[tuple[str, int, list[int]]], *, logits: bool = False) -> list[WorkResult]:
        """One batched step of (session, start position, token ids) through every stage."""
        works = [Work(sid, pos, tokens=np.array(toks, dtype=np.int32)) for sid, pos, toks in items]
        for k, engine in enumerate(self.engines):
            if k == len(self.engines) - 1:
                for w in works:
                    w.sample = True
                    w.return_logits = logits
            results = engine.step(works)
            for r in results:
                assert r.ok, r.error
            if k < len(self.engines) - 1:
                works = [Work(r.session_id, r.start_pos, hidden=r.hidden) for r in results]
        return results

    def generate(self, sid: str, prompt: list[int], n_new: int) -> tuple[list[int], np.ndarray]:
        res = self.step([(sid, 0, prompt)], logits=True)[0]
        first_logits = res.logits
        out = [res.sampled.token_id]
        pos = len(prompt)
        while len(out) < n_new:
            out.append(self.step([(sid, pos, [out[-1]])])[0].sampled.token_id)
            pos += 1
        return out, first_logits


@pytest.fixture(scope="module")
def engines(model_path: Path, node_cache: Path, engine_config: EngineConfig) -> Iterator[dict]:
    made: dict[tuple[int, int], ShardEngine] = {}

    def get(start: int, end: int) -> ShardEngine:
        if (start, end) not in made:
            made[(start, end)] = ShardEngine(
                extract_shard(model_path, start, end, node_cache), engine_config, node_cache
            )
        return made[(start, end)]

    yield get
    for e in made.values():
        e.close()


@pytest.fixture(scope="module")
def expected(reference: ReferenceModel, vocab: Vocabulary):
    @cache
    def run(prompt: str) -> tuple[tuple[int, ...], bytes]:
        reference.clear()
        toks, logits = reference.greedy(vocab.tokenize(prompt), N_NEW)
        return tuple(toks), logits.tobytes()

    return run


def _route(engines, bounds: list[int]) -> Route:
    return Route([engines(a, b) for a, b in zip(bounds, bounds[1:], strict=False)])


@pytest.mark.parametrize(
    "bounds", [[0, 15, 30], [0, 10, 20, 30], [0, 7, 23, 30]], ids=["2x15", "3x10", "7-16-7"]
)
def test_split_is_bit_exact_with_whole_model(engines, expected, vocab: Vocabulary, bounds: list[int]) -> None:
    route = _route(engines, bounds)
    for n, prompt in enumerate(PROMPTS[:2]):
        sid = f"parity-{n}"
        route.open(sid)
        try:
            tokens, first_logits = route.generate(sid, vocab.tokenize(prompt), N_NEW)
        finally:
            route.release(sid)
        want_tokens, want_logits = expected(prompt)
        # Bit-identical logits after the prompt, not merely close.
        assert first_logits.tobytes() == want_logits
        assert tuple(tokens) == want_tokens


def test_whole_model_as_one_shard_matches(engines, expected, vocab: Vocabulary) -> None:
    route = _route(engines, [0, 30])
    route.open("whole")
    tokens, logits = route.generate("whole", vocab.tokenize(PROMPTS[0]), N_NEW)
    route.release("whole")
    assert logits.tobytes() == expected(PROMPTS[0])[1]
    assert tuple(tokens) == expected(PROMPTS[0])[0]


def test_sessions_batched_together_match_each_alone(engines, expected, vocab: Vocabulary) -> None:
    route = _route(engines, [0, 15, 30])
    prompts = [vocab.tokenize(p) for p in PROMPTS]
    sids = [f"iso-{i}" for i in range(len(prompts))]
    # Four sessions prefill together in one batch (different lengths, one llama_decode).
    for sid in sids[:4]:
        route.open(sid)
    first = route.step([(sid, 0, p) for sid, p in zip(sids[:4], prompts[:4], strict=False)])
    outs = {sid: [r.sampled.token_id] for sid, r in zip(sids[:4], first, strict=False)}
    pos = {sid: len(p) for sid, p in zip(sids, prompts, strict=False)}
    released: set[str] = set()
    for step in range(N_NEW - 1):
        items = [(sid, pos[sid], [outs[sid][-1]]) for sid in outs if sid not in released]
        if step == 5:
            # A fifth session's prefill joins a batch of decode steps.
            route.open(sids[4])
            pos[sids[4]] = 0
            items.append((sids[4], 0, prompts[4]))
        if step == 20:
            # Releasing one session mid-stream frees its slot and disturbs nobody.
            route.release(sids[1])
            released.add(sids[1])
            items = [it for it in items if it[0] != sids[1]]
        results = route.step(items)
        for (sid, _, toks), r in zip(items, results, strict=False):
            if sid == sids[4] and sid not in outs:
                outs[sid] = [r.sampled.token_id]
            else:
                outs[sid].append(r.sampled.token_id)
            pos[sid] += len(toks)
    for sid, prompt in zip(sids, PROMPTS, strict=False):
        want = expected(prompt)[0]
        got = outs[sid]
        assert tuple(got) == want[: len(got)], f"{sid} diverged from its solo run"
    assert len(outs[sids[0]]) == N_NEW
    assert len(outs[sids[1]]) == 21  # its first token, then 20 decode steps before release
    for sid in sids:
        if sid not in released:
            route.release(sid)


def test_noncontiguous_sequence_ids_stay_isolated(engines, expected, vocab: Vocabulary) -> None:
    """Sessions on sequence ids 0, 2, 3 (1 released) form several ubatches; rows must still map back."""
    route = _route(engines, [0, 15, 30])
    sids = ["nc-0", "nc-1", "nc-2", "nc-3"]
    for sid in sids:
        route.open(sid)
    route.release("nc-1")
    prompts = {sid: vocab.tokenize(p) for sid, p in zip(["nc-0", "nc-2", "nc-3"], PROMPTS[2:5], strict=False)}
    res = route.step([(sid, 0, p) for sid, p in prompts.items()])
    outs = {sid: [r.sampled.token_id] for sid, r in zip(prompts, res, strict=False)}
    pos = {sid: len(p) for sid, p in prompts.items()}
    for _ in range(15):
        items = [(sid, pos[sid], [outs[sid][-1]]) for sid in prompts]
        for (sid, _, _), r in zip(items, route.step(items), strict=False):
            outs[sid].append(r.sampled.token_id)
            pos[sid] += 1
    for sid, text in zip(prompts, PROMPTS[2:5], strict=False):
        assert tuple(outs[sid]) == expected(text)[0][:16]
        route.release(sid)


def test_truncate_and_replay_reproduces_the_stream(engines, expected, vocab: Vocabulary) -> None:
    route = _route(engines, [0, 15, 30])
    prompt = vocab.tokenize(PROMPTS[0])
    route.open("tr")
    out, _ = route.generate("tr", prompt, 10)
    # Roll both stages back to just after the prompt and decode again.
    for e in route.engines:
        e.truncate("tr", len(prompt))
        assert e.kv_len("tr") == len(prompt)
    again = [out[0]]
    pos = len(prompt)
    while len(again) < 10:
        again.append(route.step([("tr", pos, [again[-1]])])[0].sampled.token_id)
        pos += 1
    route.release("tr")
    assert again == out == list(expected(PROMPTS[0])[0][:10])


# -- refusals -------------------------------------------------------------------------------


def test_refusals_leave_other_sessions_untouched(engines, expected, vocab: Vocabulary) -> None:
    stage0 = engines(0, 15)
    stage1 = engines(15, 30)
    route = Route([stage0, stage1])
    prompt = vocab.tokenize(PROMPTS[0])
    route.open("good")
    stage0.open_session("bad")
    first = route.step([("good", 0, prompt)])[0].sampled.token_id
    good_kv = stage0.kv_len("good")
    bad_works = [
        (
            Work("nobody", 0, tokens=np.array([1], dtype=np.int32)),
            UnknownSessionError,
            "unknown session 'nobody'",
        ),
        (
            Work("bad", 3, tokens=np.array([1], dtype=np.int32)),
            PositionError,
            "starts at position 3 but its KV holds 0",
        ),
        (Work("bad", 0, hidden=np.zeros((1, 576), dtype=np.float32)), InputShapeError, "takes token ids"),
        (Work("bad", 0, tokens=np.array([], dtype=np.int32)), InputShapeError, "non-empty 1-D integer"),
        (Work("bad", 0, tokens=np.array([49152], dtype=np.int32)), InputShapeError, "outside the vocabulary"),
        (
            Work("bad", 0, tokens=np.array([1], dtype=np.int32), sample=True),
            InputShapeError,
            "only the last stage",
        ),
        (Work("bad", 0, tokens=np.zeros(600, dtype=np.int32)), KVBudgetError, "exceed its KV budget of 512"),
    ]
    for work, exc, message in bad_works:
        good = Work("good", len(prompt), tokens=np.array([first], dtype=np.int32))
        res_bad, res_good = stage0.step([work, good])
        assert isinstance(res_bad.error, exc), (work, res_bad.error)
        assert message in str(res_bad.error)
        assert res_good.ok
        # The good session advanced; undo so the next round starts at the same place.
        stage0.truncate("good", len(prompt))
    assert stage0.kv_len("good") == good_kv
    assert stage0.kv_len("bad") == 0
    # Hidden-state refusals on the second stage.
    stage1.open_session("bad")
    for hidden, message in [
        (np.zeros((1, 100), dtype=np.float32), "float32 [n>0, 576]"),
        (np.zeros((1, 576), dtype=np.float64), "float32 [n>0, 576]"),
        (np.full((1, 576), np.nan, dtype=np.float32), "NaN"),
    ]:
        (res,) = stage1.step([Work("bad", 0, hidden=hidden)])
        assert isinstance(res.error, InputShapeError) and message in str(res.error)
    (res,) = stage1.step([Work("bad", 0, tokens=np.array([1], dtype=np.int32))])
    assert "takes hidden states" in str(res.error)
    dup = Work("good", len(prompt), tokens=np.array([first], dtype=np.int32))
    r1, r2 = stage0.step([dup, Work("good", len(prompt), tokens=np.array([first], dtype=np.int32))])
    assert r1.ok and "appears twice" in str(r2.error)
    stage0.truncate("good", len(prompt))
    # After all of that the good session still generates exactly its tokens.
    out = [first]
    pos = len(prompt)
    while len(out) < 12:
        out.append(route.step([("good", pos, [out[-1]])])[0].sampled.token_id)
        pos += 1
    assert tuple(out) == expected(PROMPTS[0])[0][:12]
    route.release("good")
    stage0.release("bad")
    stage1.release("bad")


def test_session_lifecycle_errors(engines) -> None:
    stage = engines(15, 30)
    stage.open_session("x")
    with pytest.raises(EngineError, match="already open"):
        stage.open_session("x")
    with pytest.raises(KVBudgetError, match="allows 1..512"):
        stage.open_session("y", kv_budget=100_000)
    with pytest.raises(PositionError, match="cannot truncate"):
        stage.truncate("x", 5)
    stage.release("x")
    with pytest.raises(UnknownSessionError):
        stage.release("x")
    with pytest.raises(UnknownSessionError):
        stage.kv_len("x")
    opened = []
    with pytest.raises(SessionLimitError, match="all 6 session slots are in use"):
        for i in range(7):
            stage.open_session(f"full-{i}")
            opened.append(f"full-{i}")
    for sid in opened:
        stage.release(sid)
    assert stage.statistics().sessions == 0


def test_budget_per_session_is_enforced(engines, vocab: Vocabulary) -> None:
    stage = engines(0, 15)
    stage.open_session("small", kv_budget=8)
    (ok,) = stage.step([Work("small", 0, tokens=np.arange(6, dtype=np.int32))])
    assert ok.ok and ok.kv_len == 6
    (over,) = stage.step([Work("small", 6, tokens=np.arange(3, dtype=np.int32))])
    assert isinstance(over.error, KVBudgetError) and "exceed its KV budget of 8" in str(over.error)
    assert stage.kv_len("small") == 6
    stage.release("small")


def test_prefill_longer_than_one_batch_is_chunked(
    engines, reference: ReferenceModel, vocab: Vocabulary
) -> None:
    """300 tokens > n_batch (256): the engine splits the step into several llama_decode calls."""
    route = _route(engines, [0, 15, 30])
    prompt = (vocab.tokenize(PROMPTS[3]) * 30)[:300]
    route.open("long")
    res = route.step([("long", 0, prompt)], logits=True)[0]
    route.release("long")
    reference.clear()
    want = reference.prefill(prompt)
    assert res.logits.tobytes() == want.tobytes()


def test_python_capture_fallback_gives_the_same_hidden_states(
    engines, model_path: Path, node_cache: Path, engine_config: EngineConfig, vocab: Vocabulary
) -> None:
    """Without a C compiler the engine captures through a ctypes callback; the rows must be identical."""
    py_config = EngineConfig(**{**engine_config.__dict__, "capture": "python"})
    with ShardEngine(extract_shard(model_path, 0, 15, node_cache), py_config, node_cache) as py_stage:
        assert py_stage.statistics().capture == "python"
        c_stage = engines(0, 15)
        assert c_stage.statistics().capture == "c"
        prompts = [vocab.tokenize(p) for p in PROMPTS[:3]]
        hidden = {}
        for stage in (py_stage, c_stage):
            for i in range(3):
                stage.open_session(f"cap-{i}")
            results = stage.step(
                [Work(f"cap-{i}", 0, tokens=np.array(p, dtype=np.int32)) for i, p in enumerate(prompts)]
            )
            hidden[stage.statistics().capture] = [r.hidden.tobytes() for r in results]
            for i in range(3):
                stage.release(f"cap-{i}")
    assert hidden["python"] == hidden["c"]
