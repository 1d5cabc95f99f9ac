"""Cost per token of constrained sampling (a JSON schema, llguidance) vs free sampling, on the last stage.

``python -m sim.bench_constrained [--model smollm2|gemma3] [--tokens 48] [--out FILE.json]``

A whole-model engine (one llama.cpp thread, the nodes' context settings) decodes
the same prompts twice, token by token as the last stage does (engine step
with sampling): free (greedy) and constrained by a JSON schema (greedy, the
grammar's mask applied each step; llguidance's matcher advanced by the
history). Both runs go through exactly the same code path except the
constraint, so the difference is its cost: the mask computation, the closing
check near the budget's end, and applying the mask. Reported: decode ms/token
of each, the ratio (goal: at most 1.10), and the constraint's own time per
token measured around :meth:`GrammarConstraint.allowed`. Runs alternate
(free, constrained, free, ...) so machine noise hits both. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llguidance
import numpy as np

from common.vocab import Vocabulary
from node.engine import EngineConfig, ShardEngine, Work
from node.sampling import SamplingParams
from node.shard import extract_shard, read_model_meta
from node.testmodel import gemma3_model_path, test_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
QUESTIONS = [
    "Describe a person as JSON.",
    "Invent a character and give their details in JSON.",
    "Who is your favourite author? Answer in JSON.",
]


def prompt_ids(vocab: Vocabulary, question: str, arch: str) -> list[int]:
    if arch.startswith("gemma"):
        text = f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"
        return vocab.tokenize(text, add_special=True, parse_special=True)
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return vocab.tokenize(text, add_special=False, parse_special=True)


def decode(
    engine: ShardEngine, sid: str, prompt: list[int], params: SamplingParams, n: int
) -> dict[str, Any]:
    """Prefill, then up to ``n`` decode steps; the time of each decode step (compute + sampling)."""
    engine.open_session(sid, sampling=params, kv_budget=len(prompt) + n)
    constraint = engine._sessions[sid].constraint  # noqa: SLF001 - the bench times the constraint itself
    mask_s: list[float] = []
    if constraint is not None:
        inner = constraint.allowed

        def timed(completion: Any, remaining: Any = None) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(completion, remaining)
            finally:
                mask_s.append(time.perf_counter() - t0)

        constraint.allowed = timed  # type: ignore[method-assign]
    history = list(prompt)
    (r,) = engine.step(
        [
            Work(
                sid,
                0,
                tokens=np.asarray(prompt, np.int32),
                sample=True,
                history=np.asarray(history, np.int32),
            )
        ]
    )
    assert r.sampled is not None
    steps: list[float] = []
    token = r.sampled.token_id
    while len(steps) < n - 1 and not engine.is_eog(token):
        history.append(token)
        t0 = time.perf_counter()
        (r,) = engine.step(
            [
                Work(
                    sid,
                    len(history) - 1,
                    tokens=np.asarray([token], np.int32),
                    sample=True,
                    history=np.asarray(history, np.int32),
                )
            ]
        )
        steps.append(time.perf_counter() - t0)
        assert r.sampled is not None
        token = r.sampled.token_id
    engine.release(sid)
    text_tokens = history[len(prompt) :]
    return {"step_s": steps, "mask_s": mask_s, "tokens": text_tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="default bench-results/constrained-<model>.json")
    args = ap.parse_args(argv)
    path = test_model_path() if args.model == "smollm2" else gemma3_model_path()
    out = args.out or Path(f"bench-results/constrained-{args.model}.json")
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    )
    with tempfile.TemporaryDirectory() as cache:
        meta = read_model_meta(path, Path(cache))
        files = extract_shard(path, 0, meta.n_layers, Path(cache))
        config = EngineConfig(threads=1, max_sessions=2, session_kv_tokens=1024, batch_tokens=256)
        with ShardEngine(files, config, Path(cache)) as engine, Vocabulary(path) as vocab:
            t0 = time.perf_counter()
            engine.open_session("setup", sampling=SamplingParams(grammar=grammar))
            engine.release("setup")
            setup_s = time.perf_counter() - t0  # tokenizer for llguidance (once per node) + one matcher
            free_steps: list[float] = []
            cons_steps: list[float] = []
            mask: list[float] = []
            outputs: list[dict[str, Any]] = []
            for _round in range(args.rounds):
                for q in QUESTIONS:
                    ids = prompt_ids(vocab, q, meta.architecture)
                    p = len(ids)
                    free = decode(engine, "free", ids, SamplingParams(completion_start=p), args.tokens)
                    cons = decode(
                        engine, "json", ids, SamplingParams(grammar=grammar, completion_start=p), args.tokens
                    )
                    free_steps += free["step_s"]
                    cons_steps += cons["step_s"]
                    mask += cons["mask_s"]
                    text = vocab.detokenize(cons["tokens"])
                    try:
                        json.loads(text)
                        valid = True
                    except ValueError:
                        valid = False
                    outputs.append({"question": q, "constrained": text, "valid_json": valid})
    free_ms = 1000 * statistics.mean(free_steps)
    cons_ms = 1000 * statistics.mean(cons_steps)
    report = {
        "model": str(path),
        "vocab": meta.name,
        "tokens_per_run": args.tokens,
        "decode_ms_per_token": {"free": free_ms, "json_schema": cons_ms},
        "ratio_constrained_over_free": cons_ms / free_ms,
        "goal_ratio": 1.10,
        "constraint_ms_per_token": {
            "mean": 1000 * statistics.mean(mask),
            "median": 1000 * statistics.median(mask),
            "p95": 1000 * float(np.percentile(mask, 95)),
        },
        "first_grammar_setup_s": setup_s,
        "steps": {"free": len(free_steps), "json_schema": len(cons_steps)},
        "outputs": outputs,
    }
    print(
        f"model {meta.name}: decode ms/token, {len(free_steps)} free and {len(cons_steps)} constrained steps"
    )
    print(f"{'free':<14}{free_ms:>10.2f}")
    print(f"{'json_schema':<14}{cons_ms:>10.2f}   ratio {cons_ms / free_ms:.3f} (goal <= 1.10)")
    c = report["constraint_ms_per_token"]
    print(
        f"constraint alone per token: mean {c['mean']:.3f} ms, median {c['median']:.3f} ms, "
        f"p95 {c['p95']:.3f} ms"
    )
    print(
        f"first grammar on a node (tokenizer + matcher): {setup_s:.2f} s; valid JSON: "
        f"{sum(o['valid_json'] for o in outputs)}/{len(outputs)}"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
