"""Long prompts through a 2-node swarm whose nodes run a KV pool (``--kv-pool-tokens``).

Real tracker, node and gateway processes on loopback; the official ``openai``
client. A prompt of about 6,000 tokens (SmolLM2 was trained for 8,192; the
per-sequence layout's 2,048-position slots refused it) gives exactly the text
llama-cpp-python's own ``Llama`` gives for the whole model in one context
(flash attention on, f16 KV, greedy, one thread, prompt cache reset), streamed
and not; afterwards no session holds KV and the pools hold only the
warm-kept conversations.
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
NAMES = ["Albatross", "Heron", "Marigold", "North Star", "Swift", "Pelican", "Orca", "Juniper"]
GOODS = ["salt", "wool", "timber", "copper", "grain", "wine", "cloth", "tea"]


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
    """A harbour ledger of about 6,000 tokens that ends mid-entry, so the model has something to say."""
    text = "The harbour master's ledger, in order of arrival:\n"
    with Vocabulary(model_path) as v:
        i = 0
        while True:
            line = (
                f"Ship {i + 1}: the {NAMES[i % 8]}, carrying {GOODS[(i * 3) % 8]}, arrived on day "
                f"{i * 7 % 31 + 1} and left on day {(i * 7 + 3) % 31 + 1}.\n"
            )
            if len(v.tokenize(text + line)) >= 5990:
                break
            text += line
            i += 1
        text += f"Ship {i + 1}: the"
        assert 5950 <= len(v.tokenize(text)) <= 6000
    return text


@pytest.fixture(scope="module")
def want(llm: llama_cpp.Llama, long_prompt: str) -> str:
    llm.reset()  # no prompt-cache reuse: the whole prompt is evaluated as the nodes do
    out = llm.create_completion(long_prompt, max_tokens=N_NEW, temperature=0.0, repeat_penalty=1.0)
    text = out["choices"][0]["text"]
    assert text.strip()  # the reference says something
    return text


def _pool_gauges(admin_port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=10).text
    return {
        name: float(value)
        for name, value in re.findall(
            r"^(swarm_node_kv_pool_\w+|swarm_node_kv_tokens_capacity|swarm_node_kept_\w+) (\S+)$", text, re.M
        )
    }


def test_a_6000_token_prompt_equals_llama_cpp_python(swarm: LocalSwarm, want: str, long_prompt: str) -> None:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=900)
    kwargs = dict(model=swarm.model_name, prompt=long_prompt, max_tokens=N_NEW, temperature=0)
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].text == want
    assert whole.usage is not None and whole.usage.prompt_tokens >= 5950


def test_a_6000_token_prompt_streamed_equals_llama_cpp_python(
    swarm: LocalSwarm, want: str, long_prompt: str
) -> None:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=900)
    kwargs = dict(model=swarm.model_name, prompt=long_prompt, max_tokens=N_NEW, temperature=0)
    parts = client.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in parts if c.choices) == want


def test_the_pools_are_announced_and_hold_only_kept_sessions_after_the_requests(swarm: LocalSwarm) -> None:
    """No session holds KV any more; what the pool still holds is the warm-kept conversations
    (Release.keep_ms, freed when their keep time ends), block for block."""
    for node in swarm.nodes:
        load = node_load(node.port)
        assert load.active_sessions == 0 and load.kv_tokens_used == 0
        gauges = _pool_gauges(node.admin_port)
        assert gauges["swarm_node_kv_pool_blocks"] == POOL_TOKENS // 16
        assert gauges["swarm_node_kv_tokens_capacity"] == POOL_TOKENS
        # The configured pool was checked against the node's memory at start: RAM held it (no device here).
        text = httpx.get(f"http://127.0.0.1:{node.admin_port}/metrics", timeout=10).text
        ram = re.findall(r'^swarm_node_kv_pool_bound_tokens\{[^}]*memory="RAM [^}]*\} (\S+)$', text, re.M)
        assert len(ram) == 1 and float(ram[0]) >= POOL_TOKENS, ram
        used = gauges["swarm_node_kv_pool_blocks"] - gauges["swarm_node_kv_pool_free_blocks"]
        kept, kept_sessions = gauges["swarm_node_kept_kv_tokens"], gauges["swarm_node_kept_sessions"]
        assert -(-kept // 16) <= used <= -(-kept // 16) + kept_sessions
