"""proto.announce validators: round trip, unknown keys, ranges."""

from __future__ import annotations

from typing import Any

import pytest
from tracker_helpers import announce_for, heartbeat_for, key

from proto.announce import Announce, Heartbeat, PayloadError


def test_round_trip() -> None:
    a = announce_for(key(1), 3, 9)
    assert Announce.from_json(a.to_json()) == a
    h = heartbeat_for(key(1), active=2, tokens=7)
    assert Heartbeat.from_json(h.to_json()) == h


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"shard_start": 9, "shard_end": 9}, "shard_end"),
        ({"shard_end": 31}, "shard_end"),
        ({"decode_ms_per_token": 0}, "decode_ms_per_token"),
        ({"decode_ms_per_token": float("nan")}, "decode_ms_per_token"),
        ({"max_sessions": True}, "max_sessions"),
        ({"addresses": ["nope"]}, "host:port"),
        ({"addresses": ["h:70000"]}, "host:port"),
        ({"addresses": []}, "must not be empty"),
        ({"node_id": "AB" * 32}, "node_id"),
        ({"model": {"fingerprint": "ab" * 32}}, "model"),
        ({"hardware": {"cpu_cores": 1}}, "hardware"),
        ({"extra": 1}, "unknown field"),
    ],
)
def test_announce_refusals(patch: dict[str, Any], match: str) -> None:
    body = {**announce_for(key(1), 3, 9).to_json(), **patch}
    with pytest.raises(PayloadError, match=match):
        Announce.from_json(body)


def test_relayed_node_needs_no_address() -> None:
    body = {**announce_for(key(1)).to_json(), "addresses": [], "relay": True, "relay_via": "gw-1"}
    assert Announce.from_json(body).relay_via == "gw-1"


def test_heartbeat_refusals() -> None:
    with pytest.raises(PayloadError):
        Heartbeat.from_json({**heartbeat_for(key(1)).to_json(), "queue_depth": -1})
    with pytest.raises(PayloadError):
        Heartbeat.from_json([1, 2])
