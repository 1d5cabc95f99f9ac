"""Two llama.cpp builds of one release on the same token sequences: how often the greedy token parts.

    scripts/build-alt-llama            # once, outside the repository (12+ minutes on 2 cores)
    python -m sim.bench_builds [--model smollm2|gemma3] [--alt /work/alt-llama/lib] [--prompts 16]
                               [--new 32] [--out docs/perf/builds-<model>.json]

The reference is this venv's llama.cpp (the AVX2 build scripts/setup makes); the
other is the same release built with AVX2, FMA and BMI2 off, loaded by a child
process through ``LLAMA_CPP_LIB_PATH``. For each prompt the reference's greedy
continuation is evaluated by both builds in one batch (the prefill path a node
runs); reported: positions whose argmax differs (the cross-recipe tolerance's
false positives of the old same-token rule; sim/bench_cross_recipe.py calibrates today's
``gateway.checks.Tolerance``), requests with any,
and the largest logit difference. One thread, deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from sim.bench_tolerance import PROMPTS, _llm, _logits, _model


def _worker(model: Path, tokens_file: Path, out_file: Path) -> None:
    import llama_cpp

    sequences = json.loads(tokens_file.read_text())
    llm = _llm(model, 512)
    try:
        arrays = {f"s{i}": _logits(llm, seq) for i, seq in enumerate(sequences)}
        arrays["system_info"] = np.frombuffer(llama_cpp.llama_print_system_info(), dtype=np.uint8)
    finally:
        llm.close()
    np.savez(out_file, **arrays)  # type: ignore[arg-type]


def measure(model: Path, alt_lib: Path, n_prompts: int, n_new: int) -> dict[str, Any]:
    if not (alt_lib / "libllama.so").is_file():
        raise SystemExit(f"no alt build at {alt_lib}: run scripts/build-alt-llama first")
    ref = _llm(model, 512)
    sequences: list[list[int]] = []
    starts: list[int] = []
    try:
        for prompt in PROMPTS[:n_prompts]:
            prompt_tokens = ref.tokenize(prompt.encode(), add_bos=True)
            ref.reset()
            continuation: list[int] = []
            for token in ref.generate(prompt_tokens, temp=0.0, repeat_penalty=1.0):
                if ref.token_eos() == token or len(continuation) >= n_new:
                    break
                continuation.append(int(token))
            sequences.append([int(t) for t in prompt_tokens] + continuation)
            starts.append(len(prompt_tokens) - 1)
    finally:
        ref.close()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokens_file = Path(tmp) / "tokens.json"
        tokens_file.write_text(json.dumps(sequences))
        for name, lib in (("reference", None), ("alt", alt_lib)):
            env = dict(os.environ)
            env.pop("LLAMA_CPP_LIB_PATH", None)
            if lib is not None:
                env["LLAMA_CPP_LIB_PATH"] = str(lib)
            out = Path(tmp) / f"{name}.npz"
            cmd = [
                sys.executable,
                "-m",
                "sim.bench_builds",
                "--worker",
                str(model),
                str(tokens_file),
                str(out),
            ]
            subprocess.run(cmd, env=env, check=True)
            results[name] = dict(np.load(out))
    positions = flips = flipped_requests = identical_rows = 0
    max_abs = max_rel = 0.0
    for i, seq in enumerate(sequences):
        a, b = results["reference"][f"s{i}"], results["alt"][f"s{i}"]
        any_flip = False
        for row in range(starts[i], len(seq) - 1):
            positions += 1
            identical_rows += int(np.array_equal(a[row], b[row]))
            if int(np.argmax(a[row])) != int(np.argmax(b[row])):
                flips += 1
                any_flip = True
            diff = float(np.abs(a[row] - b[row]).max())
            max_abs = max(max_abs, diff)
            max_rel = max(max_rel, diff / max(1e-9, float(np.abs(a[row]).max())))
        flipped_requests += int(any_flip)
    return {
        "model": model.name,
        "reference_build": bytes(results["reference"]["system_info"]).decode(errors="replace").strip(),
        "alt_build": bytes(results["alt"]["system_info"]).decode(errors="replace").strip(),
        "requests": len(sequences),
        "positions": positions,
        "bit_identical_positions": identical_rows,
        "argmax_flips": flips,
        "per_token_false_positive_rate": flips / positions if positions else 0.0,
        "per_request_false_positive_rate": flipped_requests / len(sequences) if sequences else 0.0,
        "max_abs_logit_diff": max_abs,
        "max_rel_logit_diff": max_rel,
        "path": "one batch (n_batch = n_ubatch = 512), one thread, flash attention on",
    }


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        _worker(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument(
        "--alt", type=Path, default=Path(os.environ.get("ALT_LLAMA_DIR", "/work/alt-llama")) / "lib"
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    r = measure(_model(args.model), args.alt, min(args.prompts, len(PROMPTS)), args.new)
    print(
        f"{'model':<36} {'positions':>9} {'identical':>9} {'flips':>5} "
        f"{'FPR/token':>9} {'FPR/req':>7} {'max |dlogit|':>12}"
    )
    print(
        f"{r['model']:<36} {r['positions']:>9} {r['bit_identical_positions']:>9} {r['argmax_flips']:>5} "
        f"{r['per_token_false_positive_rate']:>9.4f} {r['per_request_false_positive_rate']:>7.3f} "
        f"{r['max_abs_logit_diff']:>12.3e}"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
