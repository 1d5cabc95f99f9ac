"""KV layouts for the node's pool: aggregate decode speed at equal KV memory, and exactness.

    python -m sim.bench_kvpool [--model FILE] [--out docs/perf/kvpool-layouts.json] [--quick]
        [--layouts per_seq,sparse,unified,contexts] [--rounds 3]

Raw llama.cpp (the whole model, token ids in, one thread, flash attention on,
f16 KV -- the node's recipe), N concurrent sessions (1, 4, 8, 16) each holding
a context of ``--context`` tokens (prefilled once per layout), then decoding
``--steps`` greedy tokens per session, all sessions in one batch per step, and
cutting them off again for the next round. The KV memory is the same for
every layout: ``--pool`` positions (default 16384 = today's 8 x 2048).

Layouts:

* ``per_seq``: today's layout -- ``kv_unified = false``, the pool divided evenly
  among ``max(8, N)`` sequence streams, all allocated up front.
* ``sparse``: the pool's layout on the node (node/kvlayout.py) -- per-sequence
  streams, ``--streams`` of them (the node's 32 sessions), each as long as the
  model's trained context (8,192 for SmolLM2), a virtual buffer whose pages are
  resident only where sessions wrote (node/kvsparse.py): the same resident
  memory as ``per_seq`` for the same sessions.
* ``unified``: one stream of ``--pool`` cells shared by up to 64 sequences
  (``kv_unified = true``); a sequence takes cells as it grows. Each token's
  attention spans every used cell, masked; ggml's CPU flash-attention kernel
  skips the masked (-inf) cells.
* ``contexts``: one context per session over the one loaded model (weights
  shared), each sized to its session; one ``llama_decode`` per session per step.

The layouts run interleaved, ``--rounds`` times each; medians are reported.
Exactness: every session's greedy tokens in the shared layouts are compared
with the ``contexts`` layout, where each prompt runs alone in a fresh
one-sequence context (what the parity reference does), or with ``per_seq``
when ``contexts`` is not run. CPU time of the
calling thread is the reported figure (with one llama.cpp thread the compute
runs on it; a neighbour's load cannot inflate it); wall time beside. Figures,
not assertions.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from node import kvsparse
from node.llama_runtime import BatchBuffer, ContextSettings, free_model, load_model, new_context
from node.testmodel import test_model_path

SESSION_COUNTS = (1, 4, 8, 16)


def _prompts(n: int, ctx_tokens: int, n_vocab: int, seed: int = 7) -> list[list[int]]:
    """Distinct token contexts: seeded ids from the ordinary part of the vocabulary."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, min(n_vocab, 30000), size=ctx_tokens).astype(int).tolist() for _ in range(n)]


class _Ctx:
    """One llama.cpp context with a batch buffer; greedy decode of several sequences in lock-step."""

    def __init__(self, model: ctypes.c_void_p, settings: ContextSettings, sparse_streams: int = 0) -> None:
        if sparse_streams:
            geometry = _geometry(model, settings.n_ctx // sparse_streams, sparse_streams)
            made: list[ctypes.c_void_p] = []
            _, buf = kvsparse.create_sparse(lambda: made.append(new_context(model, settings)), geometry)
            if buf is None:
                llama_cpp.llama_free(made[0])
                raise RuntimeError("the sparse KV buffer was not found")
            self.ctx = made[0]
        else:
            self.ctx = new_context(model, settings)
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch = BatchBuffer(settings.n_batch, 0)
        self.batch.use_embeddings(False)

    def decode(self, seqs: list[int], pos: list[int], toks: list[int], outs: list[bool]) -> None:
        b = self.batch
        n = len(toks)
        b.token[:n], b.pos[:n], b.seq[:n], b.logits[:n] = toks, pos, seqs, outs
        b.batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, b.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")

    def argmax(self, row: int) -> int:
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, row)
        arr = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
        return int(np.argmax(arr))

    def prefill(self, seq: int, tokens: list[int]) -> int:
        cap = self.batch.capacity
        for off in range(0, len(tokens), cap):
            chunk = tokens[off : off + cap]
            outs = [False] * len(chunk)
            outs[-1] = off + len(chunk) == len(tokens)
            self.decode([seq] * len(chunk), list(range(off, off + len(chunk))), chunk, outs)
        return self.argmax(len(tokens) - 1 - (len(tokens) - 1) // cap * cap)

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)


def _settings(n_ctx: int, n_seq_max: int, unified: bool) -> ContextSettings:
    return ContextSettings(n_threads=1, n_seq_max=n_seq_max, n_ctx=n_ctx, kv_unified=unified)


def _geometry(model: ctypes.c_void_p, kv_size: int, n_stream: int) -> kvsparse.KvGeometry:
    n_head = llama_cpp.llama_model_n_head(model)
    head = llama_cpp.llama_model_n_embd(model) // n_head
    row = llama_cpp.llama_model_n_head_kv(model) * head * 2  # f16
    return kvsparse.KvGeometry(llama_cpp.llama_model_n_layer(model), row, row, kv_size, n_stream)


class _Shared:
    """Every session a sequence of one context, its prompt in the KV (prefilled once); each round
    decodes ``steps`` greedy tokens of all sessions, one batch per step, then cuts them off again."""

    def __init__(
        self,
        model: ctypes.c_void_p,
        settings: ContextSettings,
        prompts: list[list[int]],
        sparse_streams: int = 0,
    ) -> None:
        self.c = _Ctx(model, settings, sparse_streams)
        self.prompts = prompts
        self.first = [self.c.prefill(s, p) for s, p in enumerate(prompts)]

    def round(self, steps: int) -> dict[str, Any]:
        c, prompts, n = self.c, self.prompts, len(self.prompts)
        toks = [[t] for t in self.first]
        wall = cpu = 0.0
        for k in range(steps - 1):
            w0, c0 = time.perf_counter(), time.thread_time()
            c.decode(list(range(n)), [len(p) + k for p in prompts], [t[-1] for t in toks], [True] * n)
            for s in range(n):
                toks[s].append(c.argmax(s))
            wall += time.perf_counter() - w0
            cpu += time.thread_time() - c0
        for s, p in enumerate(prompts):
            llama_cpp.llama_memory_seq_rm(c.mem, s, len(p), -1)
        return {"tokens": toks, "wall_s": wall, "cpu_s": cpu}

    def close(self) -> None:
        self.c.close()


class _Contexts:
    """One context per session (weights shared), prompts prefilled once; one decode per session per step."""

    def __init__(self, model: ctypes.c_void_p, prompts: list[list[int]], steps: int) -> None:
        self.ctxs = [_Ctx(model, _settings(-(-(len(p) + steps) // 256) * 256, 1, False)) for p in prompts]
        self.prompts = prompts
        self.first = [c.prefill(0, p) for c, p in zip(self.ctxs, prompts, strict=True)]

    def round(self, steps: int) -> dict[str, Any]:
        toks = [[t] for t in self.first]
        wall = cpu = 0.0
        for k in range(steps - 1):
            w0, c0 = time.perf_counter(), time.thread_time()
            for s, c in enumerate(self.ctxs):
                c.decode([0], [len(self.prompts[s]) + k], [toks[s][-1]], [True])
                toks[s].append(c.argmax(0))
            wall += time.perf_counter() - w0
            cpu += time.thread_time() - c0
        for c, p in zip(self.ctxs, self.prompts, strict=True):
            llama_cpp.llama_memory_seq_rm(c.mem, 0, len(p), -1)
        return {"tokens": toks, "wall_s": wall, "cpu_s": cpu}

    def close(self) -> None:
        for c in self.ctxs:
            c.close()


def bench(
    model_path: Path,
    *,
    pool: int,
    context: int,
    steps: int,
    rounds: int,
    counts: tuple[int, ...] = SESSION_COUNTS,
    names: tuple[str, ...] = ("per_seq", "sparse"),
    streams: int = 32,
) -> dict[str, Any]:
    model = load_model(model_path)
    try:
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        ctx_train = int(llama_cpp.llama_model_n_ctx_train(model))
        all_prompts = _prompts(max(counts), context, n_vocab)
        rows = []
        for n in counts:
            if n * (context + steps) > pool:
                continue
            prompts = all_prompts[:n]
            every: dict[str, Callable[[], _Shared | _Contexts]] = {
                "per_seq": functools.partial(_Shared, model, _settings(pool, max(8, n), False), prompts),
                "sparse": functools.partial(
                    _Shared, model, _settings(ctx_train * streams, streams, False), prompts, streams
                ),
                "unified": functools.partial(_Shared, model, _settings(pool, 64, True), prompts),
                "contexts": functools.partial(_Contexts, model, prompts, steps),
            }
            layouts = {k: every[k]() for k in names}  # every prompt prefilled once per layout
            samples: dict[str, list[float]] = {k: [] for k in layouts}
            walls: dict[str, list[float]] = {k: [] for k in layouts}
            exact: dict[str, bool] = {}
            for r in range(rounds):
                # Interleaved, the order reversed every other round (neither layout always runs first).
                order = list(layouts) if r % 2 == 0 else list(reversed(layouts))
                outs = {name: layouts[name].round(steps) for name in order}
                # every session alone in its own context, else today's layout
                solo = outs["contexts" if "contexts" in outs else "per_seq"]["tokens"]
                for name, out in outs.items():
                    decoded = n * (steps - 1)
                    samples[name].append(decoded / out["cpu_s"])
                    walls[name].append(decoded / out["wall_s"])
                    exact[name] = exact.get(name, True) and out["tokens"] == solo
            row: dict[str, Any] = {"sessions": n, "context_tokens": context}
            for name in layouts:
                row[f"{name}_cpu_tok_s"] = round(statistics.median(samples[name]), 1)
                row[f"{name}_wall_tok_s"] = round(statistics.median(walls[name]), 1)
                row[f"{name}_exact"] = exact[name]
            for name in layouts:
                if name != "per_seq":
                    row[f"{name}_over_per_seq"] = round(
                        row[f"{name}_cpu_tok_s"] / row["per_seq_cpu_tok_s"], 3
                    )
                    # the ratio in each round (the layouts ran back to back), for the spread
                    row[f"{name}_over_per_seq_rounds"] = [
                        round(a / b, 3) for a, b in zip(samples[name], samples["per_seq"], strict=True)
                    ]
            rows.append(row)
            for obj in layouts.values():
                obj.close()
            print(
                f"{n:3d} sessions x {context}: per_seq {row['per_seq_cpu_tok_s']:7.1f}  "
                + "  ".join(
                    f"{name} {row[f'{name}_cpu_tok_s']:7.1f} ({row[f'{name}_over_per_seq']:.3f})"
                    for name in layouts
                    if name != "per_seq"
                )
                + "  exact: "
                + "/".join(str(row[f"{name}_exact"]) for name in layouts),
                flush=True,
            )
        return {
            "model": model_path.name,
            "pool_tokens": pool,
            "decode_steps": steps,
            "rounds": rounds,
            "layouts": list(names),
            "sparse_streams": streams,
            "threads": 1,
            "flash_attention": True,
            "kv_type": "f16",
            "rows": rows,
        }
    finally:
        free_model(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--pool", type=int, default=16384, help="KV positions of every layout")
    ap.add_argument("--context", type=int, default=960, help="context tokens per session")
    ap.add_argument("--steps", type=int, default=33, help="greedy tokens per session")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default="per_seq,sparse", help="of per_seq,sparse,unified,contexts")
    ap.add_argument("--streams", type=int, default=32, help="sparse streams (the node's sessions)")
    ap.add_argument("--quick", action="store_true", help="17 steps, 512-token contexts")
    ap.add_argument("--sessions", default="1,4,8,16", help="session counts, comma-separated")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.context = 17, 512
    result = bench(
        args.model or test_model_path(),
        pool=args.pool,
        context=args.context,
        steps=args.steps,
        rounds=args.rounds,
        counts=tuple(int(x) for x in args.sessions.split(",")),
        names=tuple(args.layouts.split(",")),
        streams=args.streams,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
