"""The simulator's coordinates on arrays (sim/des/coords.py) against the tracker's refit, pair by pair.

Two references:

* ``DictCoordinates``: the simulator's coordinates as they were before the arrays -- claim tables
  as dicts per reporter, observations built per pair by :func:`tracker.coordinates.refit_many` --
  written out here. Same measurements, same claims, same probe-back lists: the arrays must give
  the same coordinates bit for bit (the same decisions and the same arithmetic), through churn,
  endpoints that come back, full claim tables and claims that age out.
* :func:`tracker.coordinates.refit` (the live tracker's, scalar) of every reporter of a round
  from the claims the round left and the coordinates it started with: equal within 1e-9.

The simulator takes one update per report; the tracker's eager refit of new endpoints (repeated
updates, ``refit(..., eager=True)``) is not simulated, so both references run with ``eager=False``.
"""

from __future__ import annotations

import random

import pytest

from sim.des.coords import (
    GATEWAY_POOL_PROBES,
    GATEWAY_RANDOM_PROBES,
    PROBE_BACK_MAX,
    SimCoordinates,
    gateway_key,
)
from sim.des.geography import PRESETS, Endpoint, Geography
from tracker.coordinates import MAX_CLAIMS_PER_REPORTER, NetCoord, refit, refit_many


class DictCoordinates:
    """The reference: per-pair Python dicts (sim/des/coords.py before it kept arrays)."""

    def __init__(self, geo: Geography, gateways: list[Endpoint], rng: random.Random, probes: int, ttl: float):
        self.geo, self.rng, self.probes, self.ttl = geo, rng, probes, ttl
        self.where: dict[str, Endpoint] = {gateway_key(i): e for i, e in enumerate(gateways)}
        self.claims: dict[str, dict[str, tuple[float, float]]] = {}
        self.about: dict[str, dict[str, tuple[float, float]]] = {}
        self.coords: dict[str, NetCoord | None] = {}

    def sync(self, live: dict[str, Endpoint]) -> list[str]:
        for gone in [k for k in self.where if k not in live and not k.startswith("gateway")]:
            self.where.pop(gone)
            for peer in self.claims.pop(gone, {}):
                self.about.get(peer, {}).pop(gone, None)
            self.coords.pop(gone, None)
        for k, e in live.items():
            self.where.setdefault(k, e)
        return list(live)

    def heartbeat(
        self, now: float, live: list[str], pairs: list[tuple[str, str]], pools: list[list[str]]
    ) -> None:
        rng, targets = self.rng, {n: {} for n in live}  # type: dict[str, dict[str, None]]
        for a, b in pairs:
            if a in targets and b in self.where and a != b:
                targets[a][b] = None
        for node in live:
            mine = targets[node]
            for _ in range(self.probes if len(live) > 1 else 0):
                peer = live[rng.randrange(len(live))]
                if peer != node:
                    mine[peer] = None
            own = self.claims.get(node, {})
            back = [p for p in self.about.get(node, {}) if p not in own and p in self.where]
            for peer in sorted(back)[:PROBE_BACK_MAX]:
                if not peer.startswith("gateway"):
                    mine[peer] = None
        for g, pool in enumerate(pools):
            chosen = dict.fromkeys(pool[:GATEWAY_POOL_PROBES])
            for _ in range(GATEWAY_RANDOM_PROBES if live else 0):
                chosen[live[rng.randrange(len(live))]] = None
            targets[gateway_key(g)] = chosen
        for reporter, peers in targets.items():
            for peer in peers:
                if peer in self.where:
                    true = 2.0 * self.geo.one_way_ms(self.where[reporter], self.where[peer])
                    r = rng.random
                    self.claim(reporter, peer, true * (1.0 + 0.1 * min(r(), r(), r())), now)
        items = [self.item(k, now) for k in targets]
        for key, new in zip(targets, refit_many(items, eager=False), strict=True):
            self.coords[key] = new

    def item(self, key: str, now: float):  # type: ignore[no-untyped-def]
        cutoff = now - self.ttl
        claimed = {p: r for p, (r, at) in self.claims.get(key, {}).items() if at >= cutoff}
        about = {p: r for p, (r, at) in self.about.get(key, {}).items() if at >= cutoff}
        known = {p: self.coords.get(p) for p in (*claimed, *about) if p in self.where}
        return key, self.coords.get(key), claimed, about, known

    def claim(self, reporter: str, peer: str, rtt: float, now: float) -> None:
        table = self.claims.setdefault(reporter, {})
        table.pop(peer, None)
        table[peer] = (rtt, now)
        self.about.setdefault(peer, {})[reporter] = (rtt, now)
        if len(table) > MAX_CLAIMS_PER_REPORTER:
            oldest = next(iter(table))
            del table[oldest]
            self.about.get(oldest, {}).pop(reporter, None)


def _world(seed: int, n: int) -> tuple[Geography, list[Endpoint], dict[str, Endpoint]]:
    geo = Geography(PRESETS["world"], 2, 25, random.Random(f"{seed}/geo"))
    gateways = [geo.place_in(r) for r in ("us-east", "europe", "asia")]
    names = random.Random(f"{seed}/names")
    return geo, gateways, {f"n{names.randrange(10**6):06d}-{i}": geo.place_node() for i in range(n)}


def _rounds(seed: int, n: int, rounds: int):  # type: ignore[no-untyped-def]
    """Each round: who is live (a rotating seventh away: leaves and comes back), push pairs (many
    per node, so some claim tables fill and evict), gateway pools."""
    ids = list(_world(seed, n)[2])
    for k in range(rounds):
        live = [i for j, i in enumerate(ids) if (j + k) % 7 != 0]
        pairs = [
            (live[j], live[(j * 31 + 7 * m) % len(live)]) for j in range(len(live)) for m in range(1 + j % 9)
        ]
        yield 10.0 * (k + 1), live, pairs, [live[g::11][:20] for g in range(3)]


@pytest.mark.parametrize("seed", [1, 2])
def test_arrays_equal_the_dict_reference_bit_for_bit(seed: int) -> None:
    geo_a, gws, eps = _world(seed, 150)
    ref = DictCoordinates(geo_a, gws, random.Random(f"{seed}/c"), 2, ttl=35.0)  # claims age out
    geo_b, gws_b, _ = _world(seed, 150)
    fast = SimCoordinates(
        geo_b, gws_b, random.Random(f"{seed}/c"), probes_per_heartbeat=2, noise=0.1, claim_ttl_s=35.0
    )
    evicted = False
    for now, live, pairs, pools in _rounds(seed, 150, 16):
        order = ref.sync({i: eps[i] for i in live})
        assert fast.sync({i: eps[i] for i in live}) == order
        ref.heartbeat(now, order, pairs, pools)
        fast.heartbeat(now, order, pairs, pools)
        evicted |= any(len(t) == MAX_CLAIMS_PER_REPORTER for t in ref.claims.values())
        assert fast.coords == ref.coords  # NetCoord equality: every float the same
    assert evicted, "no claim table filled up: the eviction path was not exercised"
    placed = [c for c in fast.coords.values() if c is not None]
    assert len(placed) > 100


def test_each_round_is_the_trackers_refit_per_endpoint() -> None:
    geo, gws, eps = _world(3, 120)
    fast = SimCoordinates(geo, gws, random.Random("3/c"), probes_per_heartbeat=3, noise=0.1, claim_ttl_s=35.0)
    ref = DictCoordinates(geo, gws, random.Random("unused"), 3, ttl=35.0)
    for now, live, pairs, pools in _rounds(3, 120, 10):
        order = fast.sync({i: eps[i] for i in live})
        before = dict(fast.coords)
        fast.heartbeat(now, order, pairs, pools)
        # The claims the round left, read back from the arrays into the reference's dicts.
        ref.where = dict(fast._where)
        ref.claims, ref.about = {}, {}
        for r, slots in enumerate(fast._slots):
            for p, j in slots.items():
                rep, peer = fast._ids[r], fast._ids[p]
                entry = (float(fast._rtt[r, j]), float(fast._at[r, j]))
                ref.claims.setdefault(rep, {})[peer] = entry
                ref.about.setdefault(peer, {})[rep] = entry
        ref.coords = before
        for key in [*order, *(gateway_key(g) for g in range(3))]:
            _k, own, claimed, about, known = ref.item(key, now)
            want = refit(own, claimed, about, known, key=key, eager=False)
            got = fast.coords.get(key)
            if want is None:
                assert got is None
                continue
            assert got is not None
            assert got.vec == pytest.approx(want.vec, rel=1e-9, abs=1e-9)
            assert got.height_ms == pytest.approx(want.height_ms, rel=1e-9, abs=1e-9)
            assert got.error == pytest.approx(want.error, rel=1e-9, abs=1e-12)
