"""A short benchmark of the node's own shard at start-up (runs on the engine thread).

One throw-away session: a 64-position prefill, then 16 single-position decode
steps, through the real engine. The figures go into the announce
(``decode_ms_per_token``, ``prefill_tokens_per_s``), which the tracker uses
to cost routes. Takes well under a second on the test model; a few seconds on
big shards. The session is released afterwards, so the KV is empty again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from node.engine import ShardEngine, Work

BENCH_SESSION = "__startup_benchmark__"


@dataclass(frozen=True)
class BenchResult:
    decode_ms_per_token: float
    prefill_tokens_per_s: float
    prefill_tokens: int
    decode_steps: int


def _work(engine: ShardEngine, pos: int, n: int, rng: np.random.Generator) -> Work:
    if engine.is_first:
        return Work(
            BENCH_SESSION, pos, tokens=rng.integers(0, 1000, n, dtype=np.int32), sample=engine.is_last
        )
    hidden = rng.standard_normal((n, engine.n_embd), dtype=np.float32) * 0.1
    return Work(BENCH_SESSION, pos, hidden=hidden, sample=engine.is_last)


def run_benchmark(engine: ShardEngine, prefill_tokens: int = 64, decode_steps: int = 16) -> BenchResult:
    rng = np.random.default_rng(0)
    prefill_tokens = max(1, min(prefill_tokens, engine.session_kv_limit - decode_steps - 1, engine.n_batch))
    engine.open_session(
        BENCH_SESSION, kv_budget=min(engine.session_kv_limit, prefill_tokens + decode_steps + 1)
    )
    try:
        t0 = time.perf_counter()
        (res,) = engine.step([_work(engine, 0, prefill_tokens, rng)])
        prefill_s = time.perf_counter() - t0
        if res.error:
            raise res.error
        pos = prefill_tokens
        t0 = time.perf_counter()
        for _ in range(decode_steps):
            (res,) = engine.step([_work(engine, pos, 1, rng)])
            if res.error:
                raise res.error
            pos += 1
        decode_s = time.perf_counter() - t0
    finally:
        engine.release(BENCH_SESSION)
    return BenchResult(
        decode_ms_per_token=max(1e-3, decode_s * 1000 / decode_steps),
        prefill_tokens_per_s=max(1e-3, prefill_tokens / max(prefill_s, 1e-9)),
        prefill_tokens=prefill_tokens,
        decode_steps=decode_steps,
    )
