"""The relay handshake and relay URLs (pure: no processes, no model)."""

from __future__ import annotations

import base64
import time

import nacl.signing
import pytest

from gateway.relay import RelayHub
from node.relay_client import hello_envelope, relay_ws_url
from proto.signing import SignatureError, public_key_hex
from proto.swarm.v1 import shard_service_pb2


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
