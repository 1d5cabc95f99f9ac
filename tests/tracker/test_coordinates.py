"""Network coordinates (tracker/coordinates.py): convergence on synthetic latency matrices, bounded
error, and what liars can and cannot do.

The harness below plays the tracker's side exactly as the store does: every round each endpoint
reports RTT claims about its peers (the truth plus up to 10 % queueing noise, or a lie), the claim
tables are kept per reporter, and each endpoint is refitted from its own claims and the claims
about it (``refit``). Peers are measured both ways, as the tracker's probe-back hints make nodes do.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracker.coordinates import (
    MAX_CLAIMS_PER_REPORTER,
    MIN_ERROR,
    MIN_HEIGHT_MS,
    UNTRUSTED_ERROR,
    NetCoord,
    Observation,
    VivaldiParams,
    merge_claims,
    observations,
    probe_back,
    refit,
    typical_one_way_ms,
    update,
)

# The simulator's "world" regions (typical public-internet RTTs between large cities, ms).
WORLD = ("us-east", "us-west", "europe", "asia", "south-america", "oceania")
WORLD_RTT = {
    ("us-east", "us-west"): 65.0,
    ("us-east", "europe"): 80.0,
    ("us-east", "asia"): 200.0,
    ("us-east", "south-america"): 120.0,
    ("us-east", "oceania"): 200.0,
    ("us-west", "europe"): 140.0,
    ("us-west", "asia"): 120.0,
    ("us-west", "south-america"): 170.0,
    ("us-west", "oceania"): 150.0,
    ("europe", "asia"): 180.0,
    ("europe", "south-america"): 190.0,
    ("europe", "oceania"): 260.0,
    ("asia", "south-america"): 300.0,
    ("asia", "oceania"): 120.0,
    ("south-america", "oceania"): 310.0,
}

Rtt = Callable[[int, int], float]
Liar = Callable[[int, int, float, random.Random], float]


def world_matrix(n: int, rng: random.Random) -> tuple[Rtt, list[str]]:
    regions = [rng.choice(WORLD) for _ in range(n)]
    access = [rng.uniform(2.0, 25.0) for _ in range(n)]

    def rtt(a: int, b: int) -> float:
        ra, rb = regions[a], regions[b]
        core = 15.0 if ra == rb else WORLD_RTT.get((ra, rb)) or WORLD_RTT[(rb, ra)]
        return core + 2 * access[a] + 2 * access[b]

    return rtt, regions


def plane_matrix(n: int, rng: random.Random) -> Rtt:
    """Exactly embeddable: points in a 300 ms square plus access heights."""
    pts = [(rng.uniform(0, 300), rng.uniform(0, 300)) for _ in range(n)]
    heights = [rng.uniform(1.0, 20.0) for _ in range(n)]
    return lambda a, b: math.dist(pts[a], pts[b]) + heights[a] + heights[b]


def play(
    n: int,
    rtt: Rtt,
    rounds: int,
    rng: random.Random,
    liars: dict[int, Liar] | None = None,
    peers_per_node: int = 12,
) -> dict[int, NetCoord | None]:
    """Rounds of measure -> report -> refit; returns each endpoint's coordinate."""
    liars = liars or {}
    peers: dict[int, set[int]] = {
        i: set(rng.sample([j for j in range(n) if j != i], peers_per_node)) for i in range(n)
    }
    for i in range(n):  # probe-back: a pair measured one way is soon measured the other way too
        for j in list(peers[i]):
            peers[j].add(i)
    claims: dict[int, dict[str, float]] = {i: {} for i in range(n)}
    about: dict[int, dict[str, float]] = {i: {} for i in range(n)}
    coords: dict[int, NetCoord | None] = {i: None for i in range(n)}
    for _ in range(rounds):
        for i in range(n):
            for j in peers[i]:
                value = rtt(i, j) * rng.uniform(1.0, 1.1)
                if i in liars:
                    value = liars[i](i, j, value, rng)
                claims[i][str(j)] = value
                about[j][str(i)] = value
        order = list(range(n))
        rng.shuffle(order)
        for i in order:
            known = {str(j): coords[j] for j in peers[i]}
            coords[i] = refit(coords[i], claims[i], about[i], known)
    return coords


def relative_errors(coords: dict[int, NetCoord | None], rtt: Rtt, who: list[int]) -> list[float]:
    out = []
    for x, a in enumerate(who):
        for b in who[x + 1 :]:
            ca, cb = coords[a], coords[b]
            assert ca is not None and cb is not None
            true = rtt(a, b)
            out.append(abs(ca.rtt_ms(cb) - true) / true)
    return sorted(out)


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


# --- convergence ------------------------------------------------------------------------------------


def test_converges_on_an_embeddable_matrix() -> None:
    rng = random.Random(11)
    rtt = plane_matrix(120, rng)
    coords = play(120, rtt, 40, rng)
    errs = relative_errors(coords, rtt, list(range(120)))
    # Bounded error over every pair, most of which were never measured directly.
    assert statistics.median(errs) < 0.08
    assert quantile(errs, 0.9) < 0.2
    assert all(c is not None and c.error <= UNTRUSTED_ERROR for c in coords.values())


def test_converges_on_the_world_matrix() -> None:
    """Six regions with the RTTs of the public internet (not a metric space exactly) and 2-25 ms
    access links: most pairs within 15 %, and for at least 98 % of the nodes their own region's
    nodes predicted nearer than the others' (medians)."""
    rng = random.Random(5)
    rtt, regions = world_matrix(150, rng)
    coords = play(150, rtt, 40, rng)
    errs = relative_errors(coords, rtt, list(range(150)))
    assert statistics.median(errs) < 0.12
    assert quantile(errs, 0.9) < 0.3
    # What routing needs: a node's own region is predicted nearer on the whole.
    wrong = 0
    for a in range(150):
        ca = coords[a]
        assert ca is not None
        same = [ca.rtt_ms(coords[b]) for b in range(150) if b != a and regions[b] == regions[a]]  # type: ignore[arg-type]
        other = [ca.rtt_ms(coords[b]) for b in range(150) if regions[b] != regions[a]]  # type: ignore[arg-type]
        if same and statistics.median(same) >= statistics.median(other):
            wrong += 1
    assert wrong <= 3


def test_a_new_endpoint_is_placed_by_its_first_measurements() -> None:
    rng = random.Random(2)
    rtt = plane_matrix(60, rng)
    coords = play(60, rtt, 30, rng)
    # Node 0 restarts with no coordinate: a few reports against the others place it again.
    mine = {str(j): rtt(0, j) for j in range(1, 13)}
    about = {str(j): rtt(j, 0) for j in range(1, 13)}
    known = {str(j): coords[j] for j in range(1, 60)}
    c: NetCoord | None = None
    for _ in range(6):
        c = refit(c, mine, about, known)
    assert c is not None
    errs = [abs(c.rtt_ms(coords[j]) - rtt(0, j)) / rtt(0, j) for j in range(13, 60)]  # type: ignore[arg-type]
    assert statistics.median(errs) < 0.15


# --- liars --------------------------------------------------------------------------------------------


def claims_close(_i: int, _j: int, _true: float, _rng: random.Random) -> float:
    return 2.0  # "I am next door to everyone"


def inflates(_i: int, _j: int, true: float, _rng: random.Random) -> float:
    return 10.0 * true


def random_claims(_i: int, _j: int, _true: float, rng: random.Random) -> float:
    return rng.uniform(1.0, 1000.0)


@pytest.mark.parametrize("share", [0.1, 0.2])
@pytest.mark.parametrize("lie", [claims_close, inflates, random_claims], ids=lambda f: f.__name__)
def test_liars_barely_move_honest_coordinates_and_never_look_closer(share: float, lie: Liar) -> None:
    """10-20 % of the endpoints report false RTTs. Honest pairs keep their accuracy (within 3
    points of the run without liars), honest endpoints stay trusted, and a liar routing still
    trusts (its lies happened to be near the truth) is predicted no nearer than 0.8 of its real
    distance to any honest endpoint."""
    n, rounds = 150, 30
    rtt, _ = world_matrix(n, random.Random(21))
    baseline = play(n, rtt, rounds, random.Random(3))
    n_liars = int(share * n)
    liars = {i: lie for i in range(n_liars)}
    coords = play(n, rtt, rounds, random.Random(3), liars)
    honest = list(range(n_liars, n))
    base_errs = relative_errors(baseline, rtt, honest)
    errs = relative_errors(coords, rtt, honest)
    assert statistics.median(errs) <= statistics.median(base_errs) + 0.03
    assert quantile(errs, 0.9) <= quantile(base_errs, 0.9) + 0.05
    assert all(c is not None and c.error <= UNTRUSTED_ERROR for i, c in coords.items() if i in honest)
    for liar in liars:
        c = coords[liar]
        if c is None or c.error > UNTRUSTED_ERROR:
            continue  # routing prices it as unknown (pessimistically)
        for b in honest:
            cb = coords[b]
            assert cb is not None
            assert c.rtt_ms(cb) >= 0.8 * rtt(liar, b)
    if lie is claims_close:
        # Every pair of a liar claiming 2 ms to peers it is far from is disputed.
        assert all(coords[i] is None or coords[i].error > UNTRUSTED_ERROR for i in liars)  # type: ignore[union-attr]


def test_a_claim_never_moves_the_peer_it_names() -> None:
    """Claims made about an endpoint by others do not change its position (only the endpoint's
    own measurements do); a claim far from the endpoint's own counts as a dispute."""
    me = NetCoord((10.0, 0.0, 0.0), 5.0, 0.2)
    peers = {"a": NetCoord((60.0, 0.0, 0.0), 5.0, 0.2), "b": NetCoord((0.0, 80.0, 0.0), 5.0, 0.2)}
    own = {"a": 61.0, "b": 92.0}
    honest = refit(me, own, {"a": 60.0}, peers)
    lied_about = refit(
        me, own, {"a": 60.0, "b": 2.0, "liar": 1.0}, {**peers, "liar": NetCoord((0.0, 0.0, 500.0))}
    )
    assert honest is not None and lied_about is not None
    assert lied_about.vec == refit(me, {"a": 61.0}, {"a": 60.0}, peers).vec  # type: ignore[union-attr]
    assert lied_about.error >= 0.5  # one of its two two-sided pairs is disputed
    obs, both, disputes = observations(own, {"a": 60.0, "b": 2.0}, peers)
    assert [o.peer_key for o in obs] == ["a"] and obs[0].rtt_ms == 61.0
    assert (both, disputes) == (2, 1)


def test_the_larger_of_two_consistent_claims_counts() -> None:
    peers = {"p": NetCoord((50.0, 0.0, 0.0))}
    obs, both, disputes = observations({"p": 40.0}, {"p": 55.0}, peers)
    assert obs[0].rtt_ms == 55.0 and (both, disputes) == (1, 0)
    obs, _, _ = observations({"p": 55.0}, {"p": 40.0}, peers)
    assert obs[0].rtt_ms == 55.0


def test_probe_back_lists_peers_that_measured_us_only() -> None:
    assert probe_back({"a": 1.0}, {"a": 2.0, "c": 3.0, "b": 4.0}, limit=8) == ["b", "c"]
    assert probe_back({}, {str(i): 1.0 for i in range(20)}, limit=4) == ["0", "1", "10", "11"]


# --- bounds and hygiene -----------------------------------------------------------------------------------


def test_claim_tables_stay_bounded_and_fresh() -> None:
    table: dict[str, tuple[float, float]] = {}
    for t in range(100):
        table = merge_claims(table, [(f"p{t}", 10.0 + t)], float(t), max_age_s=1000.0)
    assert len(table) == MAX_CLAIMS_PER_REPORTER
    assert min(at for _, at in table.values()) == 100 - MAX_CLAIMS_PER_REPORTER
    aged = merge_claims(table, [("new", 1.0)], 200.0, max_age_s=110.0)
    assert set(aged) == {"new"} | {f"p{t}" for t in range(90, 100)}


finite = st.floats(-1e4, 1e4, allow_nan=False)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.builds(NetCoord, st.tuples(finite, finite, finite), st.floats(0.0, 500.0), st.floats(0.0, 1.0)),
    st.lists(
        st.tuples(
            st.builds(
                NetCoord, st.tuples(finite, finite, finite), st.floats(0.0, 500.0), st.floats(0.0, 1.0)
            ),
            st.floats(-10.0, 1e6, allow_nan=False, allow_infinity=False),
        ),
        max_size=40,
    ),
)
def test_update_always_gives_a_valid_coordinate(own: NetCoord, obs: list[tuple[NetCoord, float]]) -> None:
    new = update(own, [Observation(f"p{i}", c, r) for i, (c, r) in enumerate(obs)])
    assert new.is_finite()
    assert new.height_ms >= MIN_HEIGHT_MS
    assert MIN_ERROR <= new.error <= 1.0


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.builds(NetCoord, st.tuples(finite, finite, finite), st.floats(0.0, 500.0), st.floats(0.0, 1.0)),
    st.builds(NetCoord, st.tuples(finite, finite, finite), st.floats(0.0, 500.0), st.floats(0.0, 1.0)),
    st.floats(0.001, 60_000.0),
)
def test_one_observation_moves_a_coordinate_a_bounded_step(own: NetCoord, peer: NetCoord, rtt: float) -> None:
    """However wild the claim, one observation moves at most cc * max(floor, ratio * distance)."""
    params = VivaldiParams(passes=1)
    new = update(own, [Observation("p", peer, rtt)], params)
    limit = params.cc * max(params.max_step_floor_ms, params.max_step_ratio * own.rtt_ms(peer))
    assert math.dist(new.vec, own.vec) <= limit + 1e-6
    assert abs(new.height_ms - own.height_ms) <= limit + 1e-6 or own.height_ms < MIN_HEIGHT_MS


def test_claims_below_a_microsecond_are_skipped() -> None:
    """A subnormal or zero RTT (a liar's, or a broken clock) is no measurement: skipped, no error."""
    own = NetCoord((0.0, 0.0, 0.0), 2.0, 0.5)
    tiny = [Observation("a", NetCoord((0.0, 0.0, 0.0), 0.0, 0.0), v) for v in (5e-324, 0.0, 1e-9)]
    assert update(own, tiny) == NetCoord(own.vec, own.height_ms, own.error)


def test_bad_coordinates_are_refused_and_typical_latency() -> None:
    with pytest.raises(ValueError):
        NetCoord((math.nan, 0.0, 0.0))
    with pytest.raises(ValueError):
        NetCoord((0.0, 0.0))  # type: ignore[arg-type]
    assert typical_one_way_ms([NetCoord((0.0, 0.0, 0.0))]) is None
    pts = [NetCoord((float(10 * i), 0.0, 0.0), MIN_HEIGHT_MS) for i in range(5)]
    # One-way distances 5..20 ms over 10 pairs; the 75th percentile is 15 ms.
    assert typical_one_way_ms(pts) == pytest.approx(15.0 + MIN_HEIGHT_MS)


# --- a small swarm: an endpoint's own region is a minority of its peers --------------------------------

SMALL = {"eu0": "eu", "eu1": "eu", "us0": "us", "us1": "us", "asia0": "asia", "asia1": "asia"}
SMALL_RTT = {("eu", "us"): 82.0, ("eu", "asia"): 152.0, ("us", "asia"): 122.0}


def _small_rtt(a: str, b: str) -> float:
    ra, rb = SMALL[a], SMALL[b]
    return 12.0 if ra == rb else SMALL_RTT.get((ra, rb)) or SMALL_RTT[(rb, ra)]


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_small_swarm_places_each_region_together(seed: int) -> None:
    """Six nodes in three regions (the emulated WAN's profile): each node's own region is one peer
    of five, a minority the outlier filter alone would ignore -- it froze nodes of one region 100+
    ms apart. Pairs both sides measured alike are confirmed and always count: every pair's
    prediction ends within 35 % (+5 ms) of the truth."""
    rng = random.Random(seed)
    names = list(SMALL)
    coords: dict[str, NetCoord | None] = dict.fromkeys(names)
    claims: dict[str, dict[str, float]] = {n: {} for n in names}
    for _ in range(120):
        order = names[:]
        rng.shuffle(order)
        for n in order:
            for p in rng.sample([p for p in names if p != n], 2):
                claims[n][p] = _small_rtt(n, p) * rng.uniform(1.0, 1.08)
            about = {p: claims[p][n] for p in names if n in claims[p]}
            coords[n] = refit(coords[n], claims[n], about, {p: coords[p] for p in names if p != n})
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ca, cb = coords[a], coords[b]
            assert ca is not None and cb is not None
            truth = _small_rtt(a, b)
            assert abs(ca.rtt_ms(cb) - truth) <= 0.35 * truth + 5.0, (a, b, ca.rtt_ms(cb), truth)
