"""The client APIs side by side: what the Responses API, Ollama's API and several-prompt completions cost
over chat completions and single-prompt completions, on the same swarm and the same greedy request.

``python -m sim.bench_client_apis [--rounds 5] [--max-tokens 32] [--out docs/perf/client-apis.json]``

One run starts a two-stage swarm on loopback (swarm-tracker, two swarm-node processes with one
llama.cpp thread each, swarm-gateway with ``--kv-keep-s 0``, so no request reuses another's KV) and
sends, round after round with the APIs taking turns, one streamed greedy request through each of:

* ``chat``: ``POST /v1/chat/completions`` (SSE);
* ``responses``: ``POST /v1/responses`` (SSE with the Responses events);
* ``ollama-chat``: ``POST /api/chat`` (NDJSON);
* ``ollama-generate``: ``POST /api/generate`` (NDJSON, the prompt through the chat template);

timing the first text piece (TTFT) and the last byte at the client (plain httpx for all, so no SDK
overhead is in the figures), and checking that the four texts are identical. Then four prompts as
one completions request against the same four as four requests one after another (non-streamed,
``max_tokens`` as above). Prints a table and writes JSON. The machine is shared: figures are for
comparison within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from node.testmodel import test_model_path
from sim.procs import Supervisor

QUESTION = "Name three rivers of Europe."
PROMPTS = ("The capital of France is", "Once upon a time", "The best way to cook rice is", "1, 2, 3,")


def start_swarm(model: Path, workdir: Path, n_layers: int, split: int) -> tuple[Supervisor, str, str]:
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
            session_kv_tokens=1024,
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
        if any(m.get("routable") for m in httpx.get(turl + "/v1/models", timeout=10).json()["models"]):
            break
        time.sleep(0.25)
    gw = sup.start_gateway(tracker_url=turl, extra_args=["--kv-keep-s", "0"]).ready(60)
    base = f"http://127.0.0.1:{gw.port}"
    return sup, base, httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]


def _sse_text(line: str) -> str:
    data = json.loads(line[6:])
    if data.get("type") == "response.output_text.delta":
        return str(data["delta"])
    return "".join((c.get("delta") or {}).get("content") or "" for c in data.get("choices", []))


def _ndjson_text(line: str) -> str:
    data = json.loads(line)
    return str((data.get("message") or {}).get("content") or data.get("response") or "")


def timed(http: httpx.Client, path: str, body: dict[str, Any], piece: Callable[[str], str]) -> dict[str, Any]:
    start = time.perf_counter()
    first = None
    text = ""
    with http.stream("POST", path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if (
                not line
                or (line.startswith("data: ") and line.endswith("[DONE]"))
                or line.startswith("event:")
            ):
                continue
            got = piece(line)
            if got and first is None:
                first = time.perf_counter() - start
            text += got
    return {"ttft_s": first, "total_s": time.perf_counter() - start, "text": text}


def requests(model: str, max_tokens: int) -> dict[str, tuple[str, dict[str, Any], Callable[[str], str]]]:
    user = [{"role": "user", "content": QUESTION}]
    greedy = {"temperature": 0, "seed": 1}
    ollama_options = {"options": {"temperature": 0, "seed": 1, "num_predict": max_tokens}}
    return {
        "chat": (
            "/v1/chat/completions",
            {"model": model, "messages": user, "stream": True, "max_tokens": max_tokens, **greedy},
            _sse_text,
        ),
        "responses": (
            "/v1/responses",
            {"model": model, "input": QUESTION, "stream": True, "max_output_tokens": max_tokens, **greedy},
            _sse_text,
        ),
        "ollama-chat": ("/api/chat", {"model": model, "messages": user, **ollama_options}, _ndjson_text),
        "ollama-generate": (
            "/api/generate",
            {"model": model, "prompt": QUESTION, **ollama_options},
            _ndjson_text,
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the SmolLM2 test model)")
    ap.add_argument("--layers", type=int, default=30, help="the model's layer count")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench-results/client-apis.json"))
    ap.add_argument("--workdir", type=Path, default=Path("bench-results/client-apis-work"))
    args = ap.parse_args(argv)
    model_path = args.model or test_model_path()
    args.workdir.mkdir(parents=True, exist_ok=True)
    sup, base, model = start_swarm(model_path, args.workdir, args.layers, args.layers // 2)
    calls = requests(model, args.max_tokens)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in calls}
    batch_s: list[float] = []
    one_by_one_s: list[float] = []
    batch_same = True
    try:
        with httpx.Client(base_url=base, timeout=300) as http:
            for path, body, piece in calls.values():  # warm-up: vocabulary, first allocations
                timed(http, path, body, piece)
            for _ in range(args.rounds):
                for name, (path, body, piece) in calls.items():
                    runs[name].append(timed(http, path, body, piece))
                single = {"model": model, "max_tokens": args.max_tokens, "temperature": 0}
                start = time.perf_counter()
                batch = http.post("/v1/completions", json={**single, "prompt": list(PROMPTS)}).json()
                batch_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                singles = [http.post("/v1/completions", json={**single, "prompt": p}).json() for p in PROMPTS]
                one_by_one_s.append(time.perf_counter() - start)
                batch_same &= [c["text"] for c in batch["choices"]] == [
                    s["choices"][0]["text"] for s in singles
                ]
    finally:
        sup.stop_all()
    texts = {name: {r["text"] for r in rs} for name, rs in runs.items()}
    identical = len(set().union(*texts.values())) == 1
    table = {
        name: {
            "ttft_s_median": statistics.median(r["ttft_s"] for r in rs),
            "total_s_median": statistics.median(r["total_s"] for r in rs),
        }
        for name, rs in runs.items()
    }
    chat = table["chat"]
    for row in table.values():
        row["ttft_over_chat"] = row["ttft_s_median"] / chat["ttft_s_median"]
        row["total_over_chat"] = row["total_s_median"] / chat["total_s_median"]
    report: dict[str, Any] = {
        "model": model_path.name,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "streamed": table,
        "texts_identical_across_apis": identical,
        "completions_4_prompts": {
            "one_request_s_median": statistics.median(batch_s),
            "four_requests_s_median": statistics.median(one_by_one_s),
            "choices_equal_single_requests": batch_same,
        },
        "all": {name: [{k: v for k, v in r.items() if k != "text"} for r in rs] for name, rs in runs.items()},
    }
    print(f"{'API':<18}{'TTFT (s)':>10}{'total (s)':>11}{'TTFT/chat':>11}{'total/chat':>12}")
    for name, row in table.items():
        print(
            f"{name:<18}{row['ttft_s_median']:>10.3f}{row['total_s_median']:>11.3f}"
            f"{row['ttft_over_chat']:>11.2f}{row['total_over_chat']:>12.2f}"
        )
    print(f"texts identical across the four APIs: {identical}")
    four = report["completions_4_prompts"]
    print(
        f"4 prompts: one request {four['one_request_s_median']:.3f} s, four requests "
        f"{four['four_requests_s_median']:.3f} s, choices equal: {batch_same}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
