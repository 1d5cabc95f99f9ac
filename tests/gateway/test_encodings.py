"""activation_encoding = "auto": the encoding each stage sends its hidden states in, from the hop's
bandwidth (pure), and the frames a slow hop really carries (the Route Session machine driving real
node session machines in memory, ``session_sim``)."""

from __future__ import annotations

import random

import pytest
from session_sim import Fault, SimSwarm, make_nodes, run_request

from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.encodings import hop_encoding, stage_encodings
from gateway.route_opener import data_plane
from gateway.route_session import DataPlane
from gateway.routes import Hop, Route
from proto.swarm.v1 import frame_pb2

F32, F16, INT8 = frame_pb2.ENCODING_F32, frame_pb2.ENCODING_F16, frame_pb2.ENCODING_INT8_BLOCK
PROMPT = [5, 17, 33, 2, 8, 61, 4, 4, 9, 12, 40, 3, 7]
MAX_NEW = 8


@pytest.mark.parametrize(
    ("bandwidth", "int8_below", "expected"),
    [
        (None, 0.0, F32),  # unknown: the exact encoding
        (None, 100.0, F32),
        (400.0, 0.0, F32),  # at the threshold: fast enough
        (10_000.0, 0.0, F32),
        (399.9, 0.0, F16),
        (1.0, 0.0, F16),  # int8 off: never int8
        (0.0, 0.0, F16),
        (99.0, 100.0, INT8),
        (100.0, 100.0, F16),  # at the int8 threshold: f16
        (0.0, 100.0, INT8),
    ],
)
def test_hop_encoding(bandwidth: float | None, int8_below: float, expected: int) -> None:
    assert hop_encoding(bandwidth, f32_min_mbit_s=400.0, int8_below_mbit_s=int8_below) == expected


def test_stage_encodings_are_the_senders_and_the_last_stage_sends_no_hidden_states() -> None:
    # bandwidths[i] is the hop *into* stage i: stage k's output crosses bandwidths[k + 1].
    assert stage_encodings("auto", [None, 20.0, 1000.0], f32_min_mbit_s=400.0) == (F16, F32, F32)
    assert stage_encodings("auto", [5.0, None, 20.0], f32_min_mbit_s=400.0, int8_below_mbit_s=50.0) == (
        F32,
        INT8,
        F32,
    )
    assert stage_encodings("auto", [None], f32_min_mbit_s=400.0) == (F32,)
    assert stage_encodings("f16", [None, 5000.0], f32_min_mbit_s=400.0) == (F16, F16)
    assert stage_encodings("int8", [None, None, None], f32_min_mbit_s=400.0) == (INT8,) * 3


def _route(*bandwidths: float | None) -> Route:
    hops = tuple(
        Hop(f"{i:064x}", 10 * i, 10 * i + 10, f"127.0.0.1:{7000 + i}", bandwidth_mbit_s=b)
        for i, b in enumerate(bandwidths)
    )
    return Route("r", "a" * 64, "m", 10 * len(hops), hops, b"{}", 0.0, 1.0)


def test_the_gateway_config_reaches_the_data_plane() -> None:
    slow_then_fast = _route(None, 20.0, 1000.0)
    auto = data_plane(GatewayConfig(activation_encoding="auto"))
    assert auto.encodings(slow_then_fast) == (F16, F32, F32)
    int8 = data_plane(GatewayConfig(activation_encoding="auto", auto_int8_below_mbit_s=50.0))
    assert int8.encodings(slow_then_fast) == (INT8, F32, F32)
    assert data_plane(GatewayConfig()).encodings(slow_then_fast) == (F32,) * 3  # the default: exact
    assert data_plane(GatewayConfig(activation_encoding="f16")).encodings(_route(None, 1e6)) == (F16, F16)
    assert DataPlane().encodings(slow_then_fast) == (F32,) * 3


def test_config_refuses_an_int8_threshold_above_the_f32_one() -> None:
    with pytest.raises(ConfigError, match="auto_int8_below_mbit_s"):
        load_config(env={}, flags={"auto_f32_min_mbit_s": 100.0, "auto_int8_below_mbit_s": 200.0})
    with pytest.raises(ConfigError, match="auto_int8_below_mbit_s"):
        load_config(env={}, flags={"auto_int8_below_mbit_s": -1.0})


def _run(encodings: tuple[int, ...], faults: list[Fault] = ()) -> tuple[SimSwarm, list[int], int]:  # type: ignore[assignment]
    nodes, by_span = make_nodes([(0, 4), (4, 8), (8, 12)], spares=1)
    swarm = SimSwarm(nodes, random.Random(3))
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, encodings=encodings, faults=faults)
    assert result.failed is None and len(result.tokens) == MAX_NEW
    return swarm, result.tokens, result.recoveries


def test_a_slow_hop_carries_f16_frames_and_the_others_f32() -> None:
    plan = DataPlane(encoding_mode="auto").encodings(_route(None, 20.0, 1000.0))  # stage 0's uplink is slow
    swarm, tokens, _ = _run(plan)
    by_sender: dict[str, set[int]] = {}
    for sender, encoding in swarm.pushed:
        by_sender.setdefault(sender, set()).add(encoding)
    assert by_sender == {"n0-4-0": {F16}, "n4-8-0": {F32}}  # the last stage pushes token ids only
    exact, exact_tokens, _ = _run(())
    assert {e for _, e in exact.pushed} == {F32}
    assert tokens == exact_tokens  # this test model's tokens do not depend on the hidden values


def test_a_replacement_takes_over_its_positions_encoding() -> None:
    swarm, _, recoveries = _run((F16, INT8, F32), faults=[Fault("kill", 80, "n0-4-0")])
    assert recoveries == 1
    senders = {(s, e) for s, e in swarm.pushed}
    assert ("n0-4-1", F16) in senders and not {e for s, e in senders if s.startswith("n0-4")} - {F16}
    assert {e for s, e in senders if s.startswith("n4-8")} == {INT8}
