"""The node acts only on advice the tracker it trusts signed, for itself, for its question."""

from __future__ import annotations

import time

import nacl.signing
import pytest

from node.rebalancing import read_advice
from proto.rebalance import ADVICE_KIND, MoveAdvice, RebalanceAdvice
from proto.signing import NonceCache, make_payload, public_key_hex, sign_envelope

TRACKER = nacl.signing.SigningKey(b"t" * 32)
OTHER = nacl.signing.SigningKey(b"o" * 32)
NODE = "ab" * 32


def envelope(
    key: nacl.signing.SigningKey, advice: RebalanceAdvice, *, at: float | None = None
) -> dict[str, str]:
    now = time.time() if at is None else at
    return sign_envelope(key, make_payload(ADVICE_KIND, "tracker_id", key, now, advice.to_json()))


def read(env: object, nonce: str = "q" * 24, cache: NonceCache | None = None) -> RebalanceAdvice:
    nonces = cache if cache is not None else NonceCache()
    return read_advice(env, tracker_id=public_key_hex(TRACKER), node_id=NODE, nonce=nonce, nonces=nonces)


def test_the_trackers_advice_for_this_question_is_read() -> None:
    move = MoveAdvice("cd" * 32, 0, 18, "throughput", float("inf"), "gemma3")
    advice = read(envelope(TRACKER, RebalanceAdvice(NODE, "q" * 24, move)))
    assert advice.move == move  # an infinite gain travels as null and comes back infinite
    assert read(envelope(TRACKER, RebalanceAdvice(NODE, "q" * 24, None, "pinned"))).why == "pinned"


def test_other_signers_nodes_questions_replays_and_old_answers_are_refused() -> None:
    good = RebalanceAdvice(NODE, "q" * 24, None)
    with pytest.raises(ValueError, match="another key"):
        read(envelope(OTHER, good))
    with pytest.raises(ValueError, match="another node or another question"):
        read(envelope(TRACKER, RebalanceAdvice("ef" * 32, "q" * 24, None)))
    with pytest.raises(ValueError, match="another node or another question"):
        read(envelope(TRACKER, good), nonce="r" * 24)
    cache = NonceCache()
    env = envelope(TRACKER, good)
    read(env, cache=cache)
    with pytest.raises(ValueError, match="unusable"):
        read(env, cache=cache)  # the same answer twice
    with pytest.raises(ValueError, match="unusable"):
        read(envelope(TRACKER, good, at=time.time() - 3600))
    with pytest.raises(ValueError, match="unusable"):
        read({"payload": "x"})
