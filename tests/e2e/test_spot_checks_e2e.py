"""Spot checks against real lying nodes: tracker, gateway and node processes on loopback.

The swarm (``sim/liars.py``): two honest nodes per half of the model and, per
test, one node started with a test-only failpoint on the half where its lie
applies. The gateway runs with its defaults for checks (``check_fraction``
0.05; a node is checked on every request until it passed
``probation_checks`` = 3 checks here). Every answer the official ``openai``
client gets is compared with the whole model's greedy output in one plain
llama.cpp context: a liar must be named within a bounded number of requests
and no client may see a token it made up.

1. an honest swarm: every request is checked (all nodes are new), none is
   accused, the checks pass and the text is exact;
2. a node that lies from its first step is kept out by the tracker's join
   challenge (it never becomes routable);
3. liars that answer the join challenge honestly and lie afterwards: a last
   stage whose sampler was swapped (every token replaced by another), a first
   stage whose output is off by one ulp in one value (the smallest lie), a
   last stage that does not run the model at all (zeros and random tokens).
   Each is named by the gateway, excluded there, and banned by the tracker
   on the gateway's evidence.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sim.liars import (
    LIE_STAGE,
    LiarSwarm,
    chat,
    metric,
    requests_until_caught,
    start_liar_swarm,
    tracker_state,
    verdicts,
)
from tests.e2e.swarm_helpers import Reference

pytestmark = pytest.mark.slow

N_NEW = 12
QUESTIONS = ("What is the capital of France?", "Name three colours.", "Count to five.")
MAX_REQUESTS = 12  # a new liar is on probation: the first request through it is checked


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Iterator[dict[str, str]]:
    ref = Reference(model_path)
    try:
        yield {q: ref.chat(q, N_NEW) for q in QUESTIONS}
    finally:
        ref.close()


@pytest.fixture(scope="module")
def liar_swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LiarSwarm]:
    from node.shard import read_model_meta

    n_layers = read_model_meta(model_path, node_cache).n_layers
    ls = start_liar_swarm(
        tmp_path_factory.mktemp("liars"),
        model=model_path,
        node_cache=node_cache,
        n_layers=n_layers,
        check_fraction=0.05,
        probation_checks=3,
        # Warm prefixes are never checked (a shadow route holds no kept KV): off, so every
        # request is eligible and the count of requests to detection is the checks' alone.
        extra_gateway_args=["--kv-keep-s", "0"],
    )
    try:
        yield ls
    finally:
        ls.swarm.stop()


def test_an_honest_swarm_is_checked_and_never_accused(
    liar_swarm: LiarSwarm, reference: dict[str, str]
) -> None:
    base = liar_swarm.gateway_url
    client = liar_swarm.client()
    for q in QUESTIONS:
        assert chat(client, liar_swarm.swarm.model_name, q, N_NEW).text == reference[q]
    assert metric(base, "swarm_gateway_checks_total", outcome="started") == len(QUESTIONS)
    assert metric(base, "swarm_gateway_checks_total", outcome="passed") == len(QUESTIONS)
    assert metric(base, "swarm_gateway_checks_total", outcome="liar_caught") == 0
    assert metric(base, "swarm_gateway_checks_total", outcome="inconclusive") == 0
    assert verdicts(liar_swarm.swarm.gateway) == []


@pytest.mark.parametrize("kind", ["swap_sampler", "perturb_hidden", "no_model"])
def test_a_node_lying_from_its_first_step_never_gets_in(liar_swarm: LiarSwarm, kind: str) -> None:
    # The challenge compares with trusted nodes' answers: one node of the liar's span must be off
    # probation first (spot checks passed), else any newcomer is let in on probation.
    liar_swarm.earn_trust(LIE_STAGE[kind], QUESTIONS, N_NEW)
    liar = liar_swarm.start_node_only(kind, honest_steps=0)
    try:
        node_id = liar.extra["node_id"]
        deadline = time.monotonic() + 120
        while (state := tracker_state(liar_swarm.swarm.tracker_url, node_id)) in (None, "challenging"):
            assert time.monotonic() < deadline, f"the tracker never finished challenging {kind}"
            time.sleep(0.2)
        assert state == "challenge_failed"
    finally:
        liar_swarm.stop_liar(liar)


@pytest.mark.parametrize("kind", ["swap_sampler", "perturb_hidden", "no_model"])
def test_a_lying_node_is_named_and_no_client_sees_its_lie(
    liar_swarm: LiarSwarm, reference: dict[str, str], kind: str
) -> None:
    # A liar that claims speed serves at once (see LiarSwarm.start_liar): without the claim, whether
    # routing preferred it over the honest nodes of its half depended on this machine's speed.
    liar = liar_swarm.start_liar(kind, claim_speed=True)
    try:
        found = requests_until_caught(
            liar_swarm,
            liar,
            kind,
            QUESTIONS,
            reference.__getitem__,
            n_new=N_NEW,
            max_requests=MAX_REQUESTS,
        )
        print(
            f"{kind}: caught after {found.requests} requests ({found.through_liar} through it) "
            f"in {found.seconds:.1f} s: {found.verdict}"
        )
        assert found.wrong_answers == 0
        assert found.through_liar > 0, f"routing never sent the {kind} liar a request"
        assert found.caught, f"{kind} not caught in {found.requests} requests: {found.verdict}"
        assert found.verdict is not None and found.verdict["stage"] == (1 if kind != "perturb_hidden" else 0)
        # The liar is avoided from now on: later requests are exact and never routed through it.
        before = metric(liar_swarm.gateway_url, "swarm_gateway_checks_total", outcome="liar_caught")
        again = requests_until_caught(
            liar_swarm, liar, kind, QUESTIONS, reference.__getitem__, n_new=N_NEW, max_requests=4
        )
        assert again.wrong_answers == 0 and not again.caught
        assert metric(liar_swarm.gateway_url, "swarm_gateway_checks_total", outcome="liar_caught") == before
        # The gateway's evidence reached the tracker (reported every 2 s), which banned the key.
        deadline = time.monotonic() + 30
        while tracker_state(liar_swarm.swarm.tracker_url, found.node_id) != "banned":
            assert time.monotonic() < deadline, "the tracker did not ban the liar on the gateway's evidence"
            time.sleep(0.2)
    finally:
        liar_swarm.stop_liar(liar)
