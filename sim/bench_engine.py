"""Engine benchmark: split overhead and batching, each beside plain llama.cpp in the same run.

    python -m sim.bench_engine [--model FILE] [--out bench-results/engine.json] [--quick]

``--model`` takes any supported GGUF (default: the SmolLM2 test model; the
Gemma 3 test model is ``--model gemma3``).

1. Split overhead: greedy decode tok/s of an in-process 2-stage split (cut in
   the middle, ``[0,15) + [15,30)`` for SmolLM2, ``[0,9) + [9,18)`` for
   Gemma 3; compiled capture callback) divided by the whole model's (one plain
   llama.cpp context, token ids in), same prompt, same threads. The split with
   the Python ctypes callback is shown too: the cost the compiled callback
   removes.
2. Batching: aggregate decode tok/s of N concurrent sessions (N = 1, 4, 8, 16,
   each with a context of 320 tokens, or the sliding window plus 128 for a
   sliding-window model, so every session attends past its window) through
   the engine, beside raw llama.cpp decoding N sequences in one batch
   (per-sequence KV, its fastest configuration here -- unified KV is
   measured too).

The setups advance in lock-step (one step of each in turn) and both wall time
and the calling thread's CPU time are reported: with one llama.cpp thread the
compute runs on the calling thread, so CPU time is the figure a neighbour's
load on a shared machine cannot inflate. Figures, not assertions: nothing here fails a build
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
from typing import Any

import numpy as np

from common.vocab import Vocabulary
from node.engine import EngineConfig, ShardEngine, Work
from node.reference import ReferenceModel
from node.shard import extract_shard, read_model_meta
from node.testmodel import gemma3_model_path, test_model_path

PROMPT = "The capital of France is"
CONTEXT_TEXT = (
    "The history of the city is long and full of change. Merchants came by river and by road, "
    "and the market grew into a town, and the town into a city with walls and gates. "
)


class _Clock:
    """Wall time and this thread's CPU time of the timed calls (llama.cpp computes on the calling
    thread with one thread, so CPU time is what a neighbour's load cannot inflate)."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def timed(self, fn, *args):
        w, c = time.perf_counter(), time.thread_time()
        out = fn(*args)
        self.wall += time.perf_counter() - w
        self.cpu += time.thread_time() - c
        return out


class _WholeStream:
    """Greedy decode of one prompt in the plain reference context, one token per call."""

    def __init__(self, ref: ReferenceModel, prompt: list[int]) -> None:
        ref.clear()
        self.ref = ref
        self.tok = int(np.argmax(ref.prefill(prompt)))
        self.pos = len(prompt)

    def step(self) -> int:
        self.ref.decode([0], [self.pos], [self.tok], [True])
        self.tok = int(np.argmax(self.ref.logits(0)))
        self.pos += 1
        return self.tok


class _SplitStream:
    """The same through engines: stage 0 gets the token, later stages the hidden states."""

    def __init__(self, stages: list[ShardEngine], prompt: list[int], sid: str) -> None:
        self.stages, self.sid = stages, sid
        for s in stages:
            s.open_session(sid)
        self.tok = _through(stages, [Work(sid, 0, tokens=np.array(prompt, dtype=np.int32))])[0]
        self.pos = len(prompt)

    def step(self) -> int:
        self.tok = _through(
            self.stages, [Work(self.sid, self.pos, tokens=np.array([self.tok], dtype=np.int32))]
        )[0]
        self.pos += 1
        return self.tok

    def close(self) -> None:
        for s in self.stages:
            s.release(self.sid)


def _through(stages: list[ShardEngine], works: list[Work]) -> list[int]:
    for k, stage in enumerate(stages):
        last = k == len(stages) - 1
        if last:
            for w in works:
                w.sample = True
        results = stage.step(works)
        if last:
            tokens = [r.sampled.token_id for r in results if r.sampled is not None]
            if len(tokens) != len(results):
                raise RuntimeError(f"a stage failed: {[str(r.error) for r in results if r.error]}")
            return tokens
        works = [Work(r.session_id, r.start_pos, hidden=r.hidden) for r in results]
    raise AssertionError("unreachable")


def bench_split(
    model: Path,
    cache: Path,
    vocab: Vocabulary,
    threads: int,
    n_tokens: int,
    reps: int,
    bounds: tuple[int, int, int],
) -> dict:
    """Whole model vs 2-stage split (C capture) vs 2-stage split (Python capture), token by token
    in lock-step, so load from elsewhere on the machine falls on all three alike."""
    cfg = EngineConfig(threads=threads, max_sessions=1, session_kv_tokens=512, batch_tokens=512)
    cfg_py = EngineConfig(**{**cfg.__dict__, "capture": "python"})
    prompt = vocab.tokenize(PROMPT)
    ref = ReferenceModel(model, cfg.context_settings())
    a, h, n = bounds
    split = [
        ShardEngine(extract_shard(model, a, h, cache), cfg, cache),
        ShardEngine(extract_shard(model, h, n, cache), cfg, cache),
    ]
    split_py = [
        ShardEngine(extract_shard(model, a, h, cache), cfg_py, cache),
        ShardEngine(extract_shard(model, h, n, cache), cfg, cache),
    ]
    runs: list[dict[str, Any]] = []
    for r in range(reps):
        clocks = {"whole": _Clock(), "split_c": _Clock(), "split_python": _Clock()}
        whole_s = _WholeStream(ref, prompt)
        c_s = _SplitStream(split, prompt, f"c{r}")
        p_s = _SplitStream(split_py, prompt, f"p{r}")
        same = True
        for _ in range(n_tokens):
            a = clocks["whole"].timed(whole_s.step)
            b = clocks["split_c"].timed(c_s.step)
            c = clocks["split_python"].timed(p_s.step)
            same &= a == b == c
        c_s.close()
        p_s.close()
        run: dict[str, Any] = {
            k: {"wall_tok_s": n_tokens / v.wall, "cpu_tok_s": n_tokens / v.cpu} for k, v in clocks.items()
        }
        run["same_tokens"] = same
        runs.append(run)
    ref.close()
    for e in split + split_py:
        e.close()

    def med(key: str, kind: str) -> float:
        return statistics.median(run[key][kind] for run in runs)

    out = {
        "bounds": list(bounds),
        "threads": threads,
        "tokens_per_run": n_tokens,
        "runs": reps,
        "same_tokens_all_runs": all(r["same_tokens"] for r in runs),
        "samples": runs,
    }
    for kind in ("wall_tok_s", "cpu_tok_s"):
        w, c, p = med("whole", kind), med("split_c", kind), med("split_python", kind)
        out[kind] = {
            "whole": w,
            "split_c_callback": c,
            "split_python_callback": p,
            "ratio_split_c_to_whole": c / w,
            "ratio_split_python_to_whole": p / w,
        }
    return out


def _contexts(vocab: Vocabulary, n: int, ctx_tokens: int) -> list[list[int]]:
    base = vocab.tokenize(CONTEXT_TEXT * 20)
    return [([100 + i] + base)[:ctx_tokens] for i in range(n)]


class _RawBatch:
    """Raw llama.cpp decoding n sequences in one batch (each with its own context of prompt tokens)."""

    def __init__(self, model: Path, settings, prompts: list[list[int]]) -> None:
        self.ref = ReferenceModel(model, settings)
        self.n = len(prompts)
        for s, p in enumerate(prompts):
            logits = self.ref.prefill(p, seq=s)
        self.toks = [int(np.argmax(logits))] * self.n
        self.pos = [len(p) for p in prompts]

    def step(self) -> None:
        self.ref.decode(list(range(self.n)), self.pos, self.toks, [True] * self.n)
        self.toks = [int(np.argmax(self.ref.logits(i))) for i in range(self.n)]
        self.pos = [p + 1 for p in self.pos]

    def close(self) -> None:
        self.ref.close()


class _EngineBatch:
    """The same number of sessions through engines, one batched step each call."""

    def __init__(self, stages: list[ShardEngine], prompts: list[list[int]], tag: str) -> None:
        self.stages = stages
        self.sids = [f"{tag}{i}" for i in range(len(prompts))]
        for s in stages:
            for sid in self.sids:
                s.open_session(sid)
        self.last, self.pos = {}, {}
        for sid, p in zip(self.sids, prompts, strict=True):
            self.last[sid] = _through(stages, [Work(sid, 0, tokens=np.array(p, dtype=np.int32))])[0]
            self.pos[sid] = len(p)

    def step(self) -> None:
        works = [
            Work(sid, self.pos[sid], tokens=np.array([self.last[sid]], dtype=np.int32)) for sid in self.sids
        ]
        for sid, tok in zip(self.sids, _through(self.stages, works), strict=True):
            self.last[sid] = tok
            self.pos[sid] += 1

    def close(self) -> None:
        for s in self.stages:
            for sid in self.sids:
                s.release(sid)


def bench_batching(
    model: Path,
    cache: Path,
    vocab: Vocabulary,
    threads: int,
    counts: list[int],
    ctx_tokens: int,
    steps: int,
    reps: int,
    bounds: tuple[int, int, int],
) -> list[dict]:
    """Per session count: raw llama.cpp (per-sequence KV, and unified KV) and the engine (whole model
    as one shard, and a 2-stage split), stepping in lock-step so load hits all alike."""
    rows = []
    max_n = max(counts)
    cfg = EngineConfig(
        threads=threads,
        max_sessions=max_n,
        session_kv_tokens=ctx_tokens + steps * reps + 64,
        batch_tokens=512,
    )
    a, h, n_layers = bounds
    whole = [ShardEngine(extract_shard(model, a, n_layers, cache), cfg, cache)]
    split = [
        ShardEngine(extract_shard(model, a, h, cache), cfg, cache),
        ShardEngine(extract_shard(model, h, n_layers, cache), cfg, cache),
    ]
    settings = cfg.context_settings()
    unified = settings.__class__(**{**settings.__dict__, "kv_unified": True})
    for n in counts:
        prompts = _contexts(vocab, n, ctx_tokens)
        setups: dict[str, _RawBatch | _EngineBatch] = {
            "raw_per_seq_kv": _RawBatch(model, settings, prompts),
            "raw_unified_kv": _RawBatch(model, unified, prompts),
            "engine_whole": _EngineBatch(whole, prompts, "w"),
            "engine_split2": _EngineBatch(split, prompts, "s"),
        }
        clocks = {k: _Clock() for k in setups}
        for _ in range(steps * reps):
            for k, setup in setups.items():
                clocks[k].timed(setup.step)
        for setup in setups.values():
            setup.close()
        row: dict = {"sessions": n, "context_tokens": ctx_tokens, "steps": steps * reps}
        for kind, attr in (("wall", "wall"), ("cpu", "cpu")):
            for k, clock in clocks.items():
                row[f"{k}_{kind}_tok_s"] = n * steps * reps / getattr(clock, attr)
            best = max(row[f"raw_per_seq_kv_{kind}_tok_s"], row[f"raw_unified_kv_{kind}_tok_s"])
            row[f"ratio_engine_to_best_raw_{kind}"] = row[f"engine_whole_{kind}_tok_s"] / best
            row[f"ratio_split2_to_best_raw_{kind}"] = row[f"engine_split2_{kind}_tok_s"] / best
        rows.append(row)
        print(
            f"  {n:>2} sessions (cpu tok/s): raw {row['raw_per_seq_kv_cpu_tok_s']:6.1f} "
            f"(unified {row['raw_unified_kv_cpu_tok_s']:6.1f})  engine {row['engine_whole_cpu_tok_s']:6.1f}  "
            f"split {row['engine_split2_cpu_tok_s']:6.1f}  ratio {row['ratio_engine_to_best_raw_cpu']:.3f} "
            f"(wall ratio {row['ratio_engine_to_best_raw_wall']:.3f})",
            flush=True,
        )
    for s in whole + split:
        s.close()
    return rows


def _sliding_window(model: Path, arch: str) -> int | None:
    """The model's sliding-window length if any of its layers use one."""
    from gguf import GGUFReader

    field = GGUFReader(model).fields.get(f"{arch}.attention.sliding_window")
    value = field.contents() if field is not None else None
    return int(value) if value else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="GGUF file, or 'gemma3' for the Gemma 3 test model (default: SmolLM2)"
    )
    ap.add_argument("--out", type=Path, default=None, help="default bench-results/engine[-<model>].json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repetitions (smoke run)")
    ap.add_argument("--fail-below", type=float, default=None, help="exit 1 if a ratio falls below this")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.model is None:
        model = test_model_path()
    elif args.model == "gemma3":
        model = gemma3_model_path()
    else:
        model = Path(args.model)
    out_path = args.out or Path(
        "bench-results/engine.json" if args.model is None else f"bench-results/engine-{model.stem}.json"
    )
    cache = Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    meta = read_model_meta(model, cache)
    window = _sliding_window(model, meta.architecture)
    ctx_tokens = 320 if window is None else window + 128
    points = meta.split_points or tuple(range(meta.n_layers + 1))
    half = min(points[1:-1] or [meta.n_layers], key=lambda p: abs(p - meta.n_layers / 2))
    if half == meta.n_layers:
        raise SystemExit(f"{model.name} can only be served whole: there is no split to measure")
    bounds = (0, half, meta.n_layers)
    vocab = Vocabulary(model)
    n_tokens, reps, steps = (32, 1, 8) if args.quick else (128, 5, 32)
    print(
        f"{meta.name} ({meta.architecture}, {meta.n_layers} layers, split {bounds}, "
        f"batching context {ctx_tokens} tokens{'' if window is None else f', sliding window {window}'})",
        flush=True,
    )
    print(f"split overhead ({args.threads} thread(s), {n_tokens} tokens x {reps} runs, medians):", flush=True)
    split = bench_split(model, cache, vocab, args.threads, n_tokens, reps, bounds)
    for kind in ("cpu_tok_s", "wall_tok_s"):
        f = split[kind]
        print(
            f"  [{kind}] whole model {f['whole']:.1f} | "
            f"2-stage split, C callback {f['split_c_callback']:.1f} "
            f"(ratio {f['ratio_split_c_to_whole']:.3f}) | Python callback {f['split_python_callback']:.1f} "
            f"(ratio {f['ratio_split_python_to_whole']:.3f})",
            flush=True,
        )
    print(f"  same tokens in every run: {split['same_tokens_all_runs']}", flush=True)
    print(
        f"batching ({args.threads} thread(s), {steps * 2} decode steps per setup, interleaved):", flush=True
    )
    batching = bench_batching(model, cache, vocab, args.threads, [1, 4, 8, 16], ctx_tokens, steps, 2, bounds)
    result = {
        "benchmark": "engine",
        "model": model.name,
        "architecture": meta.architecture,
        "sliding_window": window,
        "context_tokens": ctx_tokens,
        "split": split,
        "batching": batching,
        "unix_time": time.time(),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {out_path}")
    if args.fail_below is not None:
        ratios = [split["cpu_tok_s"]["ratio_split_c_to_whole"]] + [
            r["ratio_engine_to_best_raw_cpu"] for r in batching
        ]
        if min(ratios) < args.fail_below:
            raise SystemExit(f"a ratio ({min(ratios):.3f}) is below --fail-below {args.fail_below}")


if __name__ == "__main__":
    main()
