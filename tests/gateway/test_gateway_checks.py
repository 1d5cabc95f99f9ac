"""Spot checks through the real gateway and tracker processes, with scripted nodes on the real node stack.

Three disjoint routes of two stages ([0,15) and [15,30), three nodes each); the
gateway checks every request (``--check-fraction 1``). With honest nodes every
check passes and nobody is accused. With one liar -- a last stage that swaps
the sampled token, or a first stage that changes one output value by one
ulp -- the first checked request that touches it finds the divergence, a third
route judges it, the liar is excluded, and every answer the client received
is the honest text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fake_node import FAILURES, FakeNode
from swarm_fixtures import announce, metric_lines, scripted_nodes, url

from proto.announce import ModelSpec
from sim.procs import Supervisor

pytestmark = pytest.mark.slow  # real tracker and gateway processes

SCRIPT_TEXT = "Two routes compute the same words; a third decides when they do not agree."


def _swarm(
    tmp: Path,
    model_path: Path,
    fingerprint: str,
    first_seed: int,
    liar: tuple[int, str] | None,
    gateway_args: tuple[str, ...] = (),
) -> dict:
    fake = scripted_nodes(
        model_path,
        tmp / "cache",
        SCRIPT_TEXT,
        fingerprint,
        [(0, 15), (15, 30)] * 3,
        first_seed=first_seed,
    )
    if liar is not None:
        index, kind = liar
        fake.nodes[index].lie = kind
    model = ModelSpec(
        fingerprint=fingerprint, name="fake-checks", architecture="llama", n_layers=30, n_embd=576
    )
    sup = Supervisor(tmp)
    tracker = sup.start_tracker().ready(60)
    for i, node in enumerate(fake.nodes):
        # The third pair claims to be slow: the two routes the gateway caches are the first two pairs
        # (the liar is among them), and the third pair is there to judge.
        slow = 40.0 if i >= 4 else 10.0
        announce(url(tracker), node.key, model, node.start, node.end, node.port, decode_ms_per_token=slow)
    gateway = sup.start_gateway(
        tracker_url=url(tracker), extra_args=["--check-fraction", "1", *gateway_args]
    ).ready(60)
    return {"nodes": fake.nodes, "sup": sup, "gateway": gateway, "expected": fake.expected}


def _close(swarm: dict) -> None:
    swarm["sup"].stop_all()
    for node in swarm["nodes"]:
        node.stop()


def _checks(swarm: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in metric_lines(url(swarm["gateway"]), "swarm_gateway_checks_total"):
        outcome = line.split('outcome="')[1].split('"')[0]
        out[outcome] = float(line.split()[-1])
    return out


def _verdicts(swarm: dict) -> list[dict]:
    lines = swarm["gateway"].log_path.read_text(errors="replace").splitlines()
    return [json.loads(line) for line in lines if '"spot_check_verdict"' in line]


def _ask(swarm: dict, n: int, *, stream: bool = False) -> list[str]:
    client = openai.OpenAI(base_url=url(swarm["gateway"]) + "/v1", api_key="t", max_retries=0, timeout=60)
    out = []
    for _ in range(n):
        messages = [{"role": "user", "content": "go"}]
        if stream:
            chunks = client.chat.completions.create(model="fake-checks", stream=True, messages=messages)
            out.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        else:
            reply = client.chat.completions.create(model="fake-checks", messages=messages)
            out.append(reply.choices[0].message.content or "")
    return out


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[dict]:
    swarm = _swarm(tmp_path_factory.mktemp("checks-honest"), model_path, "c1" * 32, 60, None)
    try:
        yield swarm
    finally:
        _close(swarm)


def test_an_honest_swarm_passes_every_check_and_nobody_is_accused(honest: dict) -> None:
    answers = _ask(honest, 4) + _ask(honest, 2, stream=True)
    assert answers == [honest["expected"]] * 6
    checks = _checks(honest)
    assert checks.get("started", 0) >= 6 and checks.get("passed", 0) == checks["started"]
    assert checks.get("liar_caught", 0) == 0 and not _verdicts(honest)


def test_with_batch_isolation_checked_every_run_of_a_check_is_computed_alone(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> None:
    """``--batch-isolation checked``: the OPENs of the primary and the shadow carry
    ``OpenSession.isolated`` to every stage, and each node computes those sessions' steps in batches
    of their own (the scripted backend fails a batch that mixes an isolated job with another)."""
    swarm = _swarm(
        tmp_path_factory.mktemp("checks-isolated"),
        model_path,
        "c4" * 32,
        60,
        None,
        gateway_args=("--batch-isolation", "checked"),
    )
    try:
        assert _ask(swarm, 3) == [swarm["expected"]] * 3
        checks = _checks(swarm)
        assert checks.get("started", 0) >= 3 and checks.get("passed", 0) == checks["started"]
        served = [n.backend.slices for n in swarm["nodes"] if sum(n.backend.slices.values())]
        assert len(served) >= 4  # both stages of the primary and of the shadow
        assert all(s["isolated"] > 0 and s["shared"] == 0 for s in served), served
    finally:
        _close(swarm)


def test_a_checked_request_whose_routes_all_fail_ends_with_a_clean_error(honest: dict) -> None:
    # Every step after the third token fails on every node: the primary, then the shadow, give up
    # (after their recoveries); the client gets the error as an event, never an internal error.
    FAILURES.update(left=100, after=3)
    try:
        client = openai.OpenAI(
            base_url=url(honest["gateway"]) + "/v1", api_key="t", max_retries=0, timeout=60
        )
        stream = client.chat.completions.create(
            model="fake-checks", stream=True, messages=[{"role": "user", "content": "go"}]
        )
        texts: list[str] = []
        with pytest.raises(openai.APIError) as info:
            for chunk in stream:
                texts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
        assert "internal error" not in info.value.message
        with pytest.raises(openai.APIStatusError) as plain:
            client.chat.completions.create(model="fake-checks", messages=[{"role": "user", "content": "go"}])
        assert plain.value.status_code in (502, 503), plain.value.body
    finally:
        FAILURES.update(left=0)
    assert '"job_failed"' not in honest["gateway"].log_path.read_text(errors="replace")


@pytest.mark.parametrize(("liar", "kind"), [(1, "swap"), (0, "perturb")], ids=["swapped-sampler", "one-ulp"])
def test_a_liar_is_caught_excluded_and_the_client_only_sees_honest_text(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, liar: int, kind: str
) -> None:
    swarm = _swarm(
        tmp_path_factory.mktemp(f"checks-{kind}"),
        model_path,
        ("c2" if kind == "swap" else "c3") * 32,
        70 + liar * 10,
        (liar, kind),
    )
    try:
        liar_node: FakeNode = swarm["nodes"][liar]
        answers = _ask(swarm, 6) + _ask(swarm, 2, stream=True)
        assert answers == [swarm["expected"]] * 8  # before, at and after the detection
        verdicts = _verdicts(swarm)
        assert verdicts and {v["liar"] for v in verdicts} == {liar_node.node_id}
        assert _checks(swarm).get("liar_caught", 0) >= 1
        # Excluded: once caught, the liar opens no more sessions.
        opened = liar_node.backend.opened
        _ask(swarm, 3)
        assert liar_node.backend.opened == opened
    finally:
        _close(swarm)
