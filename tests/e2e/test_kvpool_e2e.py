"""Long prompts through a 2-node swarm whose nodes run a KV pool (``--kv-pool-tokens``).

Real tracker, node and gateway processes on loopback; the official ``openai``
client. A prompt of about 6,000 tokens (SmolLM2 was trained for 8,192; the
per-sequence layout's 2,048-position slots refused it) gives exactly the text
llama-cpp-python's own ``Llama`` gives for the whole model in one context
(flash attention on, f16 KV, greedy, one thread, prompt cache reset), streamed
and not; afterwards the nodes hold no KV and their pools are empty again.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import llama_cpp
import openai
import pytest

from common.vocab import Vocabulary
from sim.launcher import LocalSwarm, start_local_swarm
from tests.e2e.swarm_helpers import node_load

pytestmark = pytest.mark.slow

N_NEW = 24
POOL_TOKENS = 16384  # the memory of today's 8 x 2048 slots
PARAGRAPH = (
    "The harbour town kept its records in a tall stone building by the quay. Every ship that came in was "
    "written down: its name, its captain, the goods it carried and the day it left again. "
)


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("kvpool-swarm"),
        model=model_path,
        n_nodes=2,
        node_cache=node_cache,
        node_args=["--no-benchmark", "--kv-pool-tokens", str(POOL_TOKENS)],
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(model_path: Path) -> Iterator[llama_cpp.Llama]:
    model = llama_cpp.Llama(
        model_path=str(model_path),
        n_ctx=8192,
        n_batch=512,
        n_ubatch=512,
        n_threads=1,
        n_threads_batch=1,
        flash_attn=True,
        verbose=False,
    )
    yield model
    model.close()


@pytest.fixture(scope="module")
def long_prompt(model_path: Path) -> str:
    with Vocabulary(model_path) as v:
        text = ""
        while len(v.tokenize(text + PARAGRAPH)) < 6000:
            text += PARAGRAPH
        n = len(v.tokenize(text))
    assert 5900 <= n < 6000
    return text + "Which ships are written down, and what is recorded about each?"


def ref_completion(llm: llama_cpp.Llama, prompt: str) -> str:
    llm.reset()  # no prompt-cache reuse: the whole prompt is evaluated as the nodes do
    out = llm.create_completion(prompt, max_tokens=N_NEW, temperature=0.0, repeat_penalty=1.0)
    return out["choices"][0]["text"]


def completion(client: openai.OpenAI, model: str, prompt: str, stream: bool) -> str:
    kwargs = dict(model=model, prompt=prompt, max_tokens=N_NEW, temperature=0)
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)


def _pool_gauges(admin_port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=10).text
    return {
        name: float(value)
        for name, value in re.findall(
            r"^(swarm_node_kv_pool_\w+|swarm_node_kv_tokens_capacity) (\S+)$", text, re.M
        )
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_6000_token_prompt_equals_llama_cpp_python(
    swarm: LocalSwarm, llm: llama_cpp.Llama, long_prompt: str, stream: bool
) -> None:
    want = ref_completion(llm, long_prompt)
    assert want.strip()
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=600)
    assert completion(client, swarm.model_name, long_prompt, stream) == want
    usage = client.completions.create(model=swarm.model_name, prompt=long_prompt, max_tokens=1, temperature=0)
    assert usage.usage is not None and usage.usage.prompt_tokens >= 5900


def test_the_pools_are_announced_and_empty_after_the_requests(swarm: LocalSwarm) -> None:
    for node in swarm.nodes:
        load = node_load(node.port)
        assert load.active_sessions == 0 and load.kv_tokens_used == 0
        gauges = _pool_gauges(node.admin_port)
        assert gauges["swarm_node_kv_pool_blocks"] == POOL_TOKENS // 16
        assert gauges["swarm_node_kv_pool_free_blocks"] == POOL_TOKENS // 16
        assert gauges["swarm_node_kv_tokens_capacity"] == POOL_TOKENS
