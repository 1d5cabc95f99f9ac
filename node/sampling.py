"""Token sampling on the last stage: pure numpy, deterministic per (seed, position).

The random draw for the token at position ``p`` of a session comes from a
generator seeded with ``(seed, p)``, not from a stream that advances with every
call. So a replacement last stage (recovery after a node failure) or a replayed
step draws exactly the token the original would have drawn: sampling has no
hidden state to lose.

Order of operations: ``logit_bias`` added to the raw logits; the repetition
penalty (llama.cpp's: divide positive, multiply negative logits of the last
``penalty_last_n`` tokens of the whole history); OpenAI's frequency and
presence penalties over the completion so far (``logit[j] -= count[j] *
frequency_penalty + (count[j] > 0) * presence_penalty``, counting the tokens
at positions ``>= completion_start``); the grammar constraint (tokens it does
not allow are out); then top-k, top-p, min-p filtering, temperature and the
draw. ``temperature <= 0`` is greedy (argmax of the adjusted logits, ties to
the lowest id).

Every input of a draw is a function of the token history (the constraint's
state too: :class:`Constraint` is handed the completion tokens and rebuilds
from them), so a replayed history reproduces every draw.

``choices`` > 1 (n > 1 sharing one prompt): the draw of the first completion
token also draws ``choices - 1`` more tokens from the same adjusted logits,
choice ``i`` with seed ``(seed + i) mod 2**63`` -- exactly what a separate
request with that seed draws.

Reported logprobs are those of the model's distribution (log-softmax of the raw
logits, before bias, penalties, constraint, filters and temperature), like
OpenAI's API.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from proto.codec import Sampled

MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16
SEED_MODULUS = 2**63


class SamplingError(ValueError):
    pass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0  # 1.0: off
    penalty_last_n: int = 64
    top_logprobs: int = 0  # how many alternatives to report (0..MAX_TOP_LOGPROBS)
    frequency_penalty: float = 0.0  # OpenAI's, over the completion (-2..2)
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its raw logit), -100..100
    grammar: str = ""  # llguidance grammar (node/constraints.py); "" = unconstrained
    completion_start: int = 0  # position of the first completion token
    choices: int = 1  # tokens drawn at completion_start (n > 1)

    @property
    def adjusts(self) -> bool:
        """Whether anything changes the logits before the filters (else greedy is a plain argmax)."""
        return bool(
            self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
            or self.logit_bias
            or self.grammar
        )

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(
            self.frequency_penalty or self.presence_penalty or self.grammar
        )

    def validate(self) -> SamplingParams:
        if not (0.0 <= self.temperature <= 100.0) or not np.isfinite(self.temperature):
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 <= self.min_p < 1.0):
            raise SamplingError(f"min_p must be in [0, 1), got {self.min_p}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise SamplingError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.penalty_last_n < 0:
            raise SamplingError(f"penalty_last_n must be >= 0, got {self.penalty_last_n}")
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise SamplingError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not (0 <= self.seed < 2**63):
            raise SamplingError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise SamplingError(f"{name} must be in [-2, 2], got {value}")
        if any(not (-100.0 <= b <= 100.0) for _, b in self.logit_bias):
            raise SamplingError("logit_bias values must be in [-100, 100]")
        if self.completion_start < 0:
            raise SamplingError(f"completion_start must be >= 0, got {self.completion_start}")
        if not (1 <= self.choices <= MAX_CHOICES):
            raise SamplingError(f"choices must be in [1, {MAX_CHOICES}], got {self.choices}")
        return self


class Constraint(Protocol):
    """A grammar over the completion (node/constraints.py): which tokens may come next."""

    def allowed(
        self, completion: Sequence[int], remaining: int | None = None
    ) -> npt.NDArray[np.bool_] | None:
        """A mask over the vocabulary after ``completion`` (the tokens so far), with ``remaining`` tokens
        left to the session's budget (this one included; None: unknown); None: no limit."""
        ...


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64, copy=False)
    return x - logsumexp(logits)


def logsumexp(logits: np.ndarray) -> float:
    """log(sum(exp(logits))): exp in float32 (one pass, on the hot path of every token), summed in float64."""
    m = float(logits.max())
    shifted = np.subtract(logits, np.float32(m), dtype=np.float32)
    np.exp(shifted, out=shifted)
    return m + float(np.log(shifted.sum(dtype=np.float64)))


def adjusted_logits(
    logits: np.ndarray,
    params: SamplingParams,
    history: np.ndarray | None = None,
    constraint: Constraint | None = None,
    remaining: int | None = None,
) -> np.ndarray:
    """The logits the draw uses (float64): bias, penalties and constraint applied (module docstring)."""
    work = logits.astype(np.float64)
    n = work.size
    for token, bias in params.logit_bias:
        if 0 <= token < n:
            work[token] += bias
    hist = np.zeros(0, np.int64) if history is None else np.asarray(history, dtype=np.int64)
    if params.repetition_penalty != 1.0 and params.penalty_last_n > 0 and hist.size:
        recent = np.unique(hist[-params.penalty_last_n :])
        recent = recent[(recent >= 0) & (recent < n)]
        vals = work[recent]
        work[recent] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    completion = hist[params.completion_start :]
    if (params.frequency_penalty or params.presence_penalty) and completion.size:
        ids, counts = np.unique(completion[(completion >= 0) & (completion < n)], return_counts=True)
        work[ids] -= counts * params.frequency_penalty + params.presence_penalty
    if constraint is not None:
        mask = constraint.allowed(completion.tolist(), remaining)
        if mask is not None and mask[:n].any():
            work[~mask[:n]] = -np.inf
    return work


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    position: int,
    history: np.ndarray | None = None,
    constraint: Constraint | None = None,
    remaining: int | None = None,
) -> Sampled:
    """Pick the next token (at ``position``) from one row of logits (float32, vocabulary-sized)."""
    return sample_choices(logits, params, position, history, constraint, remaining)[0]


def sample_choices(
    logits: np.ndarray,
    params: SamplingParams,
    position: int,
    history: np.ndarray | None = None,
    constraint: Constraint | None = None,
    remaining: int | None = None,
) -> list[Sampled]:
    """The session's token, then, at ``completion_start`` with ``choices`` > 1, one per other choice."""
    logits = np.asarray(logits, dtype=np.float32)
    lse = logsumexp(logits)
    n = params.choices if position == params.completion_start else 1
    seeds = [(params.seed + i) % SEED_MODULUS for i in range(n)]
    if params.temperature <= 0.0 and not params.adjusts:
        tokens = [int(np.argmax(logits))] * n
    else:
        work = adjusted_logits(logits, params, history, constraint, remaining)
        if params.temperature <= 0.0:
            tokens = [int(np.argmax(work))] * n
        else:
            tokens = [_draw(work, params, position, seed) for seed in seeds]
    tops: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs:
        k = params.top_logprobs
        idx = np.argpartition(-logits, k - 1)[:k]
        idx = idx[np.lexsort((idx, -logits[idx]))]
        tops = tuple((int(i), float(logits[i]) - lse) for i in idx)
    return [Sampled(token_id=t, logprob=float(logits[t]) - lse, top_logprobs=tops) for t in tokens]


def _draw(work: np.ndarray, params: SamplingParams, position: int, seed: int) -> int:
    finite = np.isfinite(work)
    cand = np.arange(work.size) if finite.all() else np.flatnonzero(finite)
    if params.top_k and params.top_k < cand.size:
        cand = cand[np.argpartition(-work[cand], params.top_k - 1)[: params.top_k]]
    # Sort candidates by logit (descending, ties by id) so filters are well defined.
    cand = cand[np.lexsort((cand, -work[cand]))]
    vals = work[cand]
    probs = np.exp(vals - vals[0])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p, side="left")) + 1
        cand, vals = cand[:keep], vals[:keep]
        probs = probs[:keep]
    if params.min_p > 0.0:
        mask = probs >= params.min_p * probs[0]
        cand, vals = cand[mask], vals[mask]
    scaled = vals / params.temperature
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    rng = np.random.Generator(np.random.PCG64([seed, position]))
    return int(cand[int(np.searchsorted(np.cumsum(p), rng.random(), side="right").clip(0, len(cand) - 1))])
