"""A node's ``retry_after_ms`` is a stranger's hint: the gateway's Route Session machine caps it (pure)."""

from __future__ import annotations

import itertools

from session_sim import MODEL_FP, RECIPE_FP

from gateway.session_machine import (
    MAX_CLIENT_RETRY_AFTER_S,
    MAX_NODE_RETRY_AFTER_MS,
    FindReplacement,
    RouteConfig,
    RouteMachine,
    SendFrame,
    SessionFailed,
    StageSpec,
)
from proto import codec
from proto.errors import ResourceExhaustedError
from proto.swarm.v1 import status_pb2


def machine_for(specs: list[StageSpec], *, max_recoveries: int) -> RouteMachine:
    """A greedy Route Session over ``specs`` with small budgets and counting tokens."""
    config = RouteConfig(
        session_id="s",
        request_id="r",
        model_fingerprint=MODEL_FP,
        sampling=codec.SamplingSettings(temperature=0.0),
        kv_budget=16,
        step_tokens=4,
        node_frame_bytes=1 << 20,
        max_recoveries=max_recoveries,
    )
    counter = itertools.count(1)
    return RouteMachine(config, specs, new_token=lambda: next(counter).to_bytes(8, "little"))


def test_a_huge_retry_after_from_a_node_is_capped_for_the_client() -> None:
    machine = machine_for([StageSpec("a" * 64, "127.0.0.1:1", 0, 4, RECIPE_FP, b"t")], max_recoveries=0)
    (send,) = [c for c in machine.open(0.0) if isinstance(c, SendFrame)]
    refusal = codec.error_frame(
        ResourceExhaustedError("all slots in use", retry_after_ms=10**9), send.frame, kv_len=0
    )
    commands = machine.on_bytes(send.slot, codec.serialize_frame(refusal), 0.0)
    (failed,) = [c for c in commands if isinstance(c, SessionFailed)]
    assert failed.failure.kind == "busy"
    assert failed.failure.retry_after_s == MAX_CLIENT_RETRY_AFTER_S  # not 1,000,000 s


def test_a_survivor_asking_for_an_endless_wait_before_re_attaching_is_asked_again_within_a_second() -> None:
    specs = [
        StageSpec("a" * 64, "127.0.0.1:1", 0, 4, RECIPE_FP, b"t"),
        StageSpec("b" * 64, "127.0.0.1:2", 4, 8, RECIPE_FP, b"t"),
    ]
    machine = machine_for(specs, max_recoveries=2)
    opens = [c for c in machine.open(0.0) if isinstance(c, SendFrame)]
    for send, spec in zip(opens, specs, strict=True):
        ack = codec.open_ack_frame(
            send.frame,
            kv_len=0,
            node_id=spec.node_id,
            kv_tokens_granted=16,
            max_frame_bytes=1 << 20,
            max_step_tokens=64,
            reattached=False,
        )
        machine.on_bytes(send.slot, codec.serialize_frame(ack), 0.0)
    assert machine.phase == "ready"
    machine.begin([1, 2, 3], 0.5)  # a prompt in flight when stage 1 goes away
    (find,) = [
        c for c in machine.on_stream_failed(opens[1].slot, "gone", 1.0) if isinstance(c, FindReplacement)
    ]
    spare = StageSpec("c" * 64, "127.0.0.1:3", 4, 8, RECIPE_FP, b"t")
    reopens = [c for c in machine.on_replacement(find.index, spare, None, 1.0) if isinstance(c, SendFrame)]
    (survivor,) = [c for c in reopens if c.slot == opens[0].slot and c.frame.WhichOneof("body") == "open"]
    busy = codec.error_frame(
        ResourceExhaustedError("a step is still running", retry=status_pb2.RETRY_SAME, retry_after_ms=10**9),
        survivor.frame,
        kv_len=0,
    )
    machine.on_bytes(survivor.slot, codec.serialize_frame(busy), 1.0)
    assert machine.deadline <= 1.0 + MAX_NODE_RETRY_AFTER_MS / 1000  # not 11 days
