"""Nodes the tracker's operator lists in ``trusted_nodes`` (route answers say ``operator_trusted``):
this gateway counts them trusted without passes of its own; every other node stays on probation here
until it passed ``probation_checks`` checks, and the tracker's probation flag always wins."""

from __future__ import annotations

from typing import Any, cast

from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from gateway.routes import Hop, parse_routes
from gateway.spot_checks import SpotChecks


def _answer(**extra: object) -> dict:
    hop = {"node_id": "n0", "start": 0, "end": 30, "address": "h:0", **extra}
    route = {"hops": [hop], "ticket": {"payload": "x"}, "expires_at": 1e10, "expected_ms_per_token": 1.0}
    return {"model": {"fingerprint": "ab" * 32, "name": "m", "n_layers": 30}, "routes": [route]}


def test_hops_carry_the_operators_trust_and_nothing_else_counts() -> None:
    assert parse_routes(_answer(operator_trusted=True), 0.0).routes[0].hops[0].operator_trusted
    for other in (False, "true", 1, None):  # only a JSON true, never something truthy
        assert not parse_routes(_answer(operator_trusted=other), 0.0).routes[0].hops[0].operator_trusted
    assert not parse_routes(_answer(), 0.0).routes[0].hops[0].operator_trusted  # an older tracker


def test_an_operator_trusted_node_needs_no_passes_here_others_do() -> None:
    spot = SpotChecks(
        GatewayConfig(probation_checks=3), Metrics(), cast(Any, None), cast(Any, None), "gw" * 32
    )
    fresh = Hop("a" * 64, 0, 30, "h:1")
    ours = Hop("b" * 64, 0, 30, "h:2", operator_trusted=True)
    flagged = Hop("c" * 64, 0, 30, "h:3", probation=True, operator_trusted=True)
    assert spot.on_probation(fresh)  # no passes seen here: checked, and refused where none can check it
    assert not spot.on_probation(ours)
    assert spot.on_probation(flagged)  # the tracker's probation flag wins over the hint
    spot.standing.passed([fresh.node_id] * 3)  # a fresh node earns it here by passing checks
    assert not spot.on_probation(fresh)
