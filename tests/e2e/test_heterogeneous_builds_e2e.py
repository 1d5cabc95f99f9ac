"""Two llama.cpp builds of other CPU feature levels in one swarm, checking each other: never accused.

Opt-in: needs the second build ``scripts/build-alt-llama`` makes (12+ minutes on two cores; CI does
not build it) at ``$ALT_LLAMA_DIR/lib`` (default ``/work/alt-llama/lib``); skipped without it.

The swarm: the bundled SmolLM2 split in two halves, each half held by one node on this venv's
llama.cpp (AVX2, FMA) and one node on the alt build (AVX2, FMA and BMI2 off): four nodes whose
runtime recipes are one (the same release: they compose routes) but whose check fingerprints are
two. The gateway checks every request (``check_fraction`` 1, ``probation_checks`` 0): every
check compares runs on routes of other check fingerprints, so the cross-recipe tolerance
(gateway/checks.py ``Tolerance``) decides, and a judge is always at hand (the other pair). Greedy
chats are sent one after another; none may fail, no node may be named a liar, the tracker may ban
nobody. How many checks passed and how many parted at a near tie (accepted) is printed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from sim.launcher import LocalSwarm, _wait_announced, start_local_swarm
from sim.liars import chat, metric, verdicts
from sim.procs import Service
from sim.reference import Reference

pytestmark = pytest.mark.slow

ALT_LIB = Path(os.environ.get("ALT_LLAMA_DIR", "/work/alt-llama")) / "lib"
N_NEW = 24
QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Write one sentence about the sea.",
    "Who wrote Hamlet?",
    "What do bees make?",
    "List the planets of the solar system.",
    "What is a prime number?",
)
ROUNDS = 3  # every question this many times: 24 checked requests


@pytest.fixture(scope="module")
def mixed_swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    if not (ALT_LIB / "libllama.so").is_file():
        pytest.skip(f"no second llama.cpp build at {ALT_LIB}: run scripts/build-alt-llama (opt-in test)")
    from node.shard import read_model_meta

    n_layers = read_model_meta(model_path, node_cache).n_layers
    half = n_layers // 2
    halves = (f"0:{half}", f"{half}:{n_layers}")
    swarm = start_local_swarm(
        tmp_path_factory.mktemp("builds"),
        model=model_path,
        n_nodes=2,
        layers=list(halves),
        node_cache=node_cache,
        gateway_args=[
            "--route-ttl-s",
            "1",
            "--check-fraction",
            "1",
            "--probation-checks",
            "0",
            "--kv-keep-s",
            "0",
        ],
        node_args=["--no-benchmark"],
        # The alt nodes have no trusted node of their check fingerprint to be challenged against:
        # they join on probation; no routing penalty for it, so routes mix the builds freely.
        tracker_args=["--probation-penalty-ms", "0"],
    )
    alt: list[Service] = []
    try:
        for i, layers in enumerate(halves):
            node = swarm.supervisor.start_node(
                f"alt-{i}",
                model=model_path,
                layers=layers,
                tracker_url=swarm.tracker_url,
                cache_dir=node_cache,
                extra_args=["--no-benchmark"],
                env={"LLAMA_CPP_LIB_PATH": str(ALT_LIB)},
            )
            node.wait_port(120)
            _wait_announced(swarm.tracker_url, node, 120)
            alt.append(node)
        yield swarm
    finally:
        swarm.stop()


def test_two_builds_check_each_other_and_nobody_is_accused(mixed_swarm: LocalSwarm, model_path: Path) -> None:
    ref = Reference(model_path)
    try:
        expected = {q: ref.chat(q, N_NEW) for q in QUESTIONS}
    finally:
        ref.close()
    base = f"http://127.0.0.1:{mixed_swarm.gateway.port}"
    client = openai.OpenAI(base_url=mixed_swarm.base_url, api_key="test", max_retries=0, timeout=120)
    same = 0
    for _ in range(ROUNDS):
        for q in QUESTIONS:
            answer = chat(client, mixed_swarm.model_name, q, N_NEW)
            assert answer.text, f"no text for {q!r}"
            same += int(answer.text == expected[q])
    requests = ROUNDS * len(QUESTIONS)
    started = metric(base, "swarm_gateway_checks_total", outcome="started")
    passed = metric(base, "swarm_gateway_checks_total", outcome="passed")
    parted = metric(base, "swarm_gateway_checks_total", outcome="parted")
    cross = metric(base, "swarm_gateway_cross_recipe_checks_total")
    print(
        f"\n{requests} greedy chats, every one checked: started {started:g}, cross-recipe {cross:g}, "
        f"passed {passed:g}, parted at a near tie {parted:g}; answers equal to this build's whole "
        f"model: {same} of {requests}"
    )
    assert started == requests
    assert cross == requests, "every check must compare the two builds"
    assert metric(base, "swarm_gateway_checks_total", outcome="liar_caught") == 0
    assert metric(base, "swarm_gateway_checks_total", outcome="inconclusive") == 0
    assert passed + parted == requests
    assert verdicts(mixed_swarm.gateway) == []
    assert httpx.get(f"{mixed_swarm.tracker_url}/v1/trust/bans", timeout=10).json()["nodes"] == []
