"""Engine benchmark: split overhead and batching, each beside plain llama.cpp in the same run.

    python -m sim.bench_engine [--out bench-results/engine.json] [--quick]

1. Split overhead: greedy decode tok/s of an in-process 2-stage split
   ([0,15) + [15,30), compiled capture callback) divided by the whole model's
   (one plain llama.cpp context, token ids in), same prompt, same threads.
   The split with the Python ctypes callback is shown too: the cost the
   compiled callback removes.
2. Batching: aggregate decode tok/s of N concurrent sessions (N = 1, 4, 8, 16,
   each with a context of a few hundred tokens) through the engine, beside raw
   llama.cpp decoding N sequences in one batch (per-sequence KV, its fastest
   configuration here -- unified KV is measured too).

Runs alternate (A, B, A, B, ...) and report medians, so a neighbour's load
hits both sides alike. Figures, not assertions: nothing here fails a build
unless ``--fail-below`` is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from node.engine import EngineConfig, ShardEngine, Work
from node.reference import ReferenceModel
from node.shard import extract_shard
from node.testmodel import test_model_path
from node.vocab import Vocabulary

PROMPT = "The capital of France is"
CONTEXT_TEXT = (
    "The history of the city is long and full of change. Merchants came by river and by road, "
    "and the market grew into a town, and the town into a city with walls and gates. "
)


def _decode_rate_whole(ref: ReferenceModel, prompt: list[int], n: int) -> float:
    ref.clear()
    logits = ref.prefill(prompt)
    tok = int(np.argmax(logits))
    pos = len(prompt)
    t0 = time.perf_counter()
    for _ in range(n):
        ref.decode([0], [pos], [tok], [True])
        tok = int(np.argmax(ref.logits(0)))
        pos += 1
    return n / (time.perf_counter() - t0)


def _decode_rate_split(stages: list[ShardEngine], prompt: list[int], n: int, sid: str) -> float:
    for s in stages:
        s.open_session(sid)
    works = [Work(sid, 0, tokens=np.array(prompt, dtype=np.int32))]
    tok = _through(stages, works)[0]
    pos = len(prompt)
    t0 = time.perf_counter()
    for _ in range(n):
        tok = _through(stages, [Work(sid, pos, tokens=np.array([tok], dtype=np.int32))])[0]
        pos += 1
    rate = n / (time.perf_counter() - t0)
    for s in stages:
        s.release(sid)
    return rate


def _through(stages: list[ShardEngine], works: list[Work]) -> list[int]:
    for k, stage in enumerate(stages):
        last = k == len(stages) - 1
        if last:
            for w in works:
                w.sample = True
        results = stage.step(works)
        if last:
            return [r.sampled.token for r in results]
        works = [Work(r.session_id, r.start_pos, hidden=r.hidden) for r in results]
    raise AssertionError("unreachable")


def bench_split(model: Path, cache: Path, vocab: Vocabulary, threads: int, n_tokens: int, reps: int) -> dict:
    cfg = EngineConfig(n_threads_count=threads, max_sessions=1, session_kv_tokens=512, n_batch_tokens=512)
    cfg_py = EngineConfig(**{**cfg.__dict__, "capture": "python"})
    prompt = vocab.tokenize(PROMPT)
    ref = ReferenceModel(model, cfg.context_settings())
    split = [ShardEngine(extract_shard(model, 0, 15, cache), cfg, cache), ShardEngine(extract_shard(model, 15, 30, cache), cfg, cache)]
    split_py = [ShardEngine(extract_shard(model, 0, 15, cache), cfg_py, cache), split[1]]
    whole, c_split, py_split = [], [], []
    _decode_rate_whole(ref, prompt, 8)  # warm-up: page in weights
    _decode_rate_split(split, prompt, 8, "warm")
    for r in range(reps):
        whole.append(_decode_rate_whole(ref, prompt, n_tokens))
        c_split.append(_decode_rate_split(split, prompt, n_tokens, f"c{r}"))
        py_split.append(_decode_rate_split(split_py, prompt, n_tokens, f"p{r}"))
    ref.close()
    for e in (split[0], split[1], split_py[0]):
        e.close()
    w, c, p = statistics.median(whole), statistics.median(c_split), statistics.median(py_split)
    return {
        "threads": threads,
        "tokens_per_run": n_tokens,
        "runs": reps,
        "whole_tok_s": w,
        "split_c_callback_tok_s": c,
        "split_python_callback_tok_s": p,
        "ratio_split_c_to_whole": c / w,
        "ratio_split_python_to_whole": p / w,
        "samples": {"whole": whole, "split_c": c_split, "split_python": py_split},
    }


def _contexts(vocab: Vocabulary, n: int, ctx_tokens: int) -> list[list[int]]:
    base = vocab.tokenize(CONTEXT_TEXT * 20)
    return [([100 + i] + base)[:ctx_tokens] for i in range(n)]


def _raw_batched(model: Path, settings, prompts: list[list[int]], steps: int) -> float:
    with ReferenceModel(model, settings) as ref:
        n = len(prompts)
        for s, p in enumerate(prompts):
            ref.prefill(p, seq=s)
        toks = [int(np.argmax(ref.logits(len(prompts[0]) - 1 - (len(prompts[0]) - 1) // settings.n_batch * settings.n_batch)))] * n
        pos = [len(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(steps):
            ref.decode(list(range(n)), pos, toks, [True] * n)
            toks = [int(np.argmax(ref.logits(i))) for i in range(n)]
            pos = [p + 1 for p in pos]
        return n * steps / (time.perf_counter() - t0)


def _engine_batched(stages: list[ShardEngine], prompts: list[list[int]], steps: int) -> float:
    sids = [f"b{i}" for i in range(len(prompts))]
    for s in stages:
        for sid in sids:
            s.open_session(sid)
    for sid, p in zip(sids, prompts):  # prefill one at a time (not measured)
        toks = _through(stages, [Work(sid, 0, tokens=np.array(p, dtype=np.int32))])
    last = {sid: toks[0] for sid in sids}
    pos = {sid: len(p) for sid, p in zip(sids, prompts)}
    t0 = time.perf_counter()
    for _ in range(steps):
        works = [Work(sid, pos[sid], tokens=np.array([last[sid]], dtype=np.int32)) for sid in sids]
        for sid, tok in zip(sids, _through(stages, works)):
            last[sid] = tok
            pos[sid] += 1
    rate = len(sids) * steps / (time.perf_counter() - t0)
    for s in stages:
        for sid in sids:
            s.release(sid)
    return rate


def bench_batching(model: Path, cache: Path, vocab: Vocabulary, threads: int, counts: list[int], ctx_tokens: int, steps: int, reps: int) -> list[dict]:
    rows = []
    max_n = max(counts)
    cfg = EngineConfig(n_threads_count=threads, max_sessions=max_n, session_kv_tokens=ctx_tokens + steps + 64, n_batch_tokens=512)
    whole = [ShardEngine(extract_shard(model, 0, 30, cache), cfg, cache)]
    split = [ShardEngine(extract_shard(model, 0, 15, cache), cfg, cache), ShardEngine(extract_shard(model, 15, 30, cache), cfg, cache)]
    settings = cfg.context_settings()
    unified = settings.__class__(**{**settings.__dict__, "kv_unified": True})
    for n in counts:
        prompts = _contexts(vocab, n, ctx_tokens)
        raw, raw_u, eng, eng_split = [], [], [], []
        for _ in range(reps):
            raw.append(_raw_batched(model, settings, prompts, steps))
            eng.append(_engine_batched(whole, prompts, steps))
            eng_split.append(_engine_batched(split, prompts, steps))
            raw_u.append(_raw_batched(model, unified, prompts, steps))
        r, ru, e, es = (statistics.median(x) for x in (raw, raw_u, eng, eng_split))
        best = max(r, ru)
        rows.append(
            {
                "sessions": n,
                "context_tokens": ctx_tokens,
                "raw_per_seq_kv_tok_s": r,
                "raw_unified_kv_tok_s": ru,
                "engine_whole_tok_s": e,
                "engine_split2_tok_s": es,
                "ratio_engine_to_best_raw": e / best,
                "ratio_split2_to_best_raw": es / best,
            }
        )
        print(f"  {n:>2} sessions: raw {r:6.1f} (unified {ru:6.1f})  engine {e:6.1f}  split {es:6.1f} tok/s  ratio {e / best:.3f}", flush=True)
    for s in whole + split:
        s.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-results/engine.json"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repetitions (smoke run)")
    ap.add_argument("--fail-below", type=float, default=None, help="exit 1 if a ratio falls below this")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = test_model_path()
    cache = Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    vocab = Vocabulary(model)
    n_tokens, reps, steps = (32, 1, 8) if args.quick else (128, 5, 32)
    print(f"split overhead ({args.threads} thread(s), {n_tokens} tokens x {reps} runs, medians):", flush=True)
    split = bench_split(model, cache, vocab, args.threads, n_tokens, reps)
    print(
        f"  whole model {split['whole_tok_s']:.1f} tok/s | 2-stage split, C callback {split['split_c_callback_tok_s']:.1f} "
        f"(ratio {split['ratio_split_c_to_whole']:.3f}) | Python callback {split['split_python_callback_tok_s']:.1f} "
        f"(ratio {split['ratio_split_python_to_whole']:.3f})",
        flush=True,
    )
    print(f"batching ({args.threads} thread(s), {steps} decode steps, medians of {max(1, reps - 2)}):", flush=True)
    batching = bench_batching(model, cache, vocab, args.threads, [1, 4, 8, 16], 320, steps, max(1, reps - 2))
    result = {"benchmark": "engine", "model": model.name, "split": split, "batching": batching, "unix_time": time.time()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    if args.fail_below is not None:
        ratios = [split["ratio_split_c_to_whole"]] + [r["ratio_engine_to_best_raw"] for r in batching]
        if min(ratios) < args.fail_below:
            raise SystemExit(f"a ratio ({min(ratios):.3f}) is below --fail-below {args.fail_below}")


if __name__ == "__main__":
    main()
