"""What rendering a chat template in the sandbox's worker processes costs, beside rendering in process.

    python -m sim.bench_template [--out bench-results/template.json] [--renders 400]

The real SmolLM2 template (from the test model's GGUF) renders a short and a
long conversation (2 and 40 messages) three ways, side by side in one run:

* ``in_process``: ``ChatTemplate.render`` on the calling thread (compiled once);
  what the gateway did before the sandbox, and what it can never stop;
* ``sandbox``: ``TemplateSandbox.render`` from trio, one render at a time (IPC
  to a warm worker process, JSON both ways, a thread hop for the blocking pipe);
* ``sandbox_x2``: two renders at once on the two workers (throughput).

It also times a worker's start (``warm``) and the refusal of a looping
template (the time limit plus the replacement of the killed worker). Figures,
never assertions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import trio

from common.vocab import Vocabulary
from gateway.chat_template import TemplateError, TemplateSource
from gateway.template_sandbox import TemplateSandbox
from node.testmodel import test_model_path

LOOP = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


def conversation(n: int) -> list[dict[str, Any]]:
    roles = ("user", "assistant")
    return [{"role": "system", "content": "You are a helpful assistant."}] + [
        {"role": roles[i % 2], "content": f"Message {i}: " + "some words here " * 20} for i in range(n - 1)
    ]


def _summary(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    return {
        "p50_ms": round(1000 * statistics.median(ordered), 4),
        "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4),
        "mean_ms": round(1000 * statistics.fmean(ordered), 4),
    }


async def run(renders: int) -> dict[str, Any]:
    with Vocabulary(test_model_path()) as vocab:
        source = TemplateSource(vocab.chat_template or "", "<|im_start|>", "<|im_end|>")
    compiled = source.compile()
    out: dict[str, Any] = {"renders_per_case": renders, "cases": {}}
    cold = TemplateSandbox(workers=1)
    try:
        t0 = time.perf_counter()
        await cold.render(source, conversation(2))  # start the process, import, compile, render
        out["cold_first_render_s"] = round(time.perf_counter() - t0, 3)
    finally:
        cold.close()
    sandbox = TemplateSandbox(workers=2, timeout_s=1.0)
    try:
        await sandbox.warm()
        for n in (2, 40):
            messages = conversation(n)
            expected = compiled.render(messages)
            assert await sandbox.render(source, messages) == expected  # same text both ways
            local: list[float] = []
            for _ in range(renders):
                t = time.perf_counter()
                compiled.render(messages)
                local.append(time.perf_counter() - t)
            remote: list[float] = []
            for _ in range(renders):
                t = time.perf_counter()
                await sandbox.render(source, messages)
                remote.append(time.perf_counter() - t)
            t = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(_many, sandbox, source, messages, renders // 2)
            pair_s = time.perf_counter() - t
            case: dict[str, Any] = {
                "messages": n,
                "chars": len(expected),
                "in_process": _summary(local),
                "sandbox": _summary(remote),
                "sandbox_x2_renders_per_s": round(renders / pair_s, 1),
                "in_process_renders_per_s": round(renders / sum(local), 1),
            }
            case["sandbox_over_in_process_p50"] = round(
                case["sandbox"]["p50_ms"] / case["in_process"]["p50_ms"], 2
            )
            out["cases"][str(n)] = case
        t = time.perf_counter()
        try:
            await sandbox.render(TemplateSource(LOOP), conversation(2))
        except TemplateError:
            pass
        out["loop_refused_after_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        await sandbox.render(source, conversation(2))
        out["next_render_after_a_kill_s"] = round(time.perf_counter() - t, 3)
    finally:
        sandbox.close()
    return out


async def _many(
    sandbox: TemplateSandbox, source: TemplateSource, messages: list[dict[str, Any]], n: int
) -> None:
    for _ in range(n):
        await sandbox.render(source, messages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-results/template.json")
    parser.add_argument("--renders", type=int, default=400)
    args = parser.parse_args()
    result = trio.run(run, args.renders)
    head = ("messages", "chars", "in-process p50", "sandbox p50", "ratio", "sandbox x2 /s")
    print(f"{head[0]:>8} {head[1]:>7} {head[2]:>15} {head[3]:>12} {head[4]:>6} {head[5]:>14}")
    for case in result["cases"].values():
        print(
            f"{case['messages']:>8} {case['chars']:>7} {case['in_process']['p50_ms']:>12.3f} ms"
            f" {case['sandbox']['p50_ms']:>9.3f} ms {case['sandbox_over_in_process_p50']:>6.1f}"
            f" {case['sandbox_x2_renders_per_s']:>14.1f}"
        )
    print(
        f"first render on a new worker: {result['cold_first_render_s']} s; looping template refused "
        f"after {result['loop_refused_after_s']} s; next render {result['next_render_after_a_kill_s']} s"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
