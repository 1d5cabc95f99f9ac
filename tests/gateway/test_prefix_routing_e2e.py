"""Prefix-aware routing across gateways, real processes (swarm-tracker, three SmolLM2 swarm-node
processes, two swarm-gateway processes, loopback).

Route "ab" = a [0,15) > b [15,30) starts alone; gateway 1 serves one API key of a chat app whose
requests carry a ~1,500-token system prompt there, and its KV stays kept on a and b. Then node c (the
whole model, [0,30)) joins, and a *fresh* gateway 2 -- which has never seen the prompt, so nothing in
its own memory points at route ab, and which caches one route only (``--routes-k 1``: c, the
cheapest) -- serves a second API key with the same system prompt: none of its cached routes shows a
prefix of the prompt, so it looks routes up naming the prompt's block heads; the tracker prices the
prefix the nodes' heartbeats reported (tracker.routing, prefix_heads) and answers ab, where each stage
copies the kept prefix -- as far as the two prompts share it in whole prefill steps, past the heads'
ladder step (1,024) -- and computes only the rest (node metrics), while a cold request of gateway 2
runs on c. Every text equals a cold request's (on c: the whole model in one process).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from swarm_fixtures import metric_lines, url, wait_until

from sim.procs import Service, Supervisor

pytestmark = pytest.mark.slow

SESSION_KV = 2048
SYSTEM = (
    "You are the assistant of a weather app. Answer in one short sentence, name the city, "
    "and never invent a forecast you were not given. "
) * 55


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[Supervisor]:
    s = Supervisor(tmp_path)
    try:
        yield s
    finally:
        s.stop_all()


def counter(node: Service, name: str, label: str = "") -> float:
    lines = metric_lines(f"http://127.0.0.1:{node.admin_port}", name)
    return sum(float(x.split()[-1]) for x in lines if not x.startswith("#") and label in x)


def prefilled(node: Service) -> float:
    return counter(node, "swarm_node_tokens_processed_total", 'phase="prefill"')


def ask(gateway: Service, key: str, question: str, model: str, cache: bool = True) -> tuple[str, int]:
    client = openai.OpenAI(base_url=url(gateway) + "/v1", api_key=key, max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        temperature=0,
        max_tokens=8,
        extra_body={"cache_prompt": cache},
    )
    return r.choices[0].message.content or "", r.usage.prompt_tokens if r.usage else 0


def test_a_fresh_gateway_routes_a_shared_system_prompt_to_the_nodes_reporting_it(
    sup: Supervisor, model_path: Path, node_cache: Path
) -> None:
    # Nodes trusted from the start (tracker and gateways) and no spot checks: every request runs on one
    # route, so each node's counters tell where it ran (a checked request also runs on a second route;
    # and a warm request never goes through a node on probation that another route could check).
    tracker = sup.start_tracker(extra_args=["--heartbeat-interval-s", "1", "--probation-checks", "0"]).ready(
        60
    )

    def node(name: str, layers: str) -> Service:
        return sup.start_node(
            name,
            model=model_path,
            layers=layers,
            tracker_url=url(tracker),
            max_sessions=6,
            session_kv_tokens=SESSION_KV,
            cache_dir=node_cache,
            admin=True,
            extra_args=[
                *("--batch-tokens", "256", "--max-session-kv-tokens", str(SESSION_KV)),
                "--no-benchmark",
            ],
        )

    a, b = node("a", "0:15"), node("b", "15:30")
    a, b = a.ready(120), b.ready(120)

    def models() -> list[dict]:
        return httpx.get(url(tracker) + "/v1/models", timeout=10).json()["models"]

    model = wait_until(lambda: next((m for m in models() if m.get("routable")), None), 60, "route ab")
    name = str(model["name"])
    gw1 = sup.start_gateway(
        tracker_url=url(tracker),
        name="gw1",
        extra_args=[
            "--prefix-exact",
            "--kv-keep-s",
            "300",
            "--check-fraction",
            "0",
            "--probation-checks",
            "0",
        ],
    ).ready(60)
    # A user of the app on gateway 1 (route ab is the only one): the session stays kept on a and b.
    text_1, _ = ask(gw1, "weather-user-1", "Is it raining in Lyon?", name)
    assert counter(a, "swarm_node_prefix_cached_blocks") >= 90  # ~1,500 positions kept

    def reported(node_id: str) -> list[str]:
        nodes = httpx.get(url(tracker) + "/v1/swarm", timeout=10).json()["nodes"]
        shard = next(n["shard"] for n in nodes if n["node_id"] == node_id)
        return list(shard["prefix_heads"] or [])

    ids = {
        k: httpx.get(f"http://127.0.0.1:{n.admin_port}/status", timeout=10).json()["node_id"]
        for k, n in (("a", a), ("b", b))
    }
    wait_until(lambda: reported(ids["a"]) and reported(ids["b"]), 60, "a and b reporting prefix heads")

    c = node("c", "0:30").ready(120)
    c_id = httpx.get(f"http://127.0.0.1:{c.admin_port}/status", timeout=10).json()["node_id"]

    def c_live() -> bool:
        nodes = httpx.get(url(tracker) + "/v1/swarm", timeout=10).json()["nodes"]
        return any(n["node_id"] == c_id and n["state"] == "live" and n["shard"] for n in nodes)

    wait_until(c_live, 60, "node c live at the tracker")
    gw2 = sup.start_gateway(
        tracker_url=url(tracker),
        name="gw2",
        extra_args=["--prefix-exact", "--check-fraction", "0", "--probation-checks", "0"],
    ).ready(60)
    stages = {"a": a, "b": b, "c": c}

    def prefill_now() -> dict[str, float]:
        return {k: prefilled(n) for k, n in stages.items()}

    def hits_now() -> dict[str, float]:
        return {k: counter(stages[k], "swarm_node_prefix_lookups_total", 'outcome="hit"') for k in "ab"}

    # A cold request of gateway 2 (no reuse asked): where it goes without a prefix to prefer.
    before = prefill_now()
    cold_1, _ = ask(gw2, "weather-cold", "Is it raining in Lyon?", name, cache=False)
    after = prefill_now()
    assert {k for k in stages if after[k] > before[k]} == {"c"}, "the cold request takes the one-hop route"

    # The second user, on gateway 2: its cached route (c) shows nothing of the prompt; the look-up
    # naming the prompt's heads gets ab from the tracker (the prefix priced), prefix copied there.
    before, hits = prefill_now(), hits_now()
    reused_before = counter(a, "swarm_node_prefix_reused_tokens_total")
    text_2, prompt_2 = ask(gw2, "weather-user-2", "Is it windy in Porto?", name)
    after = prefill_now()
    computed = {k: after[k] - before[k] for k in stages}
    reused = counter(a, "swarm_node_prefix_reused_tokens_total") - reused_before
    assert computed["c"] == 0, computed
    assert {k: v - hits[k] for k, v in hits_now().items()} == {"a": 1, "b": 1}
    # Whole prefill steps (256) of the system prompt were copied -- all the steps the two prompts
    # share, not the 1,024 positions of the heads' ladder; each stage computed only the rest (the
    # question and what is left of the system prompt after its last whole step).
    assert reused > 1024 and reused % 256 == 0, reused
    assert prompt_2 - reused < 256 + 32, (prompt_2, reused)
    assert computed["a"] == computed["b"] == prompt_2 - reused, (computed, prompt_2, reused)
    assert 0 < counter(a, "swarm_node_prefix_hit_ratio") < 1

    # Every text equals a cold request's, computed by c alone (the whole model).
    assert text_1 == cold_1
    assert text_2 == ask(gw2, "weather-cold", "Is it windy in Porto?", name, cache=False)[0]
