"""Calibrating the cross-recipe tolerance of spot checks on two real llama.cpp builds.

    scripts/build-alt-llama            # once, outside the repository (12+ minutes on 2 cores)
    python -m sim.bench_cross_recipe [--model smollm2|gemma3] [--alt /work/alt-llama/lib]
                                     [--new 32] [--out docs/perf/cross-recipe-<model>.json]

Two honest nodes of other check fingerprints (another CPU feature level, another
build) compute the same arithmetic with other kernels and part in low-order bits,
now and then on the greedy token. The gateway then compares their step reports
with :class:`gateway.checks.Tolerance` instead of bit for bit. This measures,
with that very function, how often it accuses honest pairs (false positives) and
how often it catches the liars of ``sim/liars.py`` (detection):

* Inputs as a spot check feeds them: for each prompt the reference build's
  greedy continuation of ``--new`` tokens (the prompt in the model's chat
  template, as the gateway sends it) is evaluated by every side at every
  position (teacher-forced: both runs of a check are fed the same tokens until
  they part), on both kernel paths a node runs -- one batch (a prefill step)
  and one token at a time (decode steps).
* Honest pairs: reference vs alt build on the decode path (what a check sees for
  generated tokens), on the batch path, and mixed; plus the two kernel paths of
  one build (``sim/bench_tolerance.py``'s pair).
* Each side's row becomes the report a node sends (``Sampled``: the greedy
  token, its logprob, the top ``--top`` candidates) and the pair is judged by
  ``Tolerance(margin).consistent``. The margin is calibrated on the first half
  of the prompts (the largest logprob difference an honest pair showed on a
  token both report, times ``--safety``) and the rates are reported on the
  other half (held out) and on all.
* Liars, each against an honest report of the other build: ``swap_sampler``
  (the token after the greedy one, its logprob and candidates kept, as
  node/failpoints.py does), ``no_model`` (a random token, logprob and
  candidates kept), and the hardest token lie, ``runner_up`` (the second-best
  token reported with its true logprob). ``perturb_hidden`` (one ulp at the
  first stage) changes no token and no logprob beyond rounding, so no
  cross-recipe comparison of sampled tokens can see it: reported as such.

One thread, deterministic (the random liar is seeded).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from gateway.chat_template import ChatTemplate
from gateway.checks import CHECK_TOP_LOGPROBS, Tolerance
from proto.codec import Sampled
from sim.bench_tolerance import PROMPTS, _llm, _model

HELD_OUT_PROMPTS = [
    "What is the largest ocean on Earth?",
    "Name a fruit that is yellow.",
    "How do plants make food?",
    "Write a short greeting for a friend.",
    "What is ten minus three?",
    "Who painted the Mona Lisa?",
    "Give me a synonym for happy.",
    "What do cows drink?",
    "Explain what a compiler does.",
    "List three kinds of trees.",
    "Translate 'thank you' into French.",
    "What is the freezing point of water?",
    "Describe a dog in one line.",
    "How many days are in a week?",
    "What is an even number?",
    "Tell me a fact about the sun.",
]
KEEP = 64  # candidates saved per row (a node reports at most node.sampling.MAX_TOP_LOGPROBS = 20)


def _n_vocab(model: Path) -> int:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    try:
        return int(llm.n_vocab())
    finally:
        llm.close()


def _chat_tokens(llm: Any, prompt: str) -> list[int]:
    """The prompt as the gateway sends it: the model's chat template, one user message."""
    meta = llm.metadata
    bos = llm.detokenize([llm.token_bos()], special=True).decode(errors="replace")
    eos = llm.detokenize([llm.token_eos()], special=True).decode(errors="replace")
    template = ChatTemplate(meta.get("tokenizer.chat_template"), bos_token=bos, eos_token=eos)
    text = template.render([{"role": "user", "content": prompt}])
    add_bos = not text.startswith(bos) if bos else False
    return [int(t) for t in llm.tokenize(text.encode(), add_bos=add_bos, special=True)]


def _rows(llm: Any, tokens: list[int], start: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-KEEP token ids and logprobs of every row from ``start`` (the rows choosing a generated
    token, the last one choosing the token after the continuation: end of generation or the next),
    in descending order."""
    llm.reset()
    llm.eval(tokens)
    logits = np.array(llm.scores[start : len(tokens)], dtype=np.float64)
    lse = np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)) + logits.max(axis=1)
    part = np.argpartition(-logits, KEEP - 1, axis=1)[:, :KEEP]  # the KEEP best, unordered
    order = np.argsort(-np.take_along_axis(logits, part, axis=1), axis=1, kind="stable")
    ids = np.take_along_axis(part, order, axis=1)
    lps = np.take_along_axis(logits, ids, axis=1) - lse[:, None]
    return ids.astype(np.int64), lps.astype(np.float32)


def _worker(model: Path, job_file: Path, out_file: Path) -> None:
    import llama_cpp

    job = json.loads(job_file.read_text())
    arrays: dict[str, np.ndarray] = {}
    for path, n_batch in (("batch", 512), ("single", 1)):
        llm = _llm(model, n_batch)
        try:
            for i, (seq, start) in enumerate(zip(job["sequences"], job["starts"], strict=True)):
                ids, lps = _rows(llm, seq, start)
                arrays[f"{path}_ids_{i}"], arrays[f"{path}_lps_{i}"] = ids, lps
        finally:
            llm.close()
    arrays["system_info"] = np.frombuffer(llama_cpp.llama_print_system_info(), dtype=np.uint8)
    np.savez(out_file, **arrays)  # type: ignore[arg-type]


def _report(
    ids: np.ndarray, lps: np.ndarray, top: int, token: int | None = None, lp: float | None = None
) -> Sampled:
    """What a node reports for a row: its greedy token (or ``token`` with logprob ``lp``: a lie)."""
    tops = tuple((int(t), float(p)) for t, p in zip(ids[:top], lps[:top], strict=True))
    if token is None:
        return Sampled(int(ids[0]), float(lps[0]), tops, False)
    return Sampled(int(token), float(lps[0] if lp is None else lp), tops, False)


def _runner_up(ids: np.ndarray, lps: np.ndarray, top: int) -> Sampled:
    """The hardest token lie: the second-best token, reported as the best, with the two best
    candidates' logprobs swapped so that the report is consistent with itself."""
    swapped = ids.copy()
    swapped[0], swapped[1] = ids[1], ids[0]
    return _report(swapped, lps, top)


def _needed_margin(a: Sampled, b: Sampled) -> float:
    """The smallest margin under which the pair is consistent (inf: none; -> calibration)."""
    lo, hi = 0.0, 64.0
    if not Tolerance(hi).consistent(a, b, greedy=True):
        return float("inf")
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if Tolerance(mid).consistent(a, b, greedy=True) else (mid, hi)
    return hi


def _sequences(model: Path, n_new: int) -> tuple[list[list[int]], list[int], int]:
    """Every prompt in the chat template plus the reference's greedy continuation; the row each
    generated token is chosen at starts at ``starts[i]``; and the vocabulary's size."""
    ref = _llm(model, 512)
    sequences: list[list[int]] = []
    starts: list[int] = []
    n_vocab = ref.n_vocab()
    try:
        for prompt in PROMPTS + HELD_OUT_PROMPTS:
            prompt_tokens = _chat_tokens(ref, prompt)
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
    return sequences, starts, n_vocab


def measure(model: Path, alt_lib: Path, n_new: int, top: int, safety: float) -> dict[str, Any]:
    if not (alt_lib / "libllama.so").is_file():
        raise SystemExit(f"no alt build at {alt_lib}: run scripts/build-alt-llama first")
    sequences, starts, n_vocab = _sequences(model, n_new)
    t0 = time.perf_counter()
    sides: dict[str, dict[str, np.ndarray]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"sequences": sequences, "starts": starts, "n_vocab": n_vocab}))
        for name, lib in (("reference", None), ("alt", alt_lib)):
            env = dict(os.environ)
            env.pop("LLAMA_CPP_LIB_PATH", None)
            if lib is not None:
                env["LLAMA_CPP_LIB_PATH"] = str(lib)
            out = Path(tmp) / f"{name}.npz"
            cmd = [sys.executable, "-m", "sim.bench_cross_recipe", "--worker", str(model), str(job), str(out)]
            subprocess.run(cmd, env=env, check=True)
            sides[name] = dict(np.load(out))
    return analyse(model.name, sides, sequences, n_vocab, top, safety, time.perf_counter() - t0)


def analyse(
    model_name: str,
    sides: dict[str, dict[str, np.ndarray]],
    sequences: list[list[int]],
    n_vocab: int,
    top: int,
    safety: float,
    compute_s: float,
    seed: int = 0,
    calibration_count: int | None = None,
) -> dict[str, Any]:
    """The figures from the two workers' rows (``sides``: "reference" and "alt"); the first
    ``calibration_count`` sequences (default: the calibration prompts) calibrate the margin."""
    half = len(PROMPTS) if calibration_count is None else calibration_count

    def rows(side: str, path: str, i: int) -> tuple[np.ndarray, np.ndarray]:
        return sides[side][f"{path}_ids_{i}"], sides[side][f"{path}_lps_{i}"]

    pairs = {  # honest pairs: (side, path) x (side, path)
        "builds_decode": (("reference", "single"), ("alt", "single")),
        "builds_batch": (("reference", "batch"), ("alt", "batch")),
        "builds_mixed": (("reference", "batch"), ("alt", "single")),
        "kernels_one_build": (("reference", "batch"), ("reference", "single")),
    }
    needed: dict[str, list[list[float]]] = {name: [] for name in pairs}
    flips: dict[str, int] = dict.fromkeys(pairs, 0)
    for name, ((sa, pa), (sb, pb)) in pairs.items():
        for i in range(len(sequences)):
            (ia, la), (ib, lb) = rows(sa, pa, i), rows(sb, pb, i)
            per = []
            for r in range(len(ia)):
                a, b = _report(ia[r], la[r], top), _report(ib[r], lb[r], top)
                flips[name] += int(a.token_id != b.token_id)
                per.append(_needed_margin(a, b))
            needed[name].append(per)
    calibration = max(
        (
            m
            for name in ("builds_decode", "builds_batch", "builds_mixed")
            for per in needed[name][:half]
            for m in per
        ),
        default=0.0,
    )
    margin = calibration * safety
    tolerance = Tolerance(margin)

    def fp(name: str, which: slice) -> dict[str, Any]:
        reqs = needed[name][which]
        positions = sum(len(p) for p in reqs)
        bad = sum(m > margin for p in reqs for m in p)
        bad_requests = sum(any(m > margin for m in p) for p in reqs)
        return {
            "positions": positions,
            "false_positives": bad,
            "per_token_false_positive_rate": bad / positions if positions else 0.0,
            "requests": len(reqs),
            "requests_accused": bad_requests,
            "largest_needed_margin": max((m for p in reqs for m in p), default=0.0),
        }

    # The trade-off at other margins: honest positions that would be accused, and runner-up lies
    # (the hardest token lie, against the other build on the decode path) that would be caught.
    runner_needed = []
    for i in range(len(sequences)):
        (ia, la), (ib, lb) = rows("alt", "single", i), rows("reference", "single", i)
        for r in range(len(ia)):
            lie, checker = _runner_up(ia[r], la[r], top), _report(ib[r], lb[r], top)
            if lie.token_id != checker.token_id:
                runner_needed.append(_needed_margin(lie, checker))
    all_honest = [m for name in pairs for per in needed[name] for m in per]
    sweep = [
        {
            "margin_nats": m,
            "honest_positions": len(all_honest),
            "honest_accused": sum(x > m for x in all_honest),
            "runner_up_lies": len(runner_needed),
            "runner_up_caught": sum(x > m for x in runner_needed),
        }
        for m in (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
    ]
    honest = {
        name: {
            "greedy_tokens_that_differ": flips[name],
            "calibration_half": fp(name, slice(0, half)),
            "held_out_half": fp(name, slice(half, None)),
            "all": fp(name, slice(None)),
        }
        for name in pairs
    }
    rng = random.Random(seed)
    liars = ("swap_sampler", "no_model", "runner_up")
    caught = dict.fromkeys(liars, 0)
    caught_requests = dict.fromkeys(liars, 0)
    liar_positions = 0
    for i in range(len(sequences)):
        (ia, la), (ib, lb) = rows("alt", "single", i), rows("reference", "single", i)
        hit = dict.fromkeys(liars, False)
        for r in range(len(ia)):
            liar_positions += 1
            checker = _report(ib[r], lb[r], top)
            lies = {
                "swap_sampler": _report(ia[r], la[r], top, token=(int(ia[r][0]) + 1) % n_vocab),
                "no_model": _report(ia[r], la[r], top, token=rng.randrange(n_vocab)),
                "runner_up": _runner_up(ia[r], la[r], top),
            }
            for kind, lie in lies.items():
                if lie.token_id == checker.token_id:
                    continue  # the lie happens to be the honest token: nothing to catch
                if not tolerance.consistent(lie, checker, greedy=True):
                    caught[kind] += 1
                    hit[kind] = True
        for kind in liars:
            caught_requests[kind] += int(hit[kind])
    detection: dict[str, dict[str, Any]] = {
        kind: {
            "positions": liar_positions,
            "detected": caught[kind],
            "per_token_detection_rate": caught[kind] / liar_positions if liar_positions else 0.0,
            "requests": len(sequences),
            "requests_detected": caught_requests[kind],
        }
        for kind in liars
    }
    detection["perturb_hidden"] = {
        "detected": 0,
        "note": "one ulp at the first stage changes no token here; only bit-exact checks within one "
        "check fingerprint see it",
    }
    return {
        "model": model_name,
        "reference_build": bytes(sides["reference"]["system_info"]).decode(errors="replace").strip(),
        "alt_build": bytes(sides["alt"]["system_info"]).decode(errors="replace").strip(),
        "prompts": len(sequences),
        "calibration_prompts": half,
        "tokens_per_sequence_max": max((len(s) for s in sequences), default=0),
        "top_logprobs_reported": top,
        "largest_honest_margin_needed_on_calibration_half": calibration,
        "safety_factor": safety,
        "margin_nats": margin,
        "honest_pairs": honest,
        "margin_sweep": sweep,
        "liars_vs_other_build": detection,
        "compute_seconds": round(compute_s, 1),
        "paths": "batch: n_batch = n_ubatch = 512; single: one token at a time; one thread; flash attn on",
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
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--top", type=int, default=CHECK_TOP_LOGPROBS)
    parser.add_argument("--safety", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--reuse",
        nargs=3,
        type=Path,
        metavar=("JOB", "REF", "ALT"),
        help="analyse earlier workers' outputs (job.json, reference.npz, alt.npz) instead of running them",
    )
    args = parser.parse_args()
    if args.reuse:
        job_file, ref_file, alt_file = args.reuse
        job = json.loads(job_file.read_text())
        model = _model(args.model)
        n_vocab = int(job["n_vocab"]) if "n_vocab" in job else _n_vocab(model)
        sides = {"reference": dict(np.load(ref_file)), "alt": dict(np.load(alt_file))}
        r = analyse(
            model.name,
            sides,
            job["sequences"],
            n_vocab,
            args.top,
            args.safety,
            0.0,
            calibration_count=job.get("calibration_count"),
        )
    else:
        r = measure(_model(args.model), args.alt, args.new, args.top, args.safety)
    print(
        f"{r['model']}: margin {r['margin_nats']:.3f} nats "
        f"(largest honest need on the calibration half "
        f"{r['largest_honest_margin_needed_on_calibration_half']:.3f} "
        f"x {r['safety_factor']:g})"
    )
    print(
        f"{'honest pair':<20} {'flips':>5} {'positions':>9} {'FP':>4} {'FP/token':>9} "
        f"{'req accused':>11} {'held-out FP':>11}"
    )
    for name, h in r["honest_pairs"].items():
        a, held = h["all"], h["held_out_half"]
        print(
            f"{name:<20} {h['greedy_tokens_that_differ']:>5} {a['positions']:>9} {a['false_positives']:>4} "
            f"{a['per_token_false_positive_rate']:>9.4f} {a['requests_accused']:>5}/{a['requests']:<5} "
            f"{held['false_positives']:>5}/{held['positions']:<5}"
        )
    print(f"{'margin':>7} {'honest accused':>15} {'runner-up caught':>17}")
    for row in r["margin_sweep"]:
        print(
            f"{row['margin_nats']:>7.2f} {row['honest_accused']:>7}/{row['honest_positions']:<7} "
            f"{row['runner_up_caught']:>8}/{row['runner_up_lies']:<8}"
        )
    print(f"{'liar':<20} {'detected/token':>14} {'requests caught':>15}")
    for kind, d in r["liars_vs_other_build"].items():
        if "positions" in d:
            print(
                f"{kind:<20} {d['per_token_detection_rate']:>14.4f} "
                f"{d['requests_detected']:>7}/{d['requests']:<7}"
            )
        else:
            print(f"{kind:<20} {'0':>14}  ({d['note']})")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
