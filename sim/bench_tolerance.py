"""Calibrating the cross-recipe tolerance of spot checks on real outputs of two kernel paths.

    python -m sim.bench_tolerance [--model smollm2|gemma3|FILE] [--prompts 16] [--new 32] [--out FILE]

Two honest nodes on different llama.cpp builds or CPU feature levels run other
kernels for the same arithmetic and may differ in low-order bits. Across
recipes the gateway's checks once compared only the sampled token (and its
end-of-generation flag); this measures that rule's false-positive rate: how
often two honest computations pick another greedy token. (The gateway now
compares with the calibrated ``gateway.checks.Tolerance``; sim/bench_cross_recipe.py
calibrates it on two real builds.)

This measures it on real outputs with the one second kernel path this machine
has without a second build: the same token sequence evaluated in one batch of
up to 512 rows (the matrix-matrix kernels, repacked weights) and one token at
a time (the matrix-vector kernels) -- as a build with other kernels would. For
each prompt: the reference's greedy continuation of ``--new`` tokens, then both
paths' logits at every position of it. Reported: the share of positions whose
argmax differs (per-token false-positive rate), the share of requests with any
such position (per-request rate), the largest absolute and relative logit
difference, and the smallest top-1/top-2 logit gap seen. Writes JSON with
``--out``. One thread, deterministic.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from node.testmodel import gemma3_model_path, test_model_path

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Write one sentence about the sea.",
    "What is two plus two?",
    "Who wrote Hamlet?",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
    "Explain what a transformer layer computes.",
    "List the planets of the solar system.",
    "Translate 'good morning' into German.",
    "What is the boiling point of water?",
    "Describe a cat in one line.",
    "How many legs does a spider have?",
    "What is a prime number?",
    "Tell me a fact about the moon.",
]


def _model(name: str) -> Path:
    if name == "smollm2":
        return test_model_path()
    if name == "gemma3":
        return gemma3_model_path()
    return Path(name)


def _llm(path: Path, n_batch: int) -> llama_cpp.Llama:
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=1024,
        n_batch=n_batch,
        n_ubatch=n_batch,
        n_threads=1,
        n_threads_batch=1,
        logits_all=True,
        flash_attn=True,
        verbose=False,
    )


def _logits(llm: llama_cpp.Llama, tokens: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


NOISE_REL = (1e-6, 1e-5, 1e-4, 1e-3)  # simulated builds: logit error relative to the row's largest


def measure(path: Path, n_prompts: int, n_new: int, seed: int = 0) -> dict[str, Any]:
    batched, single = _llm(path, 512), _llm(path, 1)
    rng = np.random.default_rng(seed)
    positions = flips = flipped_requests = 0
    noise_flips = dict.fromkeys(NOISE_REL, 0)
    noise_requests = dict.fromkeys(NOISE_REL, 0)
    max_abs = max_rel = 0.0
    min_gap = float("inf")
    t0 = time.perf_counter()
    try:
        for prompt in PROMPTS[:n_prompts]:
            prompt_tokens = batched.tokenize(prompt.encode(), add_bos=True)
            batched.reset()
            continuation: list[int] = []
            for token in batched.generate(prompt_tokens, temp=0.0, repeat_penalty=1.0):
                if batched.token_eos() == token or len(continuation) >= n_new:
                    break
                continuation.append(int(token))
            tokens = list(prompt_tokens) + list(continuation)
            a, b = _logits(batched, tokens), _logits(single, tokens)
            # The positions whose logits choose a generated token (the last prompt position onwards).
            rows = range(len(prompt_tokens) - 1, len(tokens) - 1)
            any_flip = False
            noisy_request = dict.fromkeys(NOISE_REL, False)
            for i in rows:
                scale = float(np.abs(a[i]).max())
                for rel in NOISE_REL:  # the same outputs as a build off by `rel` would give them
                    noisy = a[i] + rng.normal(0.0, rel * scale, a[i].shape).astype(np.float32)
                    if int(np.argmax(noisy)) != int(np.argmax(a[i])):
                        noise_flips[rel] += 1
                        noisy_request[rel] = True
                positions += 1
                top2 = np.argsort(a[i])[-2:]
                min_gap = min(min_gap, float(a[i][top2[1]] - a[i][top2[0]]))
                if int(np.argmax(a[i])) != int(np.argmax(b[i])):
                    flips += 1
                    any_flip = True
                diff = np.abs(a[i] - b[i])
                max_abs = max(max_abs, float(diff.max()))
                max_rel = max(max_rel, float(diff.max() / max(1e-9, float(np.abs(a[i]).max()))))
            flipped_requests += int(any_flip)
            for rel in NOISE_REL:
                noise_requests[rel] += int(noisy_request[rel])
    finally:
        batched.close()
        single.close()
    return {
        "model": path.name,
        "requests": n_prompts,
        "positions": positions,
        "argmax_flips": flips,
        "per_token_false_positive_rate": flips / positions if positions else 0.0,
        "per_request_false_positive_rate": flipped_requests / n_prompts if n_prompts else 0.0,
        "max_abs_logit_diff": max_abs,
        "max_rel_logit_diff": max_rel,
        "min_top1_top2_gap": min_gap,
        "simulated_builds": [
            {
                "noise_rel": rel,
                "per_token_false_positive_rate": noise_flips[rel] / positions if positions else 0.0,
                "per_request_false_positive_rate": noise_requests[rel] / n_prompts if n_prompts else 0.0,
            }
            for rel in NOISE_REL
        ],
        "seconds": round(time.perf_counter() - t0, 2),
        "paths": "n_batch=n_ubatch=512 (one batch) vs 1 (one token at a time); one thread; flash attn",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = measure(_model(args.model), min(args.prompts, len(PROMPTS)), args.new)
    print(
        f"{'model':<36} {'positions':>9} {'flips':>5} {'FPR/token':>10} {'FPR/request':>11} "
        f"{'max |dlogit|':>12} {'max rel':>9} {'min gap':>8}"
    )
    print(
        f"{result['model']:<36} {result['positions']:>9} {result['argmax_flips']:>5} "
        f"{result['per_token_false_positive_rate']:>10.4f} "
        f"{result['per_request_false_positive_rate']:>11.3f} "
        f"{result['max_abs_logit_diff']:>12.2e} {result['max_rel_logit_diff']:>9.2e} "
        f"{result['min_top1_top2_gap']:>8.4f}"
    )
    for sim in result["simulated_builds"]:
        print(
            f"  simulated build, logits off by {sim['noise_rel']:.0e} of the row's largest: "
            f"FPR/token {sim['per_token_false_positive_rate']:.4f}, "
            f"FPR/request {sim['per_request_false_positive_rate']:.3f}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
