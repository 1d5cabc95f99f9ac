"""Sparse per-sequence KV streams (node/kvsparse.py) beside today's per-sequence layout, raw llama.cpp.

    python -m sim.bench_kvsparse [--sessions 4] [--context 512] [--steps 17] [--out docs/perf/kvsparse.json]

Today's: 8 streams x 2048 (16,384 positions, all resident). Sparse: 16 streams x
the model's trained context (virtual), pages only where sessions wrote. Reports
decode tok/s (CPU time of the computing thread) of both, whether every session's
greedy tokens are the same in both, and the process RSS: before the context, its
peak while llama.cpp clears the buffer, after creation, after the prefills, and
after one session's release (its stream's pages dropped). One run; figures only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import llama_cpp

from node import kvsparse
from node.llama_runtime import load_model, new_context
from node.testmodel import test_model_path
from sim.bench_kvpool import _Ctx, _prompts, _settings

MIB = 1 << 20


def _geometry(model: Any, kv_size: int, n_stream: int) -> kvsparse.KvGeometry:
    n_layer = llama_cpp.llama_model_n_layer(model)
    n_head = llama_cpp.llama_model_n_head(model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(model)
    head = llama_cpp.llama_model_n_embd(model) // n_head
    row = n_head_kv * head * 2  # f16
    return kvsparse.KvGeometry(n_layer, row, row, kv_size, n_stream)


def _decode(c: _Ctx, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], float]:
    toks = [[c.prefill(s, p)] for s, p in enumerate(prompts)]
    n = len(prompts)
    cpu = 0.0
    for k in range(steps - 1):
        c0 = time.thread_time()
        c.decode(list(range(n)), [len(p) + k for p in prompts], [t[-1] for t in toks], [True] * n)
        for s in range(n):
            toks[s].append(c.argmax(s))
        cpu += time.thread_time() - c0
    return toks, n * (steps - 1) / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=17)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = load_model(test_model_path())
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    prompts = _prompts(args.sessions, args.context, n_vocab)
    today = _Ctx(model, _settings(16384, max(8, args.sessions), False))  # 16 x 1024 at 16
    today_toks, today_rate = _decode(today, prompts, args.steps)
    today.close()

    ctx_train = int(llama_cpp.llama_model_n_ctx_train(model))
    geo = _geometry(model, ctx_train, args.streams)
    settings = _settings(ctx_train * args.streams, args.streams, False)
    rss0, _ = kvsparse.rss_bytes()
    kvsparse.reset_peak()
    holder: dict[str, Any] = {}

    def make() -> object:
        holder["ctx"] = new_context(model, settings)
        return holder["ctx"]

    _, buf = kvsparse.create_sparse(make, geo)
    rss1, peak = kvsparse.rss_bytes()
    c = _Ctx.__new__(_Ctx)
    c.ctx = holder["ctx"]
    c.mem = llama_cpp.llama_get_memory(c.ctx)
    c.n_vocab = n_vocab
    from node.llama_runtime import BatchBuffer

    c.batch = BatchBuffer(settings.n_batch, 0)
    c.batch.use_embeddings(False)
    sparse_toks, sparse_rate = _decode(c, prompts, args.steps)
    rss2, _ = kvsparse.rss_bytes()
    llama_cpp.llama_memory_seq_rm(c.mem, 0, -1, -1)
    dropped = buf.drop_stream(0) if buf is not None else 0
    rss3, _ = kvsparse.rss_bytes()
    c.close()
    result = {
        "model": test_model_path().name,
        "sessions": args.sessions,
        "context_tokens": args.context,
        "decode_steps": args.steps,
        "sparse_streams": args.streams,
        "stream_cells": ctx_train,
        "virtual_kv_mib": round(geo.buffer_bytes / MIB, 1),
        "buffer_found": buf is not None,
        "today_cpu_tok_s": round(today_rate, 1),
        "sparse_cpu_tok_s": round(sparse_rate, 1),
        "sparse_over_today": round(sparse_rate / today_rate, 3),
        "tokens_identical": sparse_toks == today_toks,
        "rss_before_context_mib": round(rss0 / MIB, 1),
        "rss_peak_during_creation_mib": round(peak / MIB, 1),
        "rss_after_creation_mib": round(rss1 / MIB, 1),
        "rss_after_prefill_mib": round(rss2 / MIB, 1),
        "rss_after_release_of_one_mib": round(rss3 / MIB, 1),
        "kv_bytes_written_mib": round(
            args.sessions * (args.context + args.steps) * geo.bytes_per_position / MIB, 1
        ),
        "dropped_on_release_mib": round(dropped / MIB, 1),
    }
    for k, v in result.items():
        print(f"{k:32s} {v}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
