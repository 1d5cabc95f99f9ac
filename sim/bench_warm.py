"""Warm conversations: time to first token of turns 1-3 with a long system prompt, side by side.

``python -m sim.bench_warm [--system-tokens 1000] [--conversations 3] [--out bench-results/warm.json]``

One run starts a two-stage swarm on loopback (swarm-tracker, two swarm-node
processes with one llama.cpp thread each, swarm-gateway) and llama-cpp-python's
own OpenAI server (``python -m llama_cpp.server``, one thread, flash attention,
the same model), then plays the same three-turn conversations (a long system
prompt, three short user turns, greedy, streamed, ``max_tokens`` 8) against:

* ``swarm-warm``: the gateway's default (KV kept on the route after each turn,
  every matching position reused, as llama.cpp's ``cache_prompt``);
* ``swarm-warm-exact``: a second gateway on the same nodes started with
  ``--prefix-exact`` (reuse only whole prefill steps, so the output is
  bit-identical to a cold run's);
* ``swarm-cold``: warm reuse switched off for the request (``cache_prompt:
  false``): every turn prefills the whole conversation through both stages;
* ``server``: llama-cpp-python's server (one process, its own prefix reuse of
  the previous prompt).

Each conversation uses its own API key (keys never share kept KV), the setups
take turns conversation by conversation, and the median TTFT per turn is
reported with the ratios the goals are stated in: warm turn 2 / server turn 2
(goal <= 1) and warm turn 2 / cold turn 2 (goal <= 0.3). Prints a table and
writes JSON. The machine is shared: figures are for comparison within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from node.testmodel import test_model_path
from sim.bench_swarm import start_server
from sim.procs import Supervisor

TURNS = ("What is rain?", "And snow?", "And hail?")
SENTENCE = "You are a patient teacher who answers every question briefly and clearly. "


def start_swarm(
    model: Path, workdir: Path, n_layers: int, split: int, session_kv_tokens: int = 2048
) -> tuple[Supervisor, str, str, str]:
    sup = Supervisor(workdir)
    tracker = sup.start_tracker().ready(60)
    turl = f"http://127.0.0.1:{tracker.port}"
    nodes = [
        sup.start_node(
            name,
            model=model,
            layers=layers,
            tracker_url=turl,
            max_sessions=8,
            session_kv_tokens=session_kv_tokens,
            cache_dir=workdir / "cache",
            admin=False,
            extra_args=["--batch-tokens", "256", "--no-benchmark"],
        )
        for name, layers in (("a", f"0:{split}"), ("b", f"{split}:{n_layers}"))
    ]
    for node in nodes:
        node.ready(300)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        models = httpx.get(turl + "/v1/models", timeout=10).json()["models"]
        if any(m.get("routable") for m in models):
            break
        time.sleep(0.25)
    warm = sup.start_gateway(tracker_url=turl, name="gw-default").ready(60)
    exact = sup.start_gateway(tracker_url=turl, name="gw-exact", extra_args=["--prefix-exact"]).ready(60)
    model_id = httpx.get(f"http://127.0.0.1:{warm.port}/v1/models", timeout=10).json()["data"][0]["id"]
    return sup, f"http://127.0.0.1:{warm.port}/v1", f"http://127.0.0.1:{exact.port}/v1", model_id


def conversation(
    base_url: str, model: str, key: str, system: str, cache: bool | None, max_tokens: int
) -> list[float]:
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    ttfts = []
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        extra = {} if cache is None else {"cache_prompt": cache}
        first, text = ttft(client, model, messages, extra, max_tokens)
        ttfts.append(first)
        messages.append({"role": "assistant", "content": text})
    return ttfts


def ttft(
    client: openai.OpenAI, model: str, messages: list[dict[str, Any]], extra: dict[str, Any], max_tokens: int
) -> tuple[float, str]:
    """One greedy streamed chat request: seconds to its first generated text, and the whole text."""
    started = time.perf_counter()
    first = None
    text = ""
    stream: Any = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        extra_body=extra,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - started
            text += chunk.choices[0].delta.content
    return (first if first is not None else time.perf_counter() - started), text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the SmolLM2 test model)")
    ap.add_argument("--layers", type=int, default=30, help="the model's layer count")
    ap.add_argument("--system-tokens", type=int, default=1000, help="about this long a system prompt")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("bench-results/warm.json"))
    ap.add_argument("--workdir", type=Path, default=Path("bench-results/warm-work"))
    args = ap.parse_args(argv)
    model = args.model or test_model_path()
    system = SENTENCE * max(1, args.system_tokens // 14)
    args.workdir.mkdir(parents=True, exist_ok=True)
    server = start_server(model, 1, args.workdir / "server")
    sup, warm_url, exact_url, model_id = start_swarm(
        model, args.workdir / "swarm", args.layers, args.layers // 2
    )
    setups = {
        "swarm-warm": (warm_url, model_id, True),
        "swarm-warm-exact": (exact_url, model_id, True),
        "swarm-cold": (warm_url, model_id, False),
        "server": (server.base_url, server.model, None),
    }
    results: dict[str, list[list[float]]] = {name: [] for name in setups}
    try:
        for name, (url, m, cache) in setups.items():  # warm-up: vocabularies, first allocations
            conversation(url, m, f"warmup-{name}", "Hello.", cache, 2)
        for i in range(args.conversations):
            for name, (url, m, cache) in setups.items():
                results[name].append(conversation(url, m, f"{name}-{i}", system, cache, args.max_tokens))
    finally:
        sup.stop_all()
        server.stop()
    medians = {
        name: [statistics.median(c[t] for c in runs) for t in range(len(TURNS))]
        for name, runs in results.items()
    }
    warm2, cold2, server2 = medians["swarm-warm"][1], medians["swarm-cold"][1], medians["server"][1]
    report: dict[str, Any] = {
        "model": str(model),
        "system_prompt_chars": len(system),
        "conversations": args.conversations,
        "ttft_s_median_by_turn": medians,
        "ttft_s_all": results,
        "ratios": {
            "warm_turn2_over_server_turn2": warm2 / server2,
            "warm_turn2_over_cold_turn2": warm2 / cold2,
            "warm_turn3_over_cold_turn3": medians["swarm-warm"][2] / medians["swarm-cold"][2],
            "exact_turn2_over_cold_turn2": medians["swarm-warm-exact"][1] / cold2,
            "exact_turn2_over_server_turn2": medians["swarm-warm-exact"][1] / server2,
        },
        "goals": {"warm_turn2_over_server_turn2": "<= 1", "warm_turn2_over_cold_turn2": "<= 0.3"},
    }
    print(f"{'setup':<20}{'turn 1 (s)':>12}{'turn 2 (s)':>12}{'turn 3 (s)':>12}")
    for name, med in medians.items():
        print(f"{name:<20}{med[0]:>12.3f}{med[1]:>12.3f}{med[2]:>12.3f}")
    for key, value in report["ratios"].items():
        print(f"{key:<36}{value:>8.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
