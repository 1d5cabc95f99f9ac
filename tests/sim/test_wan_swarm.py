"""A whole swarm on the emulated WAN, started the way ``swarm-sim up --wan`` starts it (needs root).

Tracker, gateway and two nodes each run in their own network namespace, bound to
their 10.77.h.2 address, 10 ms one way apart (the bundled ``link-10ms``). The
official ``openai`` client in this (root) namespace reaches the gateway through
the loopback forwarder, which enters the WAN at the ``client`` host. The text
must equal the whole model's greedy output.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from sim.launcher import LocalSwarm, start_local_swarm
from sim.wan import netns
from sim.wan.profile import load_profile
from sim.wan.support import unavailable_reason
from tests.e2e.swarm_helpers import Reference

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"emulated WAN unavailable: {REASON}"),
]

QUESTION = "What is the capital of France?"
N_NEW = 16


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("wan-swarm"),
        model=model_path,
        n_nodes=2,
        node_cache=node_cache,
        node_args=["--no-benchmark"],
        wan_profile=load_profile("link-10ms"),
    )
    yield s
    names = s.wan.namespaces() if s.wan else []
    s.stop()
    assert not set(names) & set(netns.list_namespaces())


def test_each_service_runs_in_its_own_namespace_on_its_wan_address(swarm: LocalSwarm) -> None:
    wan = swarm.wan
    assert wan is not None
    for svc in [swarm.tracker, swarm.gateway, *swarm.nodes]:
        assert netns.run(["ip", "netns", "identify", str(svc.pid)]).strip() == wan.host(svc.name).netns
    registry = httpx.get(f"{swarm.tracker_url}/v1/swarm", timeout=10).json()["nodes"]
    announced = sorted(a for n in registry for a in n["addresses"])
    assert announced == sorted(f"{wan.address(n.name)}:{n.port}" for n in swarm.nodes)
    assert sorted(n.extra["span"] for n in swarm.nodes) == [(0, 15), (15, 30)]


def test_openai_client_gets_the_whole_models_greedy_text_across_the_wan(
    swarm: LocalSwarm, model_path: Path
) -> None:
    assert swarm.wan is not None
    reference = Reference(model_path)
    try:
        want = reference.chat(QUESTION, N_NEW)
    finally:
        reference.close()
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-wan", max_retries=0, timeout=120)
    before = swarm.wan.delayer_stats().packets
    t0 = time.monotonic()
    got = client.chat.completions.create(
        model=swarm.model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=N_NEW,
        temperature=0,
    )
    elapsed_ms = (time.monotonic() - t0) * 1e3
    assert got.choices[0].message.content == want
    # Every hop crossed the delayer: at least client -> gateway -> each stage and back per token.
    assert swarm.wan.delayer_stats().packets - before >= 2 * N_NEW
    # A lower bound only: the client's request and answer alone cross 2 x 10 ms.
    assert elapsed_ms >= 20
