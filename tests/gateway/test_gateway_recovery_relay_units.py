"""Pure pieces of span recovery and the relay handshake (no processes, no model)."""

from __future__ import annotations

import base64
import time

import nacl.signing
import numpy as np
import pytest

from gateway.recovery import SpanHistory, hidden_rows, replay_frames
from gateway.relay import RelayHub
from node.relay_client import hello_envelope, relay_ws_url
from proto import codec
from proto.signing import SignatureError, public_key_hex
from proto.swarm.v1 import frame_pb2, shard_service_pb2

WIDTH = 8
LIMITS = codec.FrameLimits()


def header(start: int, end: int) -> codec.SessionHeader:
    return codec.SessionHeader(
        session_id="s" * 32,
        route_epoch=1,
        model_fingerprint="a" * 64,
        recipe_fingerprint="b" * 64,
        shard_start=start,
        shard_end=end,
    )


def relayed_step(
    start: int, rows: np.ndarray, tokens: list[int], max_frame_bytes: int
) -> list[frame_pb2.Frame]:
    """What the gateway relays to stage 1: activation frames with hidden rows (and token ids)."""
    return codec.step_frames(
        header(15, 30),
        frame_pb2.PHASE_PREFILL if len(tokens) > 1 else frame_pb2.PHASE_DECODE,
        step_id=start + 2,
        start=start,
        token_ids=tokens,
        hidden=rows,
        max_frame_bytes=max_frame_bytes,
    )


def test_history_commits_whole_steps_and_replays_bit_exact_rows() -> None:
    rng = np.random.default_rng(7)
    history = SpanHistory(2, max_bytes=1 << 20)
    all_rows = rng.standard_normal((13, WIDTH)).astype(np.float32)
    tokens = list(range(100, 113))
    steps = [(0, 5), (5, 9), (9, 10), (10, 11), (11, 12), (12, 13)]  # prefill in two steps, then decodes
    for a, b in steps:
        history.begin_step()
        for frame in relayed_step(a, all_rows[a:b], tokens[a:b], max_frame_bytes=4096):
            history.record(1, frame)
        history.commit(tokens[a:b])
    # A step that failed half-way leaves nothing behind.
    history.begin_step()
    history.record(1, relayed_step(13, all_rows[:1], [1], 4096)[0])
    history.begin_step()
    assert history.committed == 13
    assert np.array_equal(hidden_rows(history.frames[1], LIMITS), all_rows)
    for stage, is_last in ((0, False), (1, True)):
        replay = replay_frames(
            history,
            stage,
            is_last=is_last,
            header=header(0, 15),
            first_step_id=50,
            step_tokens=4,
            max_frame_bytes=1 << 20,
            limits=LIMITS,
        )
        assert [f[0].step_id for f in replay] == [50, 51, 52, 53]
        step = [codec.reassemble(f, LIMITS) for f in replay]
        assert all(s.phase == frame_pb2.PHASE_PREFILL and not s.sample for s in step)
        assert [t for s in step for t in s.token_ids.tolist()] == tokens
        if stage == 1:
            assert np.array_equal(np.concatenate([s.tensors[codec.HIDDEN] for s in step]), all_rows)
        else:
            assert all(codec.HIDDEN not in s.tensors for s in step)


def test_history_past_its_bound_keeps_tokens_only() -> None:
    history = SpanHistory(2, max_bytes=3000)
    rows = np.ones((1, WIDTH), dtype=np.float32)
    for pos in range(100):
        history.begin_step()
        history.record(1, relayed_step(pos, rows, [pos], 4096)[0])
        history.commit([pos])
    assert history.committed == 100 and not history.hidden_kept and history.bytes_held == 0
    assert history.can_replay(0) and not history.can_replay(1)


def info(node_id: str) -> bytes:
    node_info = shard_service_pb2.NodeInfo(node_id=node_id)
    node_info.shard.start, node_info.shard.end = 15, 30
    return node_info.SerializeToString()


def test_relay_handshake_accepts_the_signed_answer_and_refuses_everything_else() -> None:
    gateway_key, node_key, other_key = (nacl.signing.SigningKey.generate() for _ in range(3))
    hub = RelayHub(public_key_hex(gateway_key), max_frame_bytes=1 << 20)
    node_id = public_key_hex(node_key)
    now = time.time()
    good = hello_envelope(node_key, hub.gateway_id, "c" * 64, info(node_id), now)
    got_id, got_info = hub.check_hello(good, "c" * 64)
    assert got_id == node_id and got_info.node_id == node_id
    with pytest.raises(SignatureError, match="nonce"):
        hub.check_hello(good, "c" * 64)  # replayed
    cases = {
        "wrong_challenge": (hello_envelope(node_key, hub.gateway_id, "d" * 64, info(node_id), now), "c" * 64),
        "wrong_gateway": (hello_envelope(node_key, "e" * 64, "c" * 64, info(node_id), now), "c" * 64),
        "key_mismatch": (
            hello_envelope(node_key, hub.gateway_id, "c" * 64, info(public_key_hex(other_key)), now),
            "c" * 64,
        ),
        "stale_timestamp": (
            hello_envelope(node_key, hub.gateway_id, "c" * 64, info(node_id), now - 3600),
            "c" * 64,
        ),
    }
    for reason, (envelope, challenge) in cases.items():
        with pytest.raises(SignatureError) as err:
            hub.check_hello(envelope, challenge)
        assert err.value.reason == reason
    forged = dict(hello_envelope(node_key, hub.gateway_id, "c" * 64, info(node_id), now))
    forged["payload"] = base64.b64encode(
        base64.b64decode(forged["payload"]).replace(b"relay_hello", b"relay_hellO")
    )
    forged["payload"] = forged["payload"].decode()
    with pytest.raises(SignatureError) as err:
        hub.check_hello(forged, "c" * 64)
    assert err.value.reason == "bad_signature"


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("http://10.0.0.2:8000", "ws://10.0.0.2:8000/v1/relay"),
        ("https://gw.example/", "wss://gw.example/v1/relay"),
        ("http://gw:8000/v1", "ws://gw:8000/v1/relay"),
        ("ws://gw:8000/v1/relay", "ws://gw:8000/v1/relay"),
        ("gw:8000", "ws://gw:8000/v1/relay"),
    ],
)
def test_relay_url_forms(given: str, url: str) -> None:
    assert relay_ws_url(given) == url
