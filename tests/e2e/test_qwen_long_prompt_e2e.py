"""A 16,000-token prompt on Qwen2.5-Coder-1.5B through a 2-node pooled swarm (issue 22).

Opt-in (``SWARM_QWEN_TESTS=1``; the 1.1 GB model from ``node.testmodel.qwen_coder_model_path``):
a tracker, two nodes -- ``[0,14)`` and ``[14,28)`` with the automatic KV pool (``--kv-pool-tokens
-1``: sparse per-sequence streams, nothing reserved at OPEN) -- and a gateway with
``--prefix-exact``, as ``swarm-sim up`` starts them. A Python module of about 16,000 tokens that
ends mid-definition (Qwen2.5-Coder was trained for 32,768 positions; the per-sequence layout's
2,048-position slots refused anything past 2,048) goes through the official openai client,
streamed (cold: its time to first token and decode rate are printed) and then not streamed (the
same client: it starts from the first request's kept KV, cut at a whole prefill step, so its bits
are a cold run's). Both texts must equal the whole model in one llama.cpp context given the same
prompt (flash attention, f16 KV, greedy, prefill cut in the same steps). Afterwards no session
holds KV on either node.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from common.vocab import Vocabulary
from node.llama_runtime import ContextSettings
from node.reference import ReferenceModel
from sim.launcher import LocalSwarm, start_local_swarm
from tests.e2e.conftest import QWEN_OPT_IN
from tests.e2e.swarm_helpers import node_load

# The reference prefills 16,000 positions on one thread: about 15 minutes on a 2-core machine alone.
pytestmark = [*QWEN_OPT_IN, pytest.mark.timeout(5400)]

N_NEW = 16
STEP = 512  # the nodes' --batch-tokens and the gateway's prefill step: the reference cuts the same
LOW, HIGH = 15_900, 16_000  # prompt tokens
N_CTX = 16_384 + 256


@pytest.fixture(scope="module")
def prompt(qwen: Path) -> tuple[str, list[int]]:
    """A module of small geometry helpers, about 16,000 tokens, ending inside the next definition."""
    text = '"""Geometry helpers for the floor planner."""\n\nimport math\n\n'
    with Vocabulary(qwen) as v:
        i = 0
        while True:  # the whole text tokenized each time: pieces merge across block boundaries
            block = (
                f"def room_{i}_area(width: float, depth: float) -> float:\n"
                f'    """Floor area of room {i} in square metres (walls {i % 7 + 2} cm thick)."""\n'
                f"    return (width - {(i % 7 + 2) / 50:.2f}) * (depth - {(i % 7 + 2) / 50:.2f})\n\n\n"
            )
            if len(v.tokenize(text + block + f"def room_{i + 1}_area(", add_special=False)) > HIGH:
                break
            text += block
            i += 1
        text += f"def room_{i}_area("
        tokens = v.tokenize(text, add_special=False)
        assert LOW - 200 <= len(tokens) <= HIGH, len(tokens)
    return text, tokens


@pytest.fixture(scope="module")
def want(qwen: Path, prompt: tuple[str, list[int]]) -> str:
    settings = ContextSettings(
        n_threads=1, n_seq_max=1, n_ctx=N_CTX, n_batch=STEP, n_ubatch=STEP, flash_attn=True, kv_type="f16"
    )
    with Vocabulary(qwen) as vocab, ReferenceModel(qwen, settings) as ref:
        t0 = time.monotonic()
        tokens, _ = ref.greedy(prompt[1], N_NEW)
        print(
            f"\nqwen whole model, one context, 1 thread: {len(prompt[1])} + {N_NEW} tokens "
            f"in {time.monotonic() - t0:.1f} s"
        )
        end = next((i for i, t in enumerate(tokens) if vocab.is_eog(t)), len(tokens))
        text = vocab.detokenize(tokens[:end])
    assert text.strip()  # the reference says something
    return text


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, qwen: Path) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("qwen-long"),
        model=qwen,
        n_nodes=2,
        layers=["0:14", "14:28"],
        gateway_args=["--prefix-exact", "--prefill-step-tokens", str(STEP)],
        # Three sessions' streams of the trained context each (the kept one, its fork, one spare):
        # every stream is cleared once at start, so eight of 32,768 positions on each of two nodes
        # sharing this machine would touch 15 GB at once.
        max_sessions=3,
        node_args=["--no-benchmark", "--batch-tokens", str(STEP), "--kv-pool-tokens", "-1"],
        timeout_s=900,
    )
    yield s
    s.stop()


def _gateway_metric(swarm: LocalSwarm, name: str) -> float:
    text = httpx.get(swarm.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name
    )


def test_a_16000_token_prompt_streamed_then_not_equals_the_whole_model(
    prompt: tuple[str, list[int]], want: str, swarm: LocalSwarm
) -> None:  # the reference first: its context is gone before the swarm starts
    client = openai.OpenAI(base_url=swarm.base_url, api_key="qwen-long", max_retries=0, timeout=3600)
    kwargs = dict(model=swarm.model_name, prompt=prompt[0], max_tokens=N_NEW, temperature=0)
    t0 = time.monotonic()
    first: float | None = None
    parts = []
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].text:
            first = first or time.monotonic()
            parts.append(chunk.choices[0].text)
    done = time.monotonic()
    assert first is not None
    print(
        f"\nqwen {len(prompt[1])} prompt tokens, cold: TTFT {first - t0:.1f} s, "
        f"then {len(parts) - 1} pieces in {done - first:.2f} s"
    )
    assert "".join(parts) == want

    reused_before = _gateway_metric(swarm, "swarm_gateway_prefix_reused_tokens_total")
    t1 = time.monotonic()
    whole = client.completions.create(**kwargs)
    print(f"qwen same prompt again (kept KV, exact steps): {time.monotonic() - t1:.1f} s")
    assert whole.choices[0].text == want
    # It started from the first request's kept KV (all of it but the last, partial prefill step): the
    # nodes kept 16,000 positions, bounded by their pools (max_kept_kv_tokens, 8,192, cut it before).
    reused = _gateway_metric(swarm, "swarm_gateway_prefix_reused_tokens_total") - reused_before
    print(f"qwen reused {reused:.0f} of {len(prompt[1])} prompt positions")
    assert reused >= len(prompt[1]) - 2 * STEP
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt[1])
    for node in swarm.nodes:
        load = node_load(node.port)
        assert load.active_sessions == 0 and load.kv_tokens_used == 0
