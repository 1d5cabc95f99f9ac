"""Batch isolation from the gateway's side: which sessions ask for it, and the OPEN that carries it."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, GatewayConfig
from gateway.session_machine import RouteConfig, RouteMachine, SendFrame, StageSpec
from proto import codec
from proto.swarm.v1 import frame_pb2

MODEL_FP, RECIPE_FP = "ab" * 32, "cd" * 32


def _opens(isolated: bool) -> list[frame_pb2.OpenSession]:
    config = RouteConfig(
        "s", "r", MODEL_FP, codec.SamplingSettings(temperature=0.0), 16, 4, 1 << 20, isolated=isolated
    )
    stages = [
        StageSpec(f"n{i}", f"127.0.0.1:{7000 + i}", 10 * i, 10 * i + 10, RECIPE_FP, b"t") for i in range(3)
    ]
    machine = RouteMachine(config, stages, new_token=lambda: b"tok")
    return [c.frame.open for c in machine.open(0.0) if isinstance(c, SendFrame)]


@pytest.mark.parametrize("isolated", [True, False])
def test_every_stage_of_the_route_is_asked_alike(isolated: bool) -> None:
    opens = _opens(isolated)
    assert len(opens) == 3 and all(o.isolated == isolated for o in opens)


@pytest.mark.parametrize(
    ("mode", "checked", "plain"), [("off", False, False), ("checked", True, False), ("all", True, True)]
)
def test_the_runs_of_a_check_are_isolated_alike_and_other_sessions_per_mode(
    mode: str, checked: bool, plain: bool
) -> None:
    config = GatewayConfig(batch_isolation=mode).validate()
    assert config.isolates(True) is checked  # primary, shadow and judge all ask the same
    assert config.isolates(False) is plain


@pytest.mark.parametrize("checked", [True, False])
def test_auto_isolates_every_session_of_a_batch_variant_model_and_none_of_the_others(checked: bool) -> None:
    config = GatewayConfig().validate()
    assert config.batch_isolation == "auto"  # the default: checks stay indistinguishable from traffic
    assert config.isolates(checked, "gemma3") is True  # the same request, the same text under load
    assert config.isolates(checked, "llama") is False  # batch-invariant here: batching kept


def test_batch_isolation_takes_only_its_modes() -> None:
    with pytest.raises(ConfigError, match="batch_isolation"):
        GatewayConfig(batch_isolation="sometimes").validate()
