"""Preempted sessions resume with the same text, through a real 2-node swarm (SmolLM2, real llama.cpp).

Real tracker, node and gateway processes on loopback; the official ``openai``
client. The last stage runs with the test-only failpoint ``preempt_every=6,
preempt_times=4`` (node/failpoints.py): instead of every 6th token it samples
it answers STATUS_PREEMPTED / RETRY_RESUME, four times in all, as a node whose
KV pool ran out does for its youngest session. That is how the gateway's side
is exercised on real nodes before the pool's own preemption (branch
pool-node) is on main: the gateway releases the session on both stages, waits
for room, and resumes it by re-prefilling the prompt and every token
generated so far.

- A greedy stream preempted twice and a sampled request (seed, frequency
  penalty) preempted twice give exactly the text the same requests give
  undisturbed (asked again once the failpoint is spent).
- The gateway counted four resumed preemptions; afterwards neither node holds
  a session or any KV.

``test_a_pool_too_small_for_the_load_makes_requests_wait_and_every_text_stays_exact``:
four concurrent requests through a swarm whose nodes' KV pools hold two of
them (``--kv-pool-tokens``): the gateway's KV admission (prompt plus
max_tokens against the free KV the nodes announced, less what it committed
since) holds the others back until room returns -- none is refused, every
text equals the request alone, and the pools are empty afterwards. (The nodes'
own preemption under such a load is what happens when admission is wrong or
blind, e.g. several gateways on one swarm: node-level tests cover it,
tests/node/test_kvpool_preemption.py.) It skips, naming what is missing, where
the node has no pool preemption.
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from node.failpoints import CONSENT, CONSENT_ENV, ENV
from sim.launcher import LocalSwarm, start_local_swarm
from sim.procs import Service, Supervisor
from tests.e2e.swarm_helpers import live_nodes, node_load, wait_until

pytestmark = pytest.mark.slow

N_NEW = 20
QUESTION = "Describe a walk along the sea shore on a windy autumn morning."


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path) -> Iterator[dict]:
    sup = Supervisor(tmp_path_factory.mktemp("preempt-swarm"))
    try:
        tracker = sup.start_tracker()
        tracker.wait_port(120)
        tracker_url = f"http://127.0.0.1:{tracker.port}"
        wait_until(lambda: httpx.get(f"{tracker_url}/healthz", timeout=5).status_code == 200, 60, "tracker")
        nodes: list[Service] = []
        for name, span, env in (
            ("node1", "0:15", None),
            ("node2", "15:30", {ENV: "preempt_every=6,preempt_times=4", CONSENT_ENV: CONSENT}),
        ):
            node = sup.start_node(
                name,
                model=model_path,
                layers=span,
                tracker_url=tracker_url,
                cache_dir=node_cache,
                extra_args=["--no-benchmark"],
                env=env,
            )
            node.wait_port(120)
            nodes.append(node)
        wait_until(lambda: len(live_nodes(tracker_url)) == 2, 120, "both nodes announced")
        gateway = sup.start_gateway(
            tracker_url=tracker_url,
            tracker_id=str(tracker.extra["tracker_id"]),
            # No warm KV kept (a node holding KV afterwards leaked it), no spot checks (one route).
            extra_args=["--kv-keep-s", "0", "--check-fraction", "0"],
        )
        gateway.wait_port(120)
        base = f"http://127.0.0.1:{gateway.port}"

        def routable() -> str | None:
            models = httpx.get(f"{base}/v1/models", timeout=10).json().get("data", [])
            return next((m["id"] for m in models if m.get("routable", True)), None)

        name = wait_until(routable, 120, "the gateway lists the model")
        yield {"base": base, "model": name, "nodes": nodes, "gateway": gateway}
    finally:
        sup.stop_all()


def _resumed(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    found = re.search(r'^swarm_gateway_preemptions_total\{outcome="resumed"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_preempted_requests_resume_with_exactly_the_undisturbed_text(swarm: dict) -> None:
    client = openai.OpenAI(base_url=swarm["base"] + "/v1", api_key="sk-e2e", max_retries=0, timeout=120)
    greedy: dict[str, Any] = dict(
        model=swarm["model"],
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=N_NEW,
        temperature=0,
    )
    sampled: dict[str, Any] = dict(
        greedy, temperature=0.9, top_p=0.95, seed=11, frequency_penalty=0.6, max_tokens=N_NEW
    )

    def stream(kwargs: dict[str, Any]) -> str:
        chunks = client.chat.completions.create(stream=True, **kwargs)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def whole(kwargs: dict[str, Any]) -> str:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "length"  # 20 tokens: every one of them generated
        return reply.choices[0].message.content or ""

    assert _resumed(swarm["base"]) == 0
    preempted_greedy = stream(greedy)  # the last stage's samples 6 and 12 are preemptions
    preempted_sampled = whole(sampled)  # ... and 18 + 6 = 24 and 30 (20 + 2 resumed samples before)
    assert _resumed(swarm["base"]) == 4, "the failpoint did not preempt four times"
    assert preempted_greedy == stream(greedy)  # the failpoint is spent: undisturbed now
    assert preempted_sampled == whole(sampled)
    assert _resumed(swarm["base"]) == 4
    # Nothing leaked: both stages freed every session (the preempting one included).
    for node in swarm["nodes"]:
        wait_until(
            lambda n=node: (load := node_load(n.port)).active_sessions == 0 and load.kv_tokens_used == 0,
            30,
            f"{node.name} holds no session",
        )


POOL_TOKENS = 256  # the smallest pool a node takes; each request below needs ~85 positions: 6 blocks
# of 16 on each stage, so two fit at full length, not four
N_CONCURRENT = 4
N_LIST = 64  # tokens each request generates (lists that do not end early)
PROMPTS = [
    "The numbers from one to one hundred, in words: one, two, three,",
    "The days of the week, over and over: Monday, Tuesday, Wednesday,",
    "The letters of the alphabet, spelled out: a, b, c, d, e,",
    "The months of the year, again and again: January, February, March,",
]


@pytest.fixture(scope="module")
def small_pool_swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    """The 2-node swarm with small pools."""
    from node.metrics import SPECS as NODE_METRICS

    if "swarm_node_kv_preemptions_total" not in NODE_METRICS:  # checked before any process starts
        pytest.skip(
            "the node does not preempt (no swarm_node_kv_preemptions_total among its metrics): the "
            "node's KV pool preemption (branch pool-node) is not on this main"
        )
    # Routes (and so the nodes' announced free KV) cached for 1 s only.
    gateway_args = ["--kv-keep-s", "0", "--check-fraction", "0", "--kv-wait-s", "120", "--route-ttl-s", "1"]
    s = start_local_swarm(
        tmp_path_factory.mktemp("small-pool-swarm"),
        model=model_path,
        n_nodes=2,
        node_cache=node_cache,
        node_args=["--no-benchmark", "--kv-pool-tokens", str(POOL_TOKENS)],
        gateway_args=gateway_args,
    )
    yield s
    s.stop()


def _kv_waits_served(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    found = re.search(r'^swarm_gateway_kv_waits_total\{outcome="served"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_pool_too_small_for_the_load_makes_requests_wait_and_every_text_stays_exact(
    small_pool_swarm: LocalSwarm,
) -> None:
    swarm = small_pool_swarm
    # The gateway admits by what the heartbeats announce: wait for the first ones with the pool's size.
    wait_until(
        lambda: all(n.get("shard", {}).get("kv_pool_tokens") for n in live_nodes(swarm.tracker_url)),
        60,
        "heartbeats announcing the pools",
    )
    base = swarm.base_url.removesuffix("/v1")
    clients = [openai.OpenAI(base_url=f"{base}/v1", api_key="sk-e2e", max_retries=0, timeout=120)]

    def ask(client: openai.OpenAI, prompt: str) -> str:
        reply = client.completions.create(
            model=swarm.model_name, prompt=prompt, max_tokens=N_LIST, temperature=0
        )
        assert reply.choices[0].finish_reason == "length"  # every request grows to its full size
        return reply.choices[0].text

    alone = [ask(clients[0], p) for p in PROMPTS]  # one at a time: the pool holds each

    # One gateway, four at once: it admits what the announced free KV, less what it committed since,
    # holds (prompt plus max_tokens: two of the four); the others wait their turn, none is refused.
    waited = _kv_waits_served(base)
    with concurrent.futures.ThreadPoolExecutor(N_CONCURRENT) as pool:
        together = list(pool.map(lambda p: ask(clients[0], p), PROMPTS))
    assert together == alone
    assert _kv_waits_served(base) > waited, "the gateway admitted more than the pools hold"

    for node in swarm.nodes:
        wait_until(
            lambda n=node: (load := node_load(n.port)).active_sessions == 0 and load.kv_tokens_used == 0,
            30,
            f"{node.name}'s pool is back to empty",
        )
