"""A gateway's statistics report names the nodes that did not answer it (issue 27, tarpits): the
payload round-trips and bad lists are refused with a clear error."""

from __future__ import annotations

import pytest
from tracker_helpers import key

from proto.announce import MAX_UNREACHABLE, GatewayStats, PayloadError
from proto.signing import public_key_hex


def test_unreachable_nodes_round_trip_and_bad_lists_are_refused() -> None:
    gw = public_key_hex(key(1))
    silent = sorted(public_key_hex(key(i)) for i in (2, 3))
    stats = GatewayStats(gw, 5.0, 0, 0, 0, 0, 0, 0, None, None, unreachable=tuple(silent))
    assert GatewayStats.from_json(stats.to_json()) == stats
    assert (
        "unreachable" not in GatewayStats(gw, 5.0, 0, 0, 0, 0, 0, 0, None, None).to_json()
    )  # older trackers
    body = stats.to_json()
    for bad in ("x", ["not a key"], [1], [f"{i:064x}" for i in range(MAX_UNREACHABLE + 1)]):
        with pytest.raises(PayloadError, match="unreachable"):
            GatewayStats.from_json({**body, "unreachable": bad})
