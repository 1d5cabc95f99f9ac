"""A gateway's coordinate (tracker/coordinates.py, ``refit(vouched=True)``): nobody measures a
gateway back, so none of its pairs is ever confirmed, and without vouching the outlier filter
alone decides which of its claims count. The case from the emulated WAN (docs/tracker.md,
Network coordinates): the gateway's leg to a near node (10 ms one way) stayed predicted at
0.6-1.5 ms to the end of the run. Here the gateway's coordinate fits every claim but one, the
node's coordinate sits next to it, and the claim about that node is filtered at every refit;
vouched, the claim counts and the leg moves to what was measured."""

from __future__ import annotations

import math

from tracker.coordinates import NetCoord, observations, refit

# Where the tracker has the nodes (heights 1 ms); the gateway's coordinate at the origin.
NODES = {
    "eu0": NetCoord((8.0, 0.0, 0.0), 1.0, 0.1),
    "eu1": NetCoord((0.0, 0.5, 0.0), 1.0, 0.1),  # placed next to the gateway: 2.5 ms predicted
    "us0": NetCoord((-80.0, 10.0, 0.0), 1.0, 0.1),
    "us1": NetCoord((-75.0, -15.0, 5.0), 1.0, 0.1),
    "us2": NetCoord((-85.0, 0.0, -10.0), 1.0, 0.1),
    "asia0": NetCoord((150.0, 60.0, 0.0), 1.0, 0.1),
    "asia1": NetCoord((160.0, 40.0, 10.0), 1.0, 0.1),
    "asia2": NetCoord((140.0, 70.0, -10.0), 1.0, 0.1),
}
START = NetCoord((0.0, 0.0, 0.0), 1.0, 0.2)
# What the gateway measures: what its coordinate predicts, except eu1, really 20 ms away.
CLAIMS = {**{k: START.rtt_ms(c) for k, c in NODES.items()}, "eu1": 20.0}
STUCK = START


def _refits(vouched: bool, rounds: int = 40) -> NetCoord:
    own = STUCK
    for _ in range(rounds):
        new = refit(own, CLAIMS, {}, NODES, key="gateway-eu", vouched=vouched)
        assert new is not None
        own = new
    return own


def test_unvouched_gateway_claims_are_never_confirmed_and_the_near_leg_stays_wrong() -> None:
    """The cause, shown on the tracker's own functions: the claims about a gateway are empty, so
    no observation is confirmed, and the near node's claim (20 ms against 2.5 ms predicted) is
    beyond the outlier cutoff at every refit: the leg stays where it was."""
    obs, both, _ = observations(CLAIMS, {}, NODES)
    assert both == 0 and not any(o.confirmed for o in obs)
    stuck = _refits(vouched=False)
    assert stuck.rtt_ms(NODES["eu1"]) < 5.0  # measured: 20 ms


def test_vouched_gateway_claims_place_the_near_legs() -> None:
    obs, _, _ = observations(CLAIMS, {}, NODES, vouched=True)
    assert all(o.confirmed for o in obs)
    placed = _refits(vouched=True)
    assert placed.rtt_ms(NODES["eu1"]) > 10.0  # measured: 20 ms; the WAN test wants > 5 ms one way
    # The far legs stay fitted; eu0 (8 ms) pays for eu1's misplaced node coordinate (only eu1's
    # own claims can move that one), as one wrong leg is spread over the fit.
    for far in ("us0", "us1", "us2", "asia0", "asia1", "asia2"):
        assert math.isclose(placed.rtt_ms(NODES[far]), CLAIMS[far], rel_tol=0.1), far


def test_vouching_changes_nothing_for_two_sided_pairs() -> None:
    """A node's pairs measured from both sides are decided as before (larger claim, disputes)."""
    about = {"eu0": 30.0, "us0": 500.0}
    plain = observations(CLAIMS, about, NODES)
    vouched = observations(CLAIMS, about, NODES, vouched=True)
    assert plain[1:] == vouched[1:]
    two_sided = {o.peer_key: o for o in plain[0] if o.peer_key in about}
    assert {o.peer_key: o for o in vouched[0] if o.peer_key in about} == two_sided
