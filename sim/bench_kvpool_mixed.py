"""Mixed load at equal KV memory: the KV pool against today's per-sequence slots (engine level).

    python -m sim.bench_kvpool_mixed [--requests 32] [--sessions 32] [--layout auto] [--admit fifo|fit|short]
        [--out docs/perf/kvpool-mixed-sparse.json]

``--requests`` requests with prompts of 100 to 6,000 tokens (log-uniform,
seeded; natural text) each generate ``--new`` greedy tokens through one
engine holding the whole model (one thread, flash attention, f16 KV), in two
layouts of the same KV memory (16,384 positions):

``--scale k`` divides the prompt lengths, the slots and the pool by ``k``: a
cheaper run of the same shape (concurrency depends on the ratios only).

* ``per_seq``: today's 8 slots of 2,048 positions. A request whose prompt plus
  generation passes 2,048 is refused (what the gateway answers today).
* ``pool``: one pool of 16,384 positions in ``--layout`` (node.kvlayout;
  auto = sparse per-sequence streams here), sessions up to the model's 8,192.
  A request is started when the pool's free blocks hold its prompt plus
  generation (admission by KV; nothing is reserved in the engine) and at most
  ``--sessions`` sessions run.

Requests arrive all at once and start first come, first served (``--admit
fifo``: the head of the queue waits for room and everyone behind it) or, with
``--admit fit``, any waiting request whose KV fits starts (in arrival order), or, with
``--admit short``, the shortest waiting prompt first (the head of that order waits);
each step batches every running session's next piece (prefill chunks of 256,
decode steps). Reported: requests completed and refused, the most sessions
running at once, the mean over steps, wall time, and how many completions are
identical to the same request alone in a fresh one-sequence context.
Figures, not assertions.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.vocab import Vocabulary
from node.engine import EngineConfig, ShardEngine, Work
from node.kvpool import blocks_for
from node.llama_runtime import ContextSettings
from node.reference import ReferenceModel
from node.shard import extract_shard
from node.testmodel import test_model_path

TEXT = (
    "The harbour town kept its records in a tall stone building by the quay. Every ship that came in was "
    "written down: its name, its captain, the goods it carried and the day it left again. "
    "Merchants came by river and by road, and the market grew into a town, and the town into a city. "
)
CHUNK = 256


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    done_prefill: int = 0
    out: list[int] = field(default_factory=list)


def _requests(vocab: Vocabulary, n: int, seed: int, scale: int = 1) -> list[list[int]]:
    base = vocab.tokenize(TEXT * 200)
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(100 / scale), np.log(6000 / scale), size=n)).astype(int)
    out = []
    for i, length in enumerate(lengths):
        off = (i * 37) % 50
        out.append(vocab.tokenize(f"Request {i}. ")[:8] + base[off : off + int(length) - 8])
    return out


def _run(
    engine: ShardEngine, prompts: list[list[int]], n_new: int, pool: bool, admit: str = "fifo"
) -> dict[str, Any]:
    limit = engine.session_kv_limit
    waiting = [_Req(i, p) for i, p in enumerate(prompts)]
    refused = [r.rid for r in waiting if len(r.prompt) + n_new > limit]
    waiting = [r for r in waiting if r.rid not in refused]
    running: list[_Req] = []
    done: dict[int, list[int]] = {}
    peak, samples, steps = 0, [], 0
    reserved = 0  # admission's view: blocks the running requests will need at their end
    t0 = time.perf_counter()
    while waiting or running:
        order = sorted(waiting, key=lambda r: (len(r.prompt), r.rid)) if admit == "short" else list(waiting)
        for r in order:
            need = blocks_for(len(r.prompt) + n_new)
            if len(running) >= engine.config.max_sessions:
                break
            if pool:
                assert engine.pool is not None
                if reserved + need > engine.pool.total_blocks:
                    if admit in ("fifo", "short"):
                        break  # the head of the order waits, and everyone behind it
                    continue  # "fit": a later request that fits starts now
            waiting.remove(r)
            engine.open_session(f"r{r.rid}")
            reserved += need
            running.append(r)
        peak = max(peak, len(running))
        samples.append(len(running))
        works = []
        for r in running:
            if r.done_prefill < len(r.prompt):
                piece = r.prompt[r.done_prefill : r.done_prefill + CHUNK]
                last = r.done_prefill + len(piece) == len(r.prompt)
                works.append(
                    Work(f"r{r.rid}", r.done_prefill, tokens=np.array(piece, dtype=np.int32), sample=last)
                )
            else:
                works.append(
                    Work(
                        f"r{r.rid}",
                        len(r.prompt) + len(r.out) - 1,
                        tokens=np.array([r.out[-1]], dtype=np.int32),
                        sample=True,
                    )
                )
        results = engine.step(works)
        steps += 1
        for r, res in zip(list(running), results, strict=True):
            if res.error is not None:
                raise RuntimeError(f"request {r.rid}: {res.error}")
            if r.done_prefill < len(r.prompt):
                r.done_prefill += res.n_tokens
                if r.done_prefill < len(r.prompt):
                    continue
            assert res.sampled is not None
            r.out.append(res.sampled.token_id)
            if len(r.out) >= n_new:
                engine.release(f"r{r.rid}")
                reserved -= blocks_for(len(r.prompt) + n_new)
                done[r.rid] = r.out
                running.remove(r)
    stats = engine.statistics()
    return {
        "completed": len(done),
        "refused": len(refused),
        "peak_sessions": peak,
        "mean_sessions": round(float(np.mean(samples)), 2) if samples else 0.0,
        "steps": steps,
        "wall_s": round(time.perf_counter() - t0, 1),
        "pool_used_blocks_after": stats.kv_pool.used_blocks if stats.kv_pool is not None else None,
        "compactions": stats.kv_pool_compactions,
        "outputs": done,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new", type=int, default=16, help="greedy tokens per request")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument(
        "--scale",
        type=int,
        default=1,
        help="divide prompt lengths, slots and pool by this (a cheaper run of the same shape)",
    )
    ap.add_argument("--sessions", type=int, default=32, help="the pool's most sessions (sequence streams)")
    ap.add_argument("--layout", default="auto", help="the pool's layout (node.kvlayout): auto, unified ...")
    ap.add_argument(
        "--admit",
        default="fifo",
        choices=["fifo", "fit", "short"],
        help="fit: later requests that fit start first; short: shortest prompt first",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = test_model_path()
    cache = Path(tempfile.mkdtemp(prefix="bench-kvpool-"))
    files = extract_shard(model, 0, 30, cache)
    with Vocabulary(model) as vocab:
        prompts = _requests(vocab, args.requests, args.seed, args.scale)
    layouts = {
        "per_seq": EngineConfig(
            threads=1, max_sessions=8, session_kv_tokens=2048 // args.scale, batch_tokens=512
        ),
        "pool": EngineConfig(
            threads=1,
            max_sessions=args.sessions,
            session_kv_tokens=1 << 30,
            batch_tokens=512,
            kv_pool_tokens=16384 // args.scale,
            kv_pool_layout=args.layout,
        ),
    }
    result: dict[str, Any] = {
        "model": model.name,
        "requests": args.requests,
        "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": args.new,
        "kv_positions": 16384 // args.scale,
        "scale": args.scale,
        "pool_sessions": args.sessions,
        "admit": args.admit,
    }
    outputs: dict[str, dict[int, list[int]]] = {}
    for name, cfg in layouts.items():
        with ShardEngine(files, cfg, cache) as engine:
            row = _run(engine, prompts, args.new, pool=cfg.kv_pool_tokens > 0, admit=args.admit)
            row["layout"] = engine.layout_name
        outputs[name] = row.pop("outputs")
        result[name] = row
        print(f"{name:8s} {row}", flush=True)
    with ReferenceModel(model, ContextSettings(n_threads=1, n_seq_max=1, n_ctx=8192, n_batch=512)) as ref:
        alone = {}
        for i, p in enumerate(prompts):
            ref.clear()
            alone[i] = ref.greedy(p, args.new)[0]
    for name, got in outputs.items():
        result[name]["identical_to_alone"] = sum(got[i] == alone[i] for i in got)
        print(f"{name:8s} identical to alone: {result[name]['identical_to_alone']} of {len(got)}")
    result["peak_sessions_pool_over_per_seq"] = round(
        result["pool"]["peak_sessions"] / max(1, result["per_seq"]["peak_sessions"]), 2
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
