"""The draft model (node/draft_model.py) on real llama.cpp: SmolLM2 drafting for itself.

A Q4_0 copy of the bundled SmolLM2 (made with llama.cpp's quantizer) drafts; its proposals must be
the draft model's own greedy continuation whatever the history did before (grown, rolled back,
its sequence taken by another session), histories past its context draft by n-gram lookup, and a
model with another vocabulary (Gemma 3) is refused with an error naming the difference.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from common.speculation import ChoicePolicy, NgramProposer, ProposerChoice
from common.vocab import Vocabulary
from node.config import ConfigError, NodeConfig
from node.draft_model import DraftModel, DraftModelError, quantize, vocab_digest
from node.drafting import SessionDrafter
from node.llama_runtime import ContextSettings, free_model, load_model, new_context
from node.testmodel import gemma3_model_path

pytestmark = pytest.mark.slow

PROMPT = "<|im_start|>user\nTell me about the ocean.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def draft_path(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    return quantize(model_path, tmp_path_factory.mktemp("draft") / "smol-q4_0.gguf", "q4_0")


@pytest.fixture(scope="module")
def draft(draft_path: Path, model_path: Path) -> Iterator[DraftModel]:
    dm = DraftModel(draft_path, model_path, slots=2, context_tokens=128)
    yield dm
    dm.close()


@pytest.fixture(scope="module")
def prompt(model_path: Path) -> list[int]:
    with Vocabulary(model_path) as v:
        return v.tokenize(PROMPT)


def greedy_reference(path: Path, history: list[int], k: int) -> list[int]:
    """k greedy tokens of the model at ``path`` after ``history``, from a fresh context, one at a time."""
    model = load_model(path)
    ctx = new_context(model, ContextSettings(n_seq_max=1, n_ctx=256, n_batch=256, n_ubatch=256))
    try:
        n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)))
        out: list[int] = []
        tokens = list(history)
        for _ in range(k):
            arr = (llama_cpp.llama_token * len(tokens))(*tokens)
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(tokens))) == 0
            ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
            logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
            out.append(int(np.argmax(logits)))
            tokens.append(out[-1])
        return out
    finally:
        llama_cpp.llama_free(ctx)
        free_model(model)


def test_proposals_are_the_draft_models_greedy_continuation_across_rollbacks(
    draft: DraftModel, draft_path: Path, prompt: list[int]
) -> None:
    p = draft.proposer(NgramProposer(), lookahead=False)  # counts only its own passes
    p.extend(prompt)
    first = p.propose(6)
    assert list(first) == greedy_reference(draft_path, prompt, 6)
    # Three drafts accepted, a correction that differs from the fourth: the KV keeps the agreeing part.
    decoded = draft.decoded
    history = [*prompt, *first[:3], (first[3] + 1) % draft.n_vocab]
    p.extend(history[len(prompt) :])
    second = p.propose(4)
    assert list(second) == greedy_reference(draft_path, history, 4)
    assert draft.decoded - decoded == 1 + 3  # only the correction, then 3 of the 4 drafts
    # A rollback (a re-attach truncated the KV): the proposals follow the shorter history.
    p.truncate(len(prompt) + 1)
    assert p.length == len(prompt) + 1
    third = p.propose(3)
    assert list(third) == greedy_reference(draft_path, history[: len(prompt) + 1], 3)
    assert p.fallbacks == 0


def test_a_look_ahead_drafts_the_next_window_while_this_one_travels(
    draft: DraftModel, draft_path: Path, prompt: list[int]
) -> None:
    p = draft.proposer(NgramProposer())
    p.extend(prompt)
    first = p.propose(4)
    # Every draft accepted and the target's token the one the draft model guessed: the next window's
    # drafts were drafted by the thread meanwhile, and they are the greedy continuation.
    after = greedy_reference(draft_path, [*prompt, *first], 6)
    history = [*prompt, *first, after[0]]
    hits, misses = draft.lookahead_hits, draft.lookahead_misses
    p.extend(history[len(prompt) :])
    second = p.propose(4)
    assert list(second) == after[1:5]
    assert draft.lookahead_hits == hits + 1 and draft.lookahead_misses == misses
    # The target took another token: the look-ahead is dropped, the drafts follow the real history.
    wrong = [*history, *second[:1], (second[1] + 1) % draft.n_vocab]
    p.extend(wrong[len(history) :])
    third = p.propose(3)
    assert list(third) == greedy_reference(draft_path, wrong, 3)
    assert draft.lookahead_misses == misses + 1 and p.fallbacks == 0
    # Windows discarded (SessionDrafter.forget): back to a shorter history, the drafts follow it.
    p.truncate(len(history))
    fourth = p.propose(2)
    assert list(fourth) == greedy_reference(draft_path, history, 2)


def test_a_third_session_takes_the_least_recently_used_sequence(
    draft: DraftModel, draft_path: Path, prompt: list[int]
) -> None:
    a, b, c = (draft.proposer(NgramProposer()) for _ in range(3))
    for i, p in enumerate((a, b, c)):
        p.extend(prompt[: len(prompt) - i])
    want = {
        id(p): greedy_reference(draft_path, prompt[: len(prompt) - i], 2) for i, p in enumerate((a, b, c))
    }
    steals = draft.steals
    for p in (a, b, c, a):  # 2 slots: c takes a's, then a takes b's
        assert list(p.propose(2)) == want[id(p)]
    assert draft.steals >= steals + 2


def test_a_history_past_the_draft_context_drafts_by_ngram_lookup(draft: DraftModel) -> None:
    ngram = NgramProposer()
    p = draft.proposer(ngram, lookahead=False)
    loop = [11, 12, 13, 14, 15]
    p.extend(loop * 30)  # 150 tokens > the 128-position context
    draft.settle()  # earlier tests' look-aheads are done
    proposals = draft.proposals
    assert p.propose(3) == ngram.propose(3) == (11, 12, 13)
    assert p.fallbacks == 1 and draft.proposals == proposals
    p.truncate(60)  # back inside the context: the model drafts again
    p.propose(2)
    assert draft.proposals == proposals + 1


def test_a_session_drafter_uses_the_draft_model(draft: DraftModel, prompt: list[int]) -> None:
    drafter = SessionDrafter(4, draft.proposer)
    draft.settle()
    proposals = draft.proposals
    drafts = drafter.drafts(prompt[:-1], [], prompt[-1], room=100)
    assert len(drafts) == 4 and draft.proposals == proposals + 1


def test_a_draft_with_another_vocabulary_is_refused(model_path: Path, draft_path: Path) -> None:
    with pytest.raises(DraftModelError, match=r"vocabulary is not the target model's \(262144 tokens"):
        DraftModel(gemma3_model_path(), model_path, slots=1)
    # The same vocabulary, whatever the weights' precision: the same digest.
    a, b = load_model(model_path, vocab_only=True), load_model(draft_path, vocab_only=True)
    try:
        assert vocab_digest(a) == vocab_digest(b)
    finally:
        free_model(a)
        free_model(b)


def test_the_config_refuses_a_missing_draft_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="draft_model: no such file"):
        NodeConfig(model="m.gguf", draft_model=str(tmp_path / "none.gguf")).validate()


def test_where_the_draft_model_costs_more_than_it_saves_sessions_draft_by_ngram(
    draft: DraftModel, prompt: list[int]
) -> None:
    """Auto choice, with times the test gives: passes drafted by the model take 1 s, n-gram passes
    (no match here: plain steps of one token) 0.1 s; after the probe the session drafts by n-gram."""
    drafter = SessionDrafter(4, draft.proposer, ProposerChoice(ChoicePolicy(probe_passes=4, hold_passes=8)))
    history, token, now = list(prompt[:-1]), prompt[-1], 0.0
    arms = []
    for _ in range(4 + 4 + 8):
        before = draft.proposals
        drafts = drafter.drafts(history, [], token, room=100, now=now)
        arms.append("model" if draft.proposals > before else "ngram")
        drafter.observe(len(drafts), len(drafts))  # every draft accepted
        history += [token, *drafts]
        token = 5
        now += 1.0 if arms[-1] == "model" else 0.1
    assert arms == ["model"] * 4 + ["ngram"] * (4 + 8)
    assert drafter.choice is not None and drafter.choice.rate("ngram") > drafter.choice.rate("model")
