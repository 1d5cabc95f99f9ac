"""Network coordinates: pairwise latency estimates without n^2 state (Vivaldi with a height).

Pure: standard library and numpy (:func:`update_many`, the vectorised refit of many endpoints)
only, no I/O, no clock (times are passed in), no randomness (directions for coincident points
come from a hash of the peer's id).

The model
    Every endpoint (node or gateway) has a :class:`NetCoord`: a point ``vec`` in
    R^3 (milliseconds), a ``height_ms`` >= ``MIN_HEIGHT_MS`` and an ``error``
    estimate in [``MIN_ERROR``, 1]. The predicted round-trip time between two
    endpoints is ``|vec_a - vec_b| + height_a + height_b``: the Euclidean part
    models the core of the internet, the heights the access links every path
    to an endpoint crosses (Dabek et al., "Vivaldi", SIGCOMM 2004). One number
    per endpoint and dimension: the tracker stores O(n) state, and any pair's
    latency is predicted on demand.

Samples and claims
    Nodes and gateways measure RTTs to the peers they talk to and report them
    (``proto.announce.RttSample``). The tracker keeps, per reporter, its latest
    *claim* per peer (bounded: ``MAX_CLAIMS_PER_REPORTER``, at most
    ``claim_ttl`` old). An endpoint's coordinate is refitted from its own
    claims, checked against what the peers claimed about it
    (:func:`observations`):

    * a pair only the endpoint claimed counts with its claim;
    * a pair both sides claimed counts with the **larger** claim (RTT is
      symmetric and queueing only adds delay, so the larger honest value is the
      safe one, and a lowered claim cannot win) -- unless the two claims are
      more than ``dispute_ratio`` apart: then one side lies, the pair counts for
      neither, and it is a *dispute* for both;
    * a pair only the peer claimed does not move the endpoint; the tracker asks
      the endpoint to measure that peer too (:func:`probe_back`), so every pair
      between nodes soon has both sides.

    The error estimate of an endpoint is at least the share of its two-sided
    pairs that are disputed. Routing ignores coordinates whose error exceeds
    ``UNTRUSTED_ERROR`` (such an endpoint is priced like one without a
    coordinate, at a pessimistic typical latency).

    Each step of the update is clipped to ``max_step_ratio`` of the predicted
    distance (at least ``max_step_floor_ms``), and observations far off the
    current prediction (``outlier_factor`` times the 75th percentile of the
    endpoint's misfits, in log ratio, and at least a factor
    ``min_outlier_ratio``) count less, or not at all beyond twice that. The
    reference is a high quantile, not the median, so that an honest minority
    of observations (up to a quarter) that the current position does not fit
    yet still moves it: a filter keyed to the median can freeze a coordinate
    in a wrong place. A pair both sides measured alike (within ``AGREE_RATIO``
    plus the slack) is *confirmed* and never filtered: in a small swarm the
    few peers in an endpoint's own region are a minority of its observations;
    the filter alone froze such an endpoint far from them (seen on the
    emulated WAN: two asia nodes 12 ms apart predicted 179 ms apart), and
    those are the links routing cares most about.

What a liar can do (and what it cannot)
    A liar controls the claims it reports and nothing else.

    * Claims move only the reporter's own coordinate, never the peer named:
      a liar cannot pull or push an honest node's coordinate with its claims.
      It influences honest coordinates only through its own position, as a peer
      in their refits, where it is one observation of many, weighted by its
      confidence (Vivaldi's ``e_i / (e_i + e_j)``) and filtered as an outlier
      when far off.
    * It cannot look closer to a node than that node measured it: once both
      sides reported the pair, the larger claim wins, and a claim far below the
      other side's is a dispute. A liar that claims to be near nodes that
      measured it far ends up with every pair disputed: no coordinate, or an
      untrusted one -- routing then prices it pessimistically.
    * Before anyone measured it, a liar can look close to whomever it names.
      The tracker asks those peers to measure it back (their next heartbeat),
      so this lasts one or two heartbeat intervals.
    * An honest node with a share ``f`` of lying counterparts gets an error of
      at least ``f`` (its disputes) and keeps its position: with ``f`` below
      ``UNTRUSTED_ERROR`` it stays usable. ``tests/tracker/test_coordinates.py``
      measures the honest error with 5-20 % liars of three kinds.
    * Many identities (Sybils) are out of scope: each one is placed only by its
      own claims, and each pair with an honest node is checked from both sides.
    * Gateways cannot be measured back (they accept no gRPC): a gateway's claims
      place only that gateway, and so only change its own routes. For that reason
      they are *vouched* (``refit(vouched=True)``): counted as confirmed, never
      filtered as outliers -- with no pair ever two-sided, the filter alone would
      decide which of a gateway's claims count, and it can drop the claims about the
      nodes nearest it for good.

Bounds
    A claim's RTT is in ``[MIN_RTT_MS, MAX_RTT_MS]`` (others are skipped); a refit looks at most
    ``MAX_OBSERVATIONS`` observations; every step is clipped (above).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

DIMENSIONS = 3
MIN_HEIGHT_MS = 0.05
MIN_ERROR = 0.01
MAX_RTT_MS = 60_000.0
MIN_RTT_MS = 0.001  # a claim below one microsecond is not a measurement
MAX_CLAIMS_PER_REPORTER = 32  # peers whose latest RTT claim the tracker keeps per reporter
MAX_OBSERVATIONS = 96  # observations one refit looks at
DISPUTE_SLACK_MS = 10.0  # two claims within this (plus the ratio) never dispute: jitter on short paths
UNTRUSTED_ERROR = 0.5  # a coordinate with a larger error estimate is not used for routing
AGREE_RATIO = 1.25  # two claims about a pair this close (plus the slack) confirm each other
# A refit of an endpoint that is new or whose error estimate is above ``EAGER_ERROR`` repeats the
# update over the same observations up to ``EAGER_ROUNDS`` times in all, stopping once a repeat
# moves the coordinate less than ``EAGER_MIN_STEP_MS`` (see :func:`refit`).
EAGER_ERROR = 0.5
EAGER_ROUNDS = 8
EAGER_MIN_STEP_MS = 1.0

Vec = tuple[float, float, float]


@dataclass(frozen=True)
class NetCoord:
    vec: Vec
    height_ms: float = MIN_HEIGHT_MS
    error: float = 1.0  # Vivaldi's relative error estimate: 1 = knows nothing yet

    def rtt_ms(self, other: NetCoord) -> float:
        """Predicted round-trip time to ``other`` (milliseconds)."""
        a, b = self.vec, other.vec
        return math.dist(a, b) + self.height_ms + other.height_ms

    def one_way_ms(self, other: NetCoord) -> float:
        return 0.5 * self.rtt_ms(other)

    def __post_init__(self) -> None:
        if len(self.vec) != DIMENSIONS or not all(
            math.isfinite(x) for x in (*self.vec, self.height_ms, self.error)
        ):
            raise ValueError(f"a network coordinate needs {DIMENSIONS} finite numbers, a height and an error")

    def is_finite(self) -> bool:
        return all(math.isfinite(x) for x in (*self.vec, self.height_ms, self.error))


ORIGIN = NetCoord((0.0, 0.0, 0.0), MIN_HEIGHT_MS, 1.0)


@dataclass(frozen=True)
class VivaldiParams:
    cc: float = 0.25  # how far one observation moves a coordinate (times the confidence weight)
    ce: float = 0.25  # how fast the error estimate follows
    max_step_ratio: float = 0.5  # one observation moves at most this share of the predicted distance
    max_step_floor_ms: float = 40.0  # ... or this much, whichever is larger
    passes: int = 2  # passes over the observations per refit
    dispute_ratio: float = 2.0  # two claims about one pair further apart than this: the pair is dropped
    outlier_quantile: float = 0.75  # the misfit a refit compares against: this quantile of its own ...
    outlier_factor: float = 3.0  # ... and observations this many times that far off count less or not
    min_outlier_ratio: float = 2.0  # ... but never those within this factor of it


DEFAULT_PARAMS = VivaldiParams()


@dataclass(frozen=True)
class Observation:
    peer_key: str  # the peer's id (only its hash is used: the direction when two points coincide)
    peer: NetCoord
    rtt_ms: float
    # Both sides measured the pair and agree (within ``AGREE_RATIO`` and ``DISPUTE_SLACK_MS``):
    # a fact about the network, never filtered as an outlier (see :func:`update`).
    confirmed: bool = False


def _unit_from_key(key: str, salt: int) -> Vec:
    """A deterministic pseudo-random unit vector (two coincident points need some direction)."""
    digest = hashlib.sha256(f"{salt}:{key}".encode()).digest()
    v = [int.from_bytes(digest[4 * i : 4 * i + 4], "big") / 2**31 - 1.0 for i in range(DIMENSIONS)]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return (v[0] / norm, v[1] / norm, v[2] / norm)


def update(own: NetCoord, obs: Sequence[Observation], params: VivaldiParams = DEFAULT_PARAMS) -> NetCoord:
    """``own`` after ``params.passes`` Vivaldi steps over ``obs`` (in the order given, at most
    ``MAX_OBSERVATIONS`` of them). Observations with a non-finite or out-of-range RTT or peer
    are skipped; the result is always finite."""
    x0, x1, x2 = own.vec
    h = max(own.height_ms, MIN_HEIGHT_MS)
    e = min(max(own.error, MIN_ERROR), 1.0)
    # (peer x, y, z, height, error, rtt, key, confirmed) of the usable observations, read once.
    peers = [
        (
            o.peer.vec[0],
            o.peer.vec[1],
            o.peer.vec[2],
            max(o.peer.height_ms, MIN_HEIGHT_MS),
            min(max(o.peer.error, MIN_ERROR), 1.0),
            o.rtt_ms,
            o.peer_key,
            o.confirmed,
        )
        for o in obs[:MAX_OBSERVATIONS]
        if MIN_RTT_MS <= o.rtt_ms <= MAX_RTT_MS and o.peer.is_finite()
    ]
    sqrt, log = math.sqrt, math.log
    floor_ratio = log(params.min_outlier_ratio)
    for p in range(params.passes):
        # Robust filter: an observation whose RTT is further off the current prediction than
        # ``outlier_factor`` times this endpoint's typical misfit (the ``outlier_quantile`` of its
        # misfits, in log ratio; at least a factor ``min_outlier_ratio``) counts less, and beyond
        # twice that not at all, this pass. With liars under a quarter of the observations the
        # reference is an honest misfit, so wild claims do nothing and mild ones do little.
        misfit = [
            abs(log(rtt / (sqrt((x0 - y0) ** 2 + (x1 - y1) ** 2 + (x2 - y2) ** 2) + h + hj)))
            for y0, y1, y2, hj, _ej, rtt, _k, _c in peers
        ]
        cutoff = 0.0
        if misfit:
            ordered = sorted(misfit)
            typical = ordered[min(len(ordered) - 1, int(params.outlier_quantile * len(ordered)))]
            cutoff = max(params.outlier_factor * typical, floor_ratio)
        for (y0, y1, y2, hj, ej, rtt, key, confirmed), m in zip(peers, misfit, strict=True):
            if m > 2.0 * cutoff and not confirmed:
                continue
            trust = 1.0 if m <= cutoff or confirmed else (cutoff / m) ** 2
            d0, d1, d2 = x0 - y0, x1 - y1, x2 - y2
            euclid = sqrt(d0 * d0 + d1 * d1 + d2 * d2)
            dist = euclid + h + hj
            residual = rtt - dist  # > 0: too close in the model, move away
            weight = e / (e + ej)
            gain = params.ce * weight * trust
            e = min(max(abs(residual) / rtt * gain + e * (1.0 - gain), MIN_ERROR), 1.0)
            limit = max(params.max_step_floor_ms, params.max_step_ratio * dist)
            residual = min(max(residual, -limit), limit)
            step = params.cc * weight * trust * residual
            # Height-vector arithmetic: moving along the unit vector of [x - y, h + hj], whose
            # norm is the predicted RTT, changes the position and the height in proportion.
            if euclid > 1e-9:
                scale = step / dist
                x0 += scale * d0
                x1 += scale * d1
                x2 += scale * d2
            else:  # two coincident points: a direction from the peer's id
                u0, u1, u2 = _unit_from_key(key, p)
                x0 += step * u0
                x1 += step * u1
                x2 += step * u2
            h = max(MIN_HEIGHT_MS, h + step * (h + hj) / dist)
    if not all(math.isfinite(v) for v in (x0, x1, x2, h, e)):
        return own
    return NetCoord((x0, x1, x2), h, e)


def disputed(mine: float, theirs: float, ratio: float) -> bool:
    """Two claims about one pair that cannot both be honest: one is ``ratio`` times the other
    (plus ``DISPUTE_SLACK_MS`` for jitter on short paths)."""
    lo, hi = (mine, theirs) if mine <= theirs else (theirs, mine)
    return hi > ratio * lo + DISPUTE_SLACK_MS


def observations(
    own_claims: Mapping[str, float],
    claims_about: Mapping[str, float],
    peers: Mapping[str, NetCoord | None],
    params: VivaldiParams = DEFAULT_PARAMS,
    *,
    vouched: bool = False,
) -> tuple[list[Observation], int, int]:
    """The observations one endpoint's refit uses (see the module docstring), in a fixed
    order, with the number of two-sided pairs and how many of them are disputed.

    ``own_claims``: peer id -> RTT this endpoint reported; ``claims_about``: peer id -> RTT
    that peer reported about this endpoint; ``peers``: the known peers' coordinates, None
    for a known peer without one yet (it counts as the origin, so a new swarm can start);
    a peer id missing from ``peers`` is not a known endpoint and is skipped. At most
    ``MAX_OBSERVATIONS``, sorted by peer id. A claim only the peer made is not used here
    (see :func:`probe_back`).

    ``vouched``: the endpoint's one-sided claims count as confirmed (never filtered as outliers).
    For a gateway: nobody can measure a gateway back, so without this none of its pairs is ever
    confirmed, and the outlier filter alone decides which of its claims count -- it can drop the
    claims about the nodes nearest the gateway, the legs its routes use most, for good (see
    docs/tracker.md, Network coordinates). Its claims still place only the gateway itself."""
    out: list[Observation] = []
    both = disputes = 0
    ratio = params.dispute_ratio
    for peer_id in sorted(own_claims):
        if peer_id not in peers:
            continue
        rtt = own_claims[peer_id]
        other = claims_about.get(peer_id)
        if other is not None:
            both += 1
            # disputed(rtt, other, ...), written out: this runs for every pair of every refit
            lo, hi = (rtt, other) if rtt <= other else (other, rtt)
            if hi > ratio * lo + DISPUTE_SLACK_MS:
                disputes += 1
                continue  # one side lies: the pair counts for neither
            confirmed = hi <= AGREE_RATIO * lo + DISPUTE_SLACK_MS
            rtt = hi
        else:
            confirmed = vouched
        out.append(Observation(peer_id, peers[peer_id] or ORIGIN, rtt, confirmed))
    return out[:MAX_OBSERVATIONS], both, disputes


def probe_back(own_claims: Mapping[str, float], claims_about: Mapping[str, float], limit: int) -> list[str]:
    """Peers that measured this endpoint but were not measured by it (sorted, at most ``limit``):
    the tracker asks the endpoint to probe them, so every pair gets checked from both sides."""
    return sorted(p for p in claims_about if p not in own_claims)[:limit]


def first_position(key: str, own_claims: Mapping[str, float]) -> NetCoord:
    """Where an endpoint's first coordinate starts: a direction from a hash of its id, at half
    the median of its own claims (at least 1 ms) -- never the origin.

    Starting everyone at the origin collapses the embedding onto a line: the first endpoint
    placed moves away from the origin along some direction, the next ones move along the
    lines joining them to it, and Vivaldi's forces between collinear points stay on that line.
    Three regions cannot be embedded on a line (the heights absorb the misfit: on the
    emulated WAN two eu nodes 12 ms apart were predicted 100 ms apart with 40-50 ms heights)
    and the points leave the line only through rounding, over hundreds of refits. A
    replay of the live claims took 274-297 rounds from origin starts and 7-36 from these
    (docs/tracker.md, Network coordinates)."""
    if not key:
        return ORIGIN
    values = sorted(v for v in own_claims.values() if MIN_RTT_MS <= v <= MAX_RTT_MS)
    radius = max(1.0, 0.5 * values[len(values) // 2]) if values else 1.0
    u = _unit_from_key(key, -1)
    return NetCoord((radius * u[0], radius * u[1], radius * u[2]), MIN_HEIGHT_MS, 1.0)


def _eager(own: NetCoord | None) -> bool:
    """A refit of this endpoint repeats its update (new, or its error estimate still high)."""
    return own is None or own.error > EAGER_ERROR


def refit(
    own: NetCoord | None,
    own_claims: Mapping[str, float],
    claims_about: Mapping[str, float],
    peers: Mapping[str, NetCoord | None],
    params: VivaldiParams = DEFAULT_PARAMS,
    *,
    key: str = "",
    eager: bool = True,
    vouched: bool = False,
) -> NetCoord | None:
    """The endpoint's new coordinate, or its old one (None: still unknown) when it has no
    observation of a known peer. A first coordinate starts at :func:`first_position` of
    ``key`` (the endpoint's id; the origin without one). The error estimate is at least the
    share of its two-sided pairs that are disputed (an endpoint others contradict counts for
    little in their refits, and routing prices it as unknown past ``UNTRUSTED_ERROR``).

    An *eager* refit -- the endpoint is new or its error estimate is above ``EAGER_ERROR`` --
    repeats :func:`update` over the same observations, up to ``EAGER_ROUNDS`` updates in all,
    stopping after a repeat that moved the coordinate (position plus height) less than
    ``EAGER_MIN_STEP_MS``, unless one of its two-sided pairs is disputed (repeats would fit a
    liar's claims faster too). The repeats move the point and the height; the error estimate
    stays the first update's, so it still falls one update per report and a newcomer does not
    look confident sooner than before. Each repeat is an ordinary update (the dispute, confirmed and outlier
    rules and the step clipping apply to every pass), so a newcomer's coordinate covers in one
    report the distance it would otherwise cover in several. A settled endpoint (error at most
    ``EAGER_ERROR``) gets exactly one update, as before. Only the tracker's refit does this; the
    simulator's array refit (:func:`update_arrays`) takes one update per report, as this does
    with ``eager=False``.

    ``vouched``: the endpoint's one-sided claims count as confirmed (a gateway's; see
    :func:`observations`)."""
    obs, both, disputes = observations(own_claims, claims_about, peers, params, vouched=vouched)
    start = own if own is not None else first_position(key, own_claims)
    new = update(start, obs, params) if obs else own
    if eager and new is not None and obs and not disputes and _eager(own):
        error = new.error  # the repeats move the point, not the error estimate (see above)
        for _ in range(EAGER_ROUNDS - 1):
            again = update(new, obs, params)
            moved = math.dist(again.vec, new.vec) + abs(again.height_ms - new.height_ms)
            new = NetCoord(again.vec, again.height_ms, error)
            if moved < EAGER_MIN_STEP_MS:
                break
    share = disputes / both if both else 0.0
    if new is not None and share > new.error:
        new = NetCoord(new.vec, new.height_ms, min(1.0, share))
    return new


def merge_claims(
    previous: Mapping[str, tuple[float, float]],
    fresh: Iterable[tuple[str, float]],
    now_s: float,
    *,
    max_age_s: float,
    limit: int = MAX_CLAIMS_PER_REPORTER,
) -> dict[str, tuple[float, float]]:
    """A reporter's claim table (peer id -> (rtt_ms, at_s)) after a report: fresh claims replace
    older ones, claims older than ``max_age_s`` go, and at most ``limit`` newest stay."""
    table = {k: v for k, v in previous.items() if now_s - v[1] <= max_age_s}
    for peer_id, rtt in fresh:
        table[peer_id] = (float(rtt), now_s)
    if len(table) > limit:
        newest = sorted(table.items(), key=lambda kv: (-kv[1][1], kv[0]))[:limit]
        table = dict(newest)
    return table


def typical_one_way_ms(
    coords: Sequence[NetCoord], quantile: float = 0.75, max_points: int = 64
) -> float | None:
    """The ``quantile`` of predicted one-way latencies over pairs of (at most ``max_points``,
    evenly picked) coordinates; None with fewer than two. Routing prices a hop to an endpoint
    without a coordinate at this (pessimistic) figure."""
    if len(coords) < 2:
        return None
    stride = max(1, len(coords) // max_points)
    pts = list(coords[::stride])[:max_points]
    values = sorted(a.one_way_ms(b) for i, a in enumerate(pts) for b in pts[i + 1 :])
    if not values:
        return None
    idx = min(len(values) - 1, max(0, math.ceil(quantile * len(values)) - 1))
    return values[idx]


def update_many(
    owns: Sequence[NetCoord], obs: Sequence[Sequence[Observation]], params: VivaldiParams = DEFAULT_PARAMS
) -> list[NetCoord]:
    """:func:`update` of many endpoints at once (``owns[i]`` from ``obs[i]``), vectorised across
    them: the same steps in the same order for each, so each result equals ``update(owns[i],
    obs[i])`` up to floating-point rounding. Every endpoint reads its peers' coordinates as given
    (a refit of many endpoints in one round sees the round's starting positions)."""
    n = len(owns)
    if len(obs) != n:
        raise ValueError("update_many needs one observation list per endpoint")
    # (A NetCoord is finite by construction, so only the RTT's range filters here.)
    rows = [[o for o in lst[:MAX_OBSERVATIONS] if MIN_RTT_MS <= o.rtt_ms <= MAX_RTT_MS] for lst in obs]
    width = max((len(r) for r in rows), default=0)
    x = np.array([o.vec for o in owns], dtype=float).reshape(n, DIMENSIONS)
    h = np.array([o.height_ms for o in owns], dtype=float)
    e = np.array([o.error for o in owns], dtype=float)
    if width == 0 or n == 0:
        h, e = np.maximum(h, MIN_HEIGHT_MS), np.clip(e, MIN_ERROR, 1.0)
        return [
            NetCoord((float(a), float(b), float(c)), float(hh), float(ee))
            for (a, b, c), hh, ee in zip(x.tolist(), h, e, strict=True)
        ]
    # Every row's observations, flattened, then scattered into (endpoint, observation) arrays.
    flat = [o for r in rows for o in r]
    at_row = np.repeat(np.arange(n), [len(r) for r in rows])
    at_col = np.concatenate([np.arange(len(r)) for r in rows])
    valid = np.zeros((n, width), dtype=bool)
    valid[at_row, at_col] = True
    y = np.zeros((n, width, DIMENSIONS))
    y[at_row, at_col] = np.array([o.peer.vec for o in flat], dtype=float).reshape(len(flat), DIMENSIONS)
    hj = np.full((n, width), MIN_HEIGHT_MS)
    hj[at_row, at_col] = [o.peer.height_ms for o in flat]
    ej = np.ones((n, width))
    ej[at_row, at_col] = [o.peer.error for o in flat]
    rtt = np.ones((n, width))
    rtt[at_row, at_col] = [o.rtt_ms for o in flat]
    confirmed = np.zeros((n, width), dtype=bool)
    confirmed[at_row, at_col] = [o.confirmed for o in flat]
    x, h, e = update_arrays(
        x, h, e, y, hj, ej, rtt, confirmed, valid, lambda i, j: rows[i][j].peer_key, params
    )
    out: list[NetCoord] = []
    for i in range(n):
        xi, hi, ei = x[i], float(h[i]), float(e[i])
        if not (np.isfinite(xi).all() and math.isfinite(hi) and math.isfinite(ei)):
            out.append(owns[i])
        else:
            out.append(NetCoord((float(xi[0]), float(xi[1]), float(xi[2])), hi, ei))
    return out


def update_arrays(
    x: np.ndarray,
    h: np.ndarray,
    e: np.ndarray,
    y: np.ndarray,
    hj: np.ndarray,
    ej: np.ndarray,
    rtt: np.ndarray,
    confirmed: np.ndarray,
    valid: np.ndarray,
    peer_key: Callable[[int, int], str],
    params: VivaldiParams = DEFAULT_PARAMS,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The Vivaldi steps of :func:`update` for ``n`` endpoints at once, on arrays: ``x`` (n, 3),
    ``h``, ``e`` (n,) the starting positions, heights and errors; per endpoint and observation
    slot (n, w): the peer's position ``y`` (n, w, 3), height ``hj``, error ``ej``, the ``rtt``,
    ``confirmed``, and ``valid`` (the slots that hold an observation, in the order
    :func:`update` would take them; invalid slots may hold anything finite). ``peer_key(i, j)``
    names the peer of slot ``j`` of endpoint ``i`` (only asked for when two points coincide).
    Heights and errors are clamped as :func:`update` does. Returns the new ``(x, h, e)``; a row
    may be non-finite only where :func:`update` would keep the old coordinate (the caller
    checks). Nothing is filtered here: the caller leaves out-of-range RTTs and slots past
    ``MAX_OBSERVATIONS`` invalid."""
    n = x.shape[0]
    width = valid.shape[1] if valid.ndim == 2 else 0
    h = np.maximum(h, MIN_HEIGHT_MS)
    e = np.clip(e, MIN_ERROR, 1.0)
    if n == 0 or width == 0:
        return x, h, e
    hj = np.where(valid, np.maximum(hj, MIN_HEIGHT_MS), MIN_HEIGHT_MS)
    ej = np.where(valid, np.clip(ej, MIN_ERROR, 1.0), 1.0)
    rtt = np.where(valid, rtt, 1.0)
    confirmed = confirmed & valid
    counts = valid.sum(axis=1)
    floor_ratio = math.log(params.min_outlier_ratio)
    quantile_at = np.minimum(counts - 1, (params.outlier_quantile * counts).astype(np.intp)).clip(0)
    rows_idx = np.arange(n)
    for p in range(params.passes):
        d = x[:, None, :] - y
        pred = np.sqrt(np.einsum("ijk,ijk->ij", d, d)) + h[:, None] + hj
        misfit = np.abs(np.log(rtt / pred))
        ordered = np.sort(np.where(valid, misfit, np.inf), axis=1)
        typical = ordered[rows_idx, quantile_at]
        cutoff = np.where(counts > 0, np.maximum(params.outlier_factor * typical, floor_ratio), 0.0)
        for j in range(width):
            m = misfit[:, j]
            live = valid[:, j] & ((m <= 2.0 * cutoff) | confirmed[:, j])
            if not live.any():
                continue
            safe_m = np.where(m > 0, m, 1.0)
            trust = np.where((m <= cutoff) | confirmed[:, j], 1.0, (cutoff / safe_m) ** 2)
            dv = x - y[:, j]
            euclid = np.sqrt(np.einsum("ij,ij->i", dv, dv))
            dist = euclid + h + hj[:, j]
            residual = rtt[:, j] - dist
            weight = e / (e + ej[:, j])
            gain = params.ce * weight * trust
            e_new = np.clip(np.abs(residual) / rtt[:, j] * gain + e * (1.0 - gain), MIN_ERROR, 1.0)
            limit = np.maximum(params.max_step_floor_ms, params.max_step_ratio * dist)
            residual = np.clip(residual, -limit, limit)
            step = params.cc * weight * trust * residual
            apart = euclid > 1e-9
            move = np.where(apart, step / dist, 0.0)[:, None] * dv
            together = live & ~apart
            if together.any():  # coincident points: a direction from the peer's id, as in update()
                for i in np.flatnonzero(together).tolist():
                    u = _unit_from_key(peer_key(i, j), p)
                    move[i] = (step[i] * u[0], step[i] * u[1], step[i] * u[2])
            x = np.where(live[:, None], x + move, x)
            h = np.where(live, np.maximum(MIN_HEIGHT_MS, h + step * (h + hj[:, j]) / dist), h)
            e = np.where(live, e_new, e)
    return x, h, e


@dataclass(frozen=True)
class PairChecks:
    """What :func:`check_pairs` decided, per endpoint (row) and claim slot."""

    rtt: np.ndarray  # (n, w) the RTT an observation counts with (a two-sided pair: the larger claim)
    confirmed: np.ndarray  # (n, w) both sides measured the pair alike
    valid: np.ndarray  # (n, w) the slot is an observation update() takes
    observed: np.ndarray  # (n,) observations() returned something (refit moves the endpoint)
    both: np.ndarray  # (n,) two-sided pairs
    disputes: np.ndarray  # (n,) disputed pairs among them


def check_pairs(
    rtt: np.ndarray, other: np.ndarray, usable: np.ndarray, params: VivaldiParams = DEFAULT_PARAMS
) -> PairChecks:
    """:func:`observations`' checks on arrays, for many endpoints' claims at once: ``rtt`` (n, w)
    the endpoints' own claims, ``other`` (n, w) what the peer claimed about the endpoint (NaN:
    nothing), ``usable`` (n, w) the slots that hold a claim about a known peer, in the order
    :func:`observations` takes them (sorted by peer id). The same decisions as
    :func:`observations` followed by :func:`update`'s filters (at most ``MAX_OBSERVATIONS``, the
    RTT in range), made with the same comparisons."""
    two_sided = usable & ~np.isnan(other)
    theirs = np.where(two_sided, other, rtt)
    lo = np.minimum(rtt, theirs)
    hi = np.maximum(rtt, theirs)
    disputed_ = two_sided & (hi > params.dispute_ratio * lo + DISPUTE_SLACK_MS)
    confirmed = two_sided & (hi <= AGREE_RATIO * lo + DISPUTE_SLACK_MS)
    value = np.where(two_sided, hi, rtt)
    kept = usable & ~disputed_
    kept &= np.cumsum(kept, axis=1) <= MAX_OBSERVATIONS
    valid = kept & (value >= MIN_RTT_MS) & (value <= MAX_RTT_MS)
    return PairChecks(value, confirmed, valid, kept.any(axis=1), two_sided.sum(axis=1), disputed_.sum(axis=1))


def refit_many(
    items: Sequence[
        tuple[str, NetCoord | None, Mapping[str, float], Mapping[str, float], Mapping[str, NetCoord | None]]
    ],
    params: VivaldiParams = DEFAULT_PARAMS,
    *,
    eager: bool = True,
) -> list[NetCoord | None]:
    """:func:`refit` of many endpoints at once, each item ``(key, own, own_claims, claims_about,
    peers)``; the Vivaldi steps run vectorised (:func:`update_many`), so each result equals
    ``refit(own, own_claims, claims_about, peers, key=key, eager=eager)`` up to floating-point
    rounding."""
    prepared = [observations(own_claims, about, peers, params) for _k, _o, own_claims, about, peers in items]
    todo = [i for i, (obs, _b, _d) in enumerate(prepared) if obs]
    starts = [
        own if own is not None else first_position(key, own_claims)
        for key, own, own_claims, _a, _p in (items[i] for i in todo)
    ]
    updated = update_many(starts, [prepared[i][0] for i in todo], params)
    # The repeats of the eager refits (see refit), each endpoint until its own repeat moves little.
    again_rows = [x for x, i in enumerate(todo) if eager and not prepared[i][2] and _eager(items[i][1])]
    for _ in range(EAGER_ROUNDS - 1):
        if not again_rows:
            break
        again = update_many(
            [updated[x] for x in again_rows], [prepared[todo[x]][0] for x in again_rows], params
        )
        still: list[int] = []
        for x, moved_c in zip(again_rows, again, strict=True):
            old_c = updated[x]
            updated[x] = NetCoord(moved_c.vec, moved_c.height_ms, old_c.error)
            if (
                math.dist(moved_c.vec, old_c.vec) + abs(moved_c.height_ms - old_c.height_ms)
                >= EAGER_MIN_STEP_MS
            ):
                still.append(x)
        again_rows = still
    result: list[NetCoord | None] = [own for _k, own, _c, _a, _p in items]
    for i, new in zip(todo, updated, strict=True):
        result[i] = new
    for i, (_obs, both, disputes) in enumerate(prepared):
        share = disputes / both if both else 0.0
        new_c = result[i]
        if new_c is not None and share > new_c.error:
            result[i] = NetCoord(new_c.vec, new_c.height_ms, min(1.0, share))
    return result


__all__ = [
    "DIMENSIONS",
    "MAX_CLAIMS_PER_REPORTER",
    "MAX_OBSERVATIONS",
    "MAX_RTT_MS",
    "MIN_RTT_MS",
    "MIN_ERROR",
    "MIN_HEIGHT_MS",
    "NetCoord",
    "ORIGIN",
    "Observation",
    "VivaldiParams",
    "DEFAULT_PARAMS",
    "merge_claims",
    "observations",
    "probe_back",
    "disputed",
    "first_position",
    "UNTRUSTED_ERROR",
    "AGREE_RATIO",
    "DISPUTE_SLACK_MS",
    "refit",
    "refit_many",
    "EAGER_ERROR",
    "EAGER_ROUNDS",
    "EAGER_MIN_STEP_MS",
    "typical_one_way_ms",
    "update",
    "update_many",
    "update_arrays",
    "check_pairs",
    "PairChecks",
]
