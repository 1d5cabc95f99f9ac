"""Speculative decoding on the route, side by side with plain decoding in one run (issue 24).

``python -m sim.bench_spec [--model smol|qwen] [--nodes 3] [--rounds 3] [--max-tokens 96]
[--proposers ngram,draft,draft-always] [--draft-model FILE.gguf] [--out docs/perf/spec.json]``

Starts a swarm on loopback (swarm-tracker, ``--nodes`` swarm-node processes splitting the model
evenly, one llama.cpp thread each, swarm-gateway with ``--kv-keep-s 0`` and no spot checks) and
sends streamed greedy chat requests of two prompt classes, speculation on and off taking turns
(the request's extra_body ``speculation``). With ``draft`` among ``--proposers`` a second swarm,
the same but with every node started with ``--draft-model`` (default: a Q4_0 copy of the target
made with llama.cpp's quantizer; ``draft_model_choice`` auto: each session measures whether the
model or n-gram lookup yields more), runs beside it, and its speculating requests take their turn
too; ``draft-always`` one more whose nodes always draft with the model (``--draft-model-choice
always``). No speculation, n-gram drafts and draft-model drafts side by side, in an order that
rotates.

* ``edit``: editing code or text given in the prompt (the answer repeats most of it);
* ``chat``: open questions (novel text: n-gram drafts rarely match).

Per request it times the first text piece and the last one at the client (plain httpx) and reads
the completion's token count from the usage chunk; the per-token time is (last - first) / (tokens -
1), the decode part only. Tokens per pass come from the gateway's speculation counters. It checks
that the texts with and without speculation are identical. Prints a table and writes JSON; the
machine is shared, so figures are for comparison within one run (ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from node.testmodel import qwen_coder_model_path, test_model_path
from sim.launcher import LocalSwarm, start_local_swarm

COUNTERS = ("windows", "window_tokens", "drafted_tokens")

EDIT = [
    "Repeat this code exactly, adding type hints to every function:\n\n"
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n",
    "Rewrite this paragraph with British spelling, changing nothing else:\n\n"
    "The color of the harbor changed at dusk. The neighbors organized a program to honor the "
    "center's labor, and everyone realized the favor they owed to the theater's behavior.",
    "Rename the variable `x` to `count` in this code and return the whole code:\n\n"
    "def tally(items):\n    x = 0\n    for item in items:\n        if item:\n            x += 1\n"
    "    return x\n\n\ndef reset():\n    x = 0\n    return x\n",
]
CHAT = [
    "Tell me about the ocean.",
    "What makes a good friend?",
    "Describe a walk in a forest in autumn.",
]
N_LAYERS = {"smol": 30, "qwen": 28}


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def stream_chat(base: str, model: str, prompt: str, max_tokens: int, spec: bool) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculation": spec,
    }
    parts: list[str] = []
    first = last = 0.0
    tokens = 0
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    parts.append(text)
    return {
        "text": "".join(parts),
        "tokens": tokens,
        "ttft_s": first - t0,
        "per_token_ms": (last - first) * 1000 / max(1, tokens - 1),
    }


def run(swarms: dict[str, LocalSwarm], rounds: int, max_tokens: int) -> dict[str, Any]:
    """``swarms``: mode -> the swarm its requests go to; mode ``off`` runs without speculation."""
    out: dict[str, Any] = {}
    modes = list(swarms)
    for cls, prompts in (("edit", EDIT), ("chat", CHAT)):
        rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        counters = {
            m: dict.fromkeys(("windows", "window_tokens", "drafted", "decode_tokens"), 0.0) for m in modes
        }
        identical = {m: True for m in modes if m != "off"}
        for swarm in {id(s): s for s in swarms.values()}.values():  # warm-up (caches, first connections)
            stream_chat(swarm.base_url.removesuffix("/v1"), swarm.model_name, prompts[0], 8, False)
        turn = 0
        for _ in range(rounds):
            for p in prompts:
                order = modes[turn % len(modes) :] + modes[: turn % len(modes)]
                turn += 1
                texts = {}
                for mode in order:
                    base = swarms[mode].base_url.removesuffix("/v1")
                    before = [metric(base, f"swarm_gateway_spec_{n}_total") for n in COUNTERS]
                    res = stream_chat(base, swarms[mode].model_name, p, max_tokens, mode != "off")
                    texts[mode] = res.pop("text")
                    rows[mode].append(res)
                    if mode != "off":
                        after = [metric(base, f"swarm_gateway_spec_{n}_total") for n in COUNTERS]
                        c = counters[mode]
                        c["windows"] += after[0] - before[0]
                        c["window_tokens"] += after[1] - before[1]
                        c["drafted"] += after[2] - before[2]
                        c["decode_tokens"] += res["tokens"] - 1
                for mode in identical:
                    identical[mode] &= texts[mode] == texts["off"]
        summary: dict[str, Any] = {"identical_text": identical}
        for mode, items in rows.items():
            summary[mode] = {
                "requests": len(items),
                "tokens": sum(i["tokens"] for i in items),
                "per_token_ms_median": statistics.median(i["per_token_ms"] for i in items),
                "per_token_ms_mean": statistics.fmean(i["per_token_ms"] for i in items),
                "ttft_ms_median": statistics.median(i["ttft_s"] * 1000 for i in items),
            }
            if mode == "off":
                continue
            c = counters[mode]
            # Decode passes with speculation: a window is one pass; the other decode tokens took one each.
            passes = c["windows"] + max(0.0, c["decode_tokens"] - c["window_tokens"])
            summary[mode]["spec"] = {
                "windows": c["windows"],
                "window_tokens": c["window_tokens"],
                "drafted": c["drafted"],
                "tokens_per_window": c["window_tokens"] / max(1.0, c["windows"]),
                "acceptance": (c["window_tokens"] - c["windows"]) / max(1.0, c["drafted"]),
                "decode_tokens_per_pass": c["decode_tokens"] / max(1.0, passes),
            }
            summary[mode]["over_off"] = (
                summary[mode]["per_token_ms_mean"] / summary["off"]["per_token_ms_mean"]
            )
        out[cls] = summary
    return out


def _start(tmp: Path, name: str, path: Path, nodes: int, layers: list[str], extra: list[str]) -> LocalSwarm:
    return start_local_swarm(
        tmp / name,
        model=path,
        n_nodes=nodes,
        layers=layers,
        node_cache=Path(os.environ.get("SWARM_BENCH_CACHE", tmp / "cache")),
        gateway_args=["--check-fraction", "0", "--probation-checks", "0", "--kv-keep-s", "0"],
        node_args=["--no-benchmark", *extra],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--model", choices=sorted(N_LAYERS), default="smol")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--proposers", default="ngram", help="ngram, draft, draft-always (commas)")
    ap.add_argument("--draft-model", type=Path, default=None, help="default: a Q4_0 copy of the target")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    proposers = [p for p in args.proposers.split(",") if p]
    if not proposers or set(proposers) - {"ngram", "draft", "draft-always"}:
        ap.error("--proposers: ngram, draft, draft-always (commas)")
    path = test_model_path() if args.model == "smol" else qwen_coder_model_path()
    n = N_LAYERS[args.model]
    cuts = [round(i * n / args.nodes) for i in range(args.nodes + 1)]
    layers = [f"{a}:{b}" for a, b in zip(cuts, cuts[1:], strict=False)]
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp_dir:
        tmp = Path(tmp_dir)
        draft_path = args.draft_model
        if {"draft", "draft-always"} & set(proposers) and draft_path is None:
            from node.draft_model import quantize

            draft_path = quantize(path, tmp / "draft-q4_0.gguf", "q4_0")
        started_swarms: list[LocalSwarm] = []
        try:
            plain = _start(tmp, "ngram", path, args.nodes, layers, [])
            started_swarms.append(plain)
            swarms = {"off": plain}
            if "ngram" in proposers:
                swarms["ngram"] = plain
            for mode, choice in (("draft", "auto"), ("draft-always", "always")):
                if mode in proposers:
                    extra = ["--draft-model", str(draft_path), "--draft-model-choice", choice]
                    drafting = _start(tmp, mode, path, args.nodes, layers, extra)
                    started_swarms.append(drafting)
                    swarms[mode] = drafting
            started = time.time()
            results = run(swarms, args.rounds, args.max_tokens)
        finally:
            for swarm in started_swarms:
                swarm.stop()
    print(
        f"\nspeculative decoding, {args.model}, {args.nodes} nodes on loopback, {args.rounds} rounds, greedy"
    )
    print(
        "{:6} {:12} {:>9} {:>7} {:>11} {:>7} {:>9} {:>5}".format(
            "class", "mode", "ms/tok", "/off", "tok/window", "accept", "tok/pass", "same"
        )
    )
    for cls, res in results.items():
        for mode in ("off", *proposers):
            m = res[mode]
            if mode == "off":
                print(f"{cls:6} {mode:12} {m['per_token_ms_mean']:9.1f} {1.0:7.2f}")
                continue
            sp = m["spec"]
            print(
                f"{cls:6} {mode:12} {m['per_token_ms_mean']:9.1f} {m['over_off']:7.2f} "
                f"{sp['tokens_per_window']:11.2f} {sp['acceptance']:7.2f} "
                f"{sp['decode_tokens_per_pass']:9.2f} "
                f"{str(res['identical_text'][mode]):>5}"
            )
    if args.out:
        doc = {
            "command": "python -m sim.bench_spec " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": args.model,
            "nodes": args.nodes,
            "layers": layers,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "proposers": proposers,
            "draft_model": None if draft_path is None else draft_path.name,
            "started_unix": started,
            "load_avg_1m": os.getloadavg()[0],
            "results": results,
        }
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    ok = all(all(s["identical_text"].values()) for s in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
