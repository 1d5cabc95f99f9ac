"""Does llama.cpp give a position computed inside a (k+1)-token batch the same logits as one token at a time?

The question speculative verification depends on (issue 24): a verify step carries the last token plus k
drafted tokens as one piece, and greedy output stays identical to plain decoding only if every position's
logits are bit-identical to those of a one-token decode. Whole model, the engine's context settings (flash
attention on, n_batch = n_ubatch = 512, 1 thread). Greedy-decodes ``n_gen`` tokens one at a time, then
re-evaluates them in windows of k+1 tokens and prints, per window size, the largest logit difference.

    .venv/bin/python -m sim.spec_exactness [smol] [gemma] [qwen] [--out docs/perf/spec_exactness.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import numpy as np

from node import testmodel

PROMPT = (
    b"def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\n"
    b"Rewrite the code above with type hints.\n"
)


def check(path: Path, k_max: int = 8, n_gen: int = 24) -> dict[int, dict[str, float | bool]]:
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=512,
        n_batch=512,
        n_ubatch=512,
        n_threads=1,
        flash_attn=True,
        logits_all=True,
        verbose=False,
    )
    mem = llama_cpp.llama_get_memory(llm.ctx)
    prompt = llm.tokenize(PROMPT, add_bos=True)

    def truncate(n: int) -> None:
        llama_cpp.llama_memory_seq_rm(mem, 0, n, -1)
        llm.n_tokens = n

    llm.eval(prompt)
    n_prompt = len(prompt)
    seq: list[int] = []
    single: list[np.ndarray] = []
    nxt = int(np.argmax(llm.scores[n_prompt - 1]))
    for _ in range(n_gen):
        seq.append(nxt)
        llm.eval([nxt])
        row = np.array(llm.scores[llm.n_tokens - 1], copy=True)
        single.append(row)
        nxt = int(np.argmax(row))
    out: dict[int, dict[str, float | bool]] = {}
    for k in range(1, k_max + 1):
        max_diff = 0.0
        same_argmax = True
        for start in range(0, n_gen - k - 1, k + 1):
            truncate(n_prompt + start)
            llm.eval(seq[start : start + k + 1])
            for j in range(k + 1):
                batched = llm.scores[n_prompt + start + j]
                max_diff = max(max_diff, float(np.max(np.abs(batched - single[start + j]))))
                same_argmax &= int(np.argmax(batched)) == int(np.argmax(single[start + j]))
        out[k + 1] = {"max_abs_logit_diff": max_diff, "same_argmax": same_argmax}
    return out


def main() -> None:
    models: dict[str, Callable[[], Path]] = {
        "smol": testmodel.test_model_path,
        "gemma": testmodel.gemma3_model_path,
        "qwen": testmodel.qwen_coder_model_path,
    }
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="*", default=["smol", "gemma"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {}
    for name in args.models:
        results[name] = check(models[name]())
        cells = ", ".join(f"{b}: {r['max_abs_logit_diff']:.3g}" for b, r in results[name].items())
        print(f"{name:6s} window size -> max |logit diff|: {cells}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
