"""The vectorised refit (``update_many``/``refit_many``) against the scalar one, endpoint by endpoint."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracker.coordinates import (
    EAGER_ERROR,
    EAGER_ROUNDS,
    MAX_RTT_MS,
    MIN_RTT_MS,
    NetCoord,
    Observation,
    check_pairs,
    observations,
    refit,
    refit_many,
    update,
    update_many,
)

axis = st.floats(-200.0, 200.0, allow_nan=False)
coord = st.builds(
    NetCoord, st.tuples(axis, axis, axis), st.floats(0.05, 40.0), st.sampled_from([0.01, 0.1, 0.4, 0.8, 1.0])
)
# Some observations coincide with the endpoint (zero distance: the hash-chosen direction), some are
# wild (the outlier filter), some out of range (skipped).
rtts = st.one_of(st.floats(0.5, 400.0), st.sampled_from([0.0, 5_000.0, 70_000.0]))
obs = st.builds(Observation, st.sampled_from(["a", "b", "c", "d"]), coord, rtts, st.booleans())


def close(a: NetCoord, b: NetCoord) -> None:
    assert a.vec == pytest.approx(b.vec, rel=1e-9, abs=1e-9)
    assert a.height_ms == pytest.approx(b.height_ms, rel=1e-9, abs=1e-9)
    assert a.error == pytest.approx(b.error, rel=1e-9, abs=1e-12)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(coord, st.lists(obs, max_size=12)), min_size=1, max_size=6))
def test_update_many_equals_update_per_endpoint(cases: list[tuple[NetCoord, list[Observation]]]) -> None:
    got = update_many([c for c, _ in cases], [o for _, o in cases])
    for (own, o), new in zip(cases, got, strict=True):
        close(new, update(own, o))


def test_update_many_coincident_points_and_empty_lists() -> None:
    own = NetCoord((1.0, 2.0, 3.0), 1.0, 1.0)
    twin = Observation("peer", NetCoord((1.0, 2.0, 3.0), 1.0, 0.5), 40.0)
    got = update_many([own, own], [[twin], []])
    close(got[0], update(own, [twin]))
    assert got[1] == own


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.none() | coord,
            st.dictionaries(st.sampled_from(["p", "q", "r", "s"]), st.floats(1.0, 300.0), max_size=4),
            st.dictionaries(st.sampled_from(["p", "q", "r", "t"]), st.floats(1.0, 300.0), max_size=4),
            st.dictionaries(st.sampled_from(["p", "q", "r", "s", "t"]), st.none() | coord, max_size=5),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_refit_many_equals_refit(items: list) -> None:  # type: ignore[type-arg]
    keyed = [(f"endpoint{i}", *item) for i, item in enumerate(items)]
    got = refit_many(keyed)
    for (key, own, mine, about, peers), new in zip(keyed, got, strict=True):
        want = refit(own, mine, about, peers, key=key)
        if want is None:
            assert new is None
        else:
            assert new is not None
            close(new, want)


# Six nodes in three regions and a gateway, as on the emulated WAN (tests/sim/test_wan_routing.py).
REGION = {"eu0": "eu", "eu1": "eu", "us0": "us", "us1": "us", "asia0": "asia", "asia1": "asia", "gw": "eu"}
BETWEEN = {frozenset({"eu", "us"}): 80.0, frozenset({"us", "asia"}): 120.0, frozenset({"eu", "asia"}): 150.0}


def _rtt(a: str, b: str) -> float:
    ra, rb = REGION[a], REGION[b]
    return 12.5 if ra == rb else BETWEEN[frozenset({ra, rb})]


def _settled(coords: dict[str, NetCoord | None]) -> bool:
    """What the WAN test waits for: one-region pairs within 25 ms, others within 35 % (+5 ms)."""
    names = [n for n in REGION if n != "gw"]
    for a in names:
        for b in names:
            ca, cb = coords[a], coords[b]
            if a >= b:
                continue
            if ca is None or cb is None:
                return False
            p, t = ca.rtt_ms(cb), _rtt(a, b)
            if (REGION[a] == REGION[b] and p > 25.0) or (
                REGION[a] != REGION[b] and abs(p - t) > 0.35 * t + 5.0
            ):
                return False
    g = coords["gw"]
    return (
        g is not None and g.error <= 0.5 and all(5.0 <= g.rtt_ms(coords[n]) <= 25.0 for n in ("eu0", "eu1"))
    )  # type: ignore[arg-type]


def _rounds_to_settle(keyed: bool, limit: int = 400, *, eager: bool = False) -> int | None:
    """Endpoints join one per round (as they come up live) and are refitted every round; the last
    one joins in round 6, so 6 is the fewest possible."""
    order = ["asia1", "asia0", "eu0", "us0", "us1", "eu1", "gw"]
    coords: dict[str, NetCoord | None] = dict.fromkeys(order)
    for rnd in range(limit):
        live = order[: rnd + 1]
        for k in live:
            own = {p: _rtt(k, p) for p in live if p != k and p != "gw"}  # nobody measures a gateway
            about = {} if k == "gw" else {p: _rtt(p, k) for p in live if p != k}
            peers = {p: coords[p] for p in {*own, *about}}
            coords[k] = refit(coords[k], own, about, peers, key=k if keyed else "", eager=eager)
        if len(live) == len(order) and _settled(coords):
            return rnd
    return None


def test_first_coordinates_off_the_origin_settle_in_tens_of_rounds() -> None:
    """From the origin, the embedding collapses onto a line and takes hundreds of rounds to leave
    it (the live WAN's 90-300 s); starting each endpoint at its own hashed point settles fast."""
    fast = _rounds_to_settle(keyed=True)
    slow = _rounds_to_settle(keyed=False)
    assert fast is not None and fast <= 40
    assert slow is None or slow > 3 * fast


def test_eager_refits_of_newcomers_settle_in_fewer_rounds() -> None:
    """A new endpoint's refit repeats its update (up to EAGER_ROUNDS): the staggered replay settles
    the round the last endpoint joins (6) instead of 14 rounds with one update per refit."""
    one = _rounds_to_settle(keyed=True)
    repeated = _rounds_to_settle(keyed=True, eager=True)
    assert one is not None and repeated is not None
    assert repeated == 6 < one


def _misfit(c: NetCoord, obs: list[Observation]) -> float:
    return sum(abs(c.rtt_ms(o.peer) - o.rtt_ms) for o in obs)


def test_a_settled_endpoints_refit_is_one_update() -> None:
    """An endpoint with an error estimate at most EAGER_ERROR gets exactly today's refit: one update."""
    peers = {p: NetCoord((40.0 * i, 10.0, -5.0), 2.0, 0.2) for i, p in enumerate("abcd")}
    mine = {"a": 30.0, "b": 70.0, "c": 95.0, "d": 140.0}
    about = {"a": 31.0, "c": 90.0}
    for error in (0.01, 0.2, EAGER_ERROR):
        own = NetCoord((15.0, -20.0, 3.0), 1.5, error)
        obs, _both, _disputes = observations(mine, about, peers)
        got = refit(own, mine, about, peers, key="me")
        assert got == update(own, obs)
        assert got == refit(own, mine, about, peers, key="me", eager=False)
        many = refit_many([("me", own, mine, about, peers)])[0]
        assert many is not None
        close(many, got)  # the vectorised update: equal up to rounding


def test_a_newcomers_refit_repeats_its_update_and_keeps_the_first_error() -> None:
    """New (or error above EAGER_ERROR): the repeats fit its claims better than one update, the error
    estimate is the first update's, and an endpoint with a disputed pair gets one update only."""
    peers = {p: NetCoord((60.0 * i, 25.0 * (i % 2), 0.0), 1.0, 0.1) for i, p in enumerate("abcd")}
    mine = {"a": 20.0, "b": 55.0, "c": 120.0, "d": 180.0}
    obs, _both, _disputes = observations(mine, {}, peers)
    for own in (None, NetCoord((300.0, -200.0, 50.0), 0.05, 0.9)):
        once = refit(own, mine, {}, peers, key="new", eager=False)
        repeated = refit(own, mine, {}, peers, key="new")
        assert once is not None and repeated is not None
        assert _misfit(repeated, obs) < 0.5 * _misfit(once, obs)
        assert repeated.error == once.error
        assert EAGER_ROUNDS > 1
    disputed_about = {"a": 20.0, "b": 500.0}  # b says 500 ms, we said 55: a dispute
    assert refit(None, mine, disputed_about, peers, key="new") == refit(
        None, mine, disputed_about, peers, key="new", eager=False
    )


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st.dictionaries(
        st.sampled_from("abcdefghij"), st.one_of(st.floats(0.5, 400.0), st.just(70_000.0)), max_size=10
    ),
    st.dictionaries(st.sampled_from("abcdefghij"), st.floats(0.5, 400.0), max_size=10),
    st.sets(st.sampled_from("abcdefghij")),
)
def test_check_pairs_decides_as_observations(mine: dict, about: dict, known: set) -> None:  # type: ignore[type-arg]
    """The array checks the simulator uses: the same observations (RTT, confirmed, in order), the
    same two-sided and disputed counts as :func:`observations` followed by :func:`update`'s range
    filter, disputes and confirmations included."""
    peers = {p: None for p in known}
    want, both, disputes = observations(mine, about, peers)
    order = sorted(mine)
    rtt = np.array([[mine[p] for p in order]]).reshape(1, len(order))
    other = np.array([[about.get(p, np.nan) for p in order]]).reshape(1, len(order))
    usable = np.array([[p in known for p in order]], dtype=bool).reshape(1, len(order))
    got = check_pairs(rtt, other, usable)
    picked = [
        (p, float(got.rtt[0, j]), bool(got.confirmed[0, j])) for j, p in enumerate(order) if got.valid[0, j]
    ]
    in_range = [(o.peer_key, o.rtt_ms, o.confirmed) for o in want if MIN_RTT_MS <= o.rtt_ms <= MAX_RTT_MS]
    assert picked == in_range
    assert bool(got.observed[0]) == bool(want)
    assert (int(got.both[0]), int(got.disputes[0])) == (both, disputes)
