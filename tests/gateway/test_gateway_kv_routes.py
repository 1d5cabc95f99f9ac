"""A prompt too long for the cheapest route goes to a route whose nodes can hold it.

Real gateway and tracker processes, scripted nodes (no model) on real gRPC:
route A ([0,15) + [15,30)) grants 512 positions per session and is announced
faster, so the gateway picks it first; route B grants 4096 (what a node with a
KV pool serves). A 1,000-token prompt is answered through route B; a prompt
neither route can hold is refused with 413 ``prompt_too_long`` naming 4096, the
largest context the swarm can serve.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from swarm_fixtures import announce, metric_lines, scripted_nodes, url

from common.vocab import Vocabulary
from proto.announce import ModelSpec
from sim.procs import Supervisor

pytestmark = pytest.mark.slow  # real tracker and gateway processes

FINGERPRINT = "fb" * 32
MODEL = ModelSpec(
    fingerprint=FINGERPRINT, name="fake-kv-model", architecture="llama", n_layers=30, n_embd=576
)
SCRIPT_TEXT = "The long one fits over there."


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("fake-kv-swarm")
    spans = [(0, 15), (15, 30)]
    short = scripted_nodes(
        model_path, tmp / "cache", SCRIPT_TEXT, FINGERPRINT, spans, first_seed=40, kv_per_session=512
    )
    long = scripted_nodes(
        model_path, tmp / "cache", SCRIPT_TEXT, FINGERPRINT, spans, first_seed=42, kv_per_session=4096
    )
    sup = Supervisor(tmp)
    try:
        tracker = sup.start_tracker(extra_args=["--no-challenges", "--probation-checks", "0"]).ready(60)
        for node in short.nodes:
            announce(url(tracker), node.key, MODEL, node.start, node.end, node.port, decode_ms_per_token=5.0)
        for node in long.nodes:
            announce(url(tracker), node.key, MODEL, node.start, node.end, node.port, decode_ms_per_token=50.0)
        gateway = sup.start_gateway(
            tracker_url=url(tracker), extra_args=["--check-fraction", "0", "--probation-checks", "0"]
        ).ready(60)
        yield {"short": short, "long": long, "gateway": gateway, "expected": short.expected}
    finally:
        sup.stop_all()
        for node in [*short.nodes, *long.nodes]:
            node.stop()


def _opened(nodes) -> int:
    return sum(n.state.opened for n in nodes)


def test_a_long_prompt_goes_to_the_route_that_can_hold_it(swarm: dict, model_path: Path) -> None:
    client = openai.OpenAI(
        base_url=url(swarm["gateway"]) + "/v1", api_key="sk-test", max_retries=0, timeout=60
    )
    short_route, long_route = swarm["short"].nodes, swarm["long"].nodes
    # A short prompt takes the cheaper route (the one announced faster).
    r = client.completions.create(model="fake-kv-model", prompt="Hello", max_tokens=4, temperature=0)
    assert r.choices[0].text and _opened(short_route) == 2 and _opened(long_route) == 0
    with Vocabulary(model_path) as vocab:
        text = "word " * 1000
        assert 900 <= len(vocab.tokenize(text, add_special=True)) <= 1100
    for stream in (False, True):
        kwargs = dict(model="fake-kv-model", prompt=text, max_tokens=4, temperature=0)
        if stream:
            got = "".join(
                c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices
            )
        else:
            got = client.completions.create(**kwargs).choices[0].text
        assert got and swarm["expected"].startswith(got)
    assert _opened(long_route) == 4 and _opened(short_route) == 2
    # Neither route holds 5,000 positions: 413 prompt_too_long, naming the largest context (route B's).
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="fake-kv-model", prompt="word " * 5000, max_tokens=4, temperature=0)
    assert refused.value.status_code == 413
    body = refused.value.body
    assert isinstance(body, dict) and body["code"] == "prompt_too_long" and body["param"] == "prompt"
    assert "largest context this swarm can serve now is 4096 tokens" in body["message"]
    too_long = metric_lines(url(swarm["gateway"]), "swarm_gateway_prompt_too_long_total")
    assert too_long and float(too_long[0].split()[-1]) == 1
