"""Shared prefixes and conversations: time to first token, side by side (issue 23's figures).

``python -m sim.bench_prefix [--model GGUF --layers N] [--system-tokens 1500] [--rounds 3]
[--turns 10] [--out docs/perf/prefix.json]``

One run starts a two-stage swarm on loopback (swarm-tracker, two swarm-node processes with one
llama.cpp thread each, two gateways: the default and ``--prefix-exact``) and llama-cpp-python's own
OpenAI server (one process, one thread, the same model, its prompt cache), then measures, greedy and
streamed:

* **shared prefix**: client A sends a long system prompt and a question, then client B (another API
  key) the same system prompt and another question. B's TTFT / A's TTFT on the swarm (goal <= 0.15:
  B copies A's kept KV, ``prefix_share_min_tokens``), and B's TTFT on the swarm / B's TTFT on the
  server after the server saw A (goal <= 1.0; the server reuses its previous prompt's KV); then the
  floor of each: the TTFT of a short prompt (a few tokens, nothing reused) on the swarm and on the
  server, and B / that floor on each (how much of B's time is the prefix's, how much any request's);
  B's reused positions per round come from the gateway's access log (``reused_tokens``): with the
  prefix's tail hashes (docs/gateway.md, The first step) every position B shares with A, not only
  A's whole 16-position blocks;
* **conversation**: a ``--turns``-turn conversation by ``conversation_id`` sending only the new message
  each turn; the last turn's TTFT / the TTFT of the same whole history sent cold (``cache_prompt:
  false``) (goal <= 0.1).

Rounds alternate the setups; medians are reported with every sample, and the load average before and
after. Prints a table and writes JSON. The machine is shared: compare figures within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import openai

from node.testmodel import test_model_path
from sim.bench_swarm import start_server
from sim.bench_warm import start_swarm, ttft

SENTENCE = "You are the assistant of a team's code review tool; cite file names and keep answers short. "
QUESTIONS = (
    "What does a linter do?",
    "Why write tests?",
    "What is a race condition?",
    "When should I refactor?",
    "What is a code smell?",
    "Why pin dependencies?",
    "What is a flaky test?",
    "What does CI stand for?",
    "Why review small changes?",
    "What is dead code?",
    "What is technical debt?",
    "Why use type hints?",
)


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=900)


def first_token(
    c: openai.OpenAI, model: str, messages: list[dict[str, Any]], extra: dict[str, Any], max_tokens: int
) -> tuple[float, str]:
    """As :func:`sim.bench_warm.ttft` (seconds to the first generated text), and the response's id (the
    gateway's request id: its access log says how many prompt positions the request reused)."""
    started = time.perf_counter()
    first = None
    rid = ""
    stream: Any = c.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        extra_body=extra,
    )
    for chunk in stream:
        rid = rid or chunk.id
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
    return (first if first is not None else time.perf_counter() - started), rid


def reused_positions(log: Path) -> dict[str, int]:
    """Request id -> prompt positions taken from kept KV, from a gateway's access log (JSON lines)."""
    out: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "request_done" and rec.get("reused_tokens") is not None:
            out[str(rec.get("request_id"))] = int(rec["reused_tokens"])
    return out


def shared_round(
    swarm: str, server: str, model: str, server_model: str, system: str, tag: str, max_tokens: int
) -> dict[str, Any]:
    a = [{"role": "system", "content": tag + system}, {"role": "user", "content": QUESTIONS[0]}]
    b = [{"role": "system", "content": tag + system}, {"role": "user", "content": QUESTIONS[1]}]
    out: dict[str, Any] = {}
    out["swarm_a"], _ = ttft(client(swarm, f"a-{tag}"), model, a, {}, max_tokens)
    out["swarm_b"], out["swarm_b_request_id"] = first_token(
        client(swarm, f"b-{tag}"), model, b, {}, max_tokens
    )
    out["server_a"], _ = ttft(client(server, "x"), server_model, a, {}, max_tokens)
    out["server_b"], _ = ttft(client(server, "x"), server_model, b, {}, max_tokens)
    # The floor of each: a short prompt (a few tokens, nothing reused) right after.
    short = [{"role": "user", "content": "Hello" + tag + "."}]
    out["swarm_short"], _ = ttft(client(swarm, f"s-{tag}"), model, short, {"cache_prompt": False}, max_tokens)
    out["server_short"], _ = ttft(
        client(server, "x"), server_model, short, {"cache_prompt": False}, max_tokens
    )
    return out


def conversation_round(
    swarm: str, model: str, system: str, tag: str, turns: int, max_tokens: int
) -> dict[str, Any]:
    name = "".join(ch for ch in tag if ch.isalnum())  # conversation ids: letters, digits and . _ : -
    c = client(swarm, f"conv-{name}")
    history: list[dict[str, Any]] = [{"role": "system", "content": tag + system}]
    per_turn = []
    for i in range(turns):
        new = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        if i == 0:
            new = [history[0], *new]
        t, text = ttft(c, model, new, {"conversation_id": f"bench-{name}"}, max_tokens)
        per_turn.append(t)
        history += [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        history.append({"role": "assistant", "content": text})
    cold, _ = ttft(client(swarm, f"cold-{tag}"), model, history[:-1], {"cache_prompt": False}, max_tokens)
    return {"turns_s": per_turn, "last_turn_cold_s": cold}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the SmolLM2 test model)")
    ap.add_argument("--layers", type=int, default=30, help="the model's layer count")
    ap.add_argument("--system-tokens", type=int, default=1500, help="about this long a shared system prompt")
    ap.add_argument("--conversation-system-tokens", type=int, default=300)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--session-kv-tokens", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=Path("bench-results/prefix.json"))
    ap.add_argument("--workdir", type=Path, default=Path("bench-results/prefix-work"))
    args = ap.parse_args(argv)
    model = args.model or test_model_path()
    words = max(1, len(SENTENCE.split()))
    system = SENTENCE * max(1, round(args.system_tokens / (words * 1.3)))
    conv_system = SENTENCE * max(1, round(args.conversation_system_tokens / (words * 1.3)))
    args.workdir.mkdir(parents=True, exist_ok=True)
    server = start_server(model, 1, args.workdir / "server")
    sup, swarm_url, _exact_url, model_id = start_swarm(
        model, args.workdir / "swarm", args.layers, args.layers // 2, args.session_kv_tokens
    )
    shared: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    convs: list[dict[str, Any]] = []
    try:
        ttft(client(swarm_url, "warmup"), model_id, [{"role": "user", "content": "Hello."}], {}, 2)
        ttft(client(server.base_url, "warmup"), server.model, [{"role": "user", "content": "Hello."}], {}, 2)
        for r in range(args.rounds):
            tag = f" (round {r})"  # each round a new prefix: nothing kept from the round before
            shared.append(
                shared_round(swarm_url, server.base_url, model_id, server.model, system, tag, args.max_tokens)
            )
            convs.append(
                conversation_round(swarm_url, model_id, conv_system, tag, args.turns, args.max_tokens)
            )
    finally:
        sup.stop_all()
        server.stop()
    load_after = os.getloadavg()
    reused = reused_positions(sup.workdir / "logs" / "gw-default.log")
    for row in shared:
        row["swarm_b_reused_positions"] = reused.get(row.pop("swarm_b_request_id"))
    timed = [k for k in shared[0] if k.endswith(("_a", "_b", "_short"))]
    med = {k: statistics.median(s[k] for s in shared) for k in timed}
    last = statistics.median(c["turns_s"][-1] for c in convs)
    cold = statistics.median(c["last_turn_cold_s"] for c in convs)
    ratios = {
        "shared_b_over_a": med["swarm_b"] / med["swarm_a"],
        "shared_b_over_server_b": med["swarm_b"] / med["server_b"],
        "short_swarm_over_server": med["swarm_short"] / med["server_short"],
        "swarm_b_over_swarm_short": med["swarm_b"] / med["swarm_short"],
        "server_b_over_server_short": med["server_b"] / med["server_short"],
        "conversation_last_turn_over_cold": last / cold,
    }
    report = {
        "model": str(model),
        "system_prompt_chars": len(system),
        "rounds": args.rounds,
        "turns": args.turns,
        "load_average_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "swarm_b_reused_positions": [row["swarm_b_reused_positions"] for row in shared],
        "shared_prefix_ttft_s_median": med,
        "conversation_last_turn_ttft_s_median": last,
        "conversation_whole_history_cold_ttft_s_median": cold,
        "ratios": ratios,
        "goals": {
            "shared_b_over_a": "<= 0.15",
            "shared_b_over_server_b": "<= 1.0",
            "conversation_last_turn_over_cold": "<= 0.1",
        },
        "samples": {"shared": shared, "conversations": convs},
    }
    print(f"{'shared prefix':<28}{'client A (s)':>14}{'client B (s)':>14}")
    print(f"{'swarm':<28}{med['swarm_a']:>14.3f}{med['swarm_b']:>14.3f}")
    print(f"{'llama-cpp-python server':<28}{med['server_a']:>14.3f}{med['server_b']:>14.3f}")
    print(
        f"short prompt (nothing reused): swarm {med['swarm_short']:.3f} s, server {med['server_short']:.3f} s"
    )
    print(f"conversation: turn {args.turns} {last:.3f} s, the same history cold {cold:.3f} s")
    print(f"B's reused positions per round: {report['swarm_b_reused_positions']}")
    print(f"load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    for key, value in ratios.items():
        print(f"{key:<36}{value:>8.3f}   goal {report['goals'].get(key, '-')}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
