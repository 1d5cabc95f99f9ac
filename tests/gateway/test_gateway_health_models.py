"""/health and /v1/models while a model is still being assembled: a real tracker and gateway process, one
announced node covering half the layers (no engine behind it: nothing is computed here)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import nacl.signing
import pytest
from swarm_fixtures import announce, url, wait_until

from gateway.protocol import model_id, model_list
from proto.announce import ModelSpec
from sim.procs import Supervisor

pytestmark = pytest.mark.slow  # real tracker and gateway processes

MODEL = ModelSpec(
    fingerprint="ef" * 32, name="Half Built Model 1B", architecture="llama", n_layers=30, n_embd=576
)


@pytest.fixture(scope="module")
def half(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    sup = Supervisor(tmp_path_factory.mktemp("half"))
    try:
        tracker = sup.start_tracker(extra_args=["--no-challenges"]).ready(60)
        gateway = sup.start_gateway(
            tracker_url=url(tracker), extra_args=["--model-alias", "half=Half Built Model 1B"]
        ).ready(60)
        base = url(gateway)
        assert httpx.get(base + "/health", timeout=10).status_code == 503  # nothing known yet
        announce(url(tracker), nacl.signing.SigningKey.generate(), MODEL, 0, 15, 1)
        wait_until(lambda: httpx.get(base + "/v1/models", timeout=10).json()["data"], 30, "the model listed")
        yield base
    finally:
        sup.stop_all()


def test_health_is_503_without_a_complete_route_and_healthz_is_alive(half: str) -> None:
    r = httpx.get(half + "/health", timeout=10)
    assert r.status_code == 503 and "complete route" in r.json()["reason"]
    assert httpx.get(half + "/healthz", timeout=10).json()["status"] == "ok"


def test_models_being_assembled_are_listed_with_their_coverage(half: str) -> None:
    data = httpx.get(half + "/v1/models", timeout=10).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert set(by_id) == {"half-built-model-1b", "half"}
    entry = by_id["half-built-model-1b"]
    assert entry["status"] == "assembling" and entry["coverage"] == 0.5 and entry["name"] == MODEL.name
    assert httpx.get(half + "/v1/models/half", timeout=10).json()["fingerprint"] == MODEL.fingerprint


def test_model_ids_and_list_shape() -> None:
    assert model_id("SmolLM2 135M Instruct") == "smollm2-135m-instruct"
    assert model_id("Gemma 3 270m") == "gemma-3-270m"
    assert model_id("  ") == "model"
    listed = model_list(
        [{"name": "A b", "fingerprint": "f", "routable": True, "n_layers": 2}],
        0,
        {"x": "a-b"},
        {"f": "generic"},
    )["data"]
    assert [m["id"] for m in listed] == ["a-b", "x"] and listed[0]["tool_format"] == "generic"
    assert listed[0]["status"] == "ready" and listed[0]["coverage"] == 1.0
