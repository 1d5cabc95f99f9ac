"""Token sampling on the last stage: pure numpy, deterministic per (seed, position).

The random draw for the token at position ``p`` of a session comes from a
generator seeded with ``(seed, p)``, not from a stream that advances with every
call. So a replacement last stage (recovery after a node failure) or a replayed
step draws exactly the token the original would have drawn: sampling has no
hidden state to lose.

Order of operations (as in common llama.cpp chains): repetition penalty on the
raw logits, then top-k, top-p, min-p filtering, then temperature, then the
draw. ``temperature <= 0`` is greedy (argmax, ties to the lowest id).

Reported logprobs are those of the model's distribution (log-softmax of the raw
logits, before penalties, filters and temperature), like OpenAI's API.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20


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
        return self


@dataclass(frozen=True)
class SampledToken:
    token: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64, copy=False)
    return x - logsumexp(logits)


def logsumexp(logits: np.ndarray) -> float:
    """log(sum(exp(logits))): exp in float32 (one pass, on the hot path of every token), summed in float64."""
    m = float(logits.max())
    shifted = np.subtract(logits, np.float32(m), dtype=np.float32)
    np.exp(shifted, out=shifted)
    return m + float(np.log(shifted.sum(dtype=np.float64)))


def sample(
    logits: np.ndarray, params: SamplingParams, position: int, history: np.ndarray | None = None
) -> SampledToken:
    """Pick the next token from one row of logits (float32, vocabulary-sized)."""
    logits = np.asarray(logits, dtype=np.float32)
    lse = logsumexp(logits)
    if params.temperature <= 0.0 and params.repetition_penalty == 1.0:
        token = int(np.argmax(logits))
    else:
        work = logits.astype(np.float64)
        if params.repetition_penalty != 1.0 and history is not None and params.penalty_last_n > 0:
            recent = np.unique(np.asarray(history[-params.penalty_last_n :], dtype=np.int64))
            recent = recent[(recent >= 0) & (recent < work.size)]
            vals = work[recent]
            work[recent] = np.where(
                vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
            )
        if params.temperature <= 0.0:
            token = int(np.argmax(work))
        else:
            token = _draw(work, params, position)
    tops: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs:
        k = params.top_logprobs
        idx = np.argpartition(-logits, k - 1)[:k]
        idx = idx[np.lexsort((idx, -logits[idx]))]
        tops = tuple((int(i), float(logits[i]) - lse) for i in idx)
    return SampledToken(token=token, logprob=float(logits[token]) - lse, top_logprobs=tops)


def _draw(work: np.ndarray, params: SamplingParams, position: int) -> int:
    if params.top_k and params.top_k < work.size:
        cand = np.argpartition(-work, params.top_k - 1)[: params.top_k]
    else:
        cand = np.arange(work.size)
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
    rng = np.random.Generator(np.random.PCG64([params.seed, position]))
    return int(cand[int(np.searchsorted(np.cumsum(p), rng.random(), side="right").clip(0, len(cand) - 1))])
