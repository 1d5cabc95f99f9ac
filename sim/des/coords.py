"""Network coordinates in the simulator: the tracker's own pure functions fed with simulated RTTs.

What the real swarm does (node/rtt.py, common/rtt.py, tracker/store.py), once per
heartbeat interval:

* every serving node measures the stages it pushes to (the next stage of each
  of its sessions; the last stage, the first: the decode ring), the random live
  nodes the tracker hands it (``rtt_probes_per_heartbeat``) and the nodes that
  measured it but that it has not measured (probe-back, at most 6);
* every gateway measures the nodes of its route pools (at most 16) and 4 random
  live nodes;
* a reported RTT is the geography's true RTT (twice the one-way latency) times
  1 + ``rtt_noise`` x the least of three uniform [0, 1] draws: each ping pays
  some queueing, and the node reports the minimum of its last three pings
  (``common.rtt.RttBook``);
* the tracker keeps each reporter's latest claim per peer (at most
  ``MAX_CLAIMS_PER_REPORTER``, none older than ``claim_ttl_s``) and refits every
  reporter from its own claims and the claims about it: what
  :func:`tracker.coordinates.refit` does for each, run for all reporters of a round at once
  on arrays (:func:`tracker.coordinates.check_pairs` and
  :func:`tracker.coordinates.update_arrays`, the arithmetic of
  :func:`~tracker.coordinates.update_many`; each reads the coordinates the round started
  with).

The claims live in arrays (a row of ``MAX_CLAIMS_PER_REPORTER`` slots per endpoint: peer,
RTT, time), so a round's checks and steps are numpy over all reporters, not Python per
pair: at 10 000 nodes a round costs ~0.1 s instead of ~2 s. ``tests/sim/test_sim_coords_fast.py``
checks the rounds against :func:`tracker.coordinates.refit` endpoint by endpoint.

Coordinates reach routing through the snapshot (``ShardView.coord``) at the next
load refresh, and the gateway's own as the ``origin`` of its route requests.
Deterministic: one ``random.Random`` stream, fixed iteration orders.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from typing import cast

import numpy as np

from sim.des.geography import Endpoint, Geography
from tracker.coordinates import (
    MAX_CLAIMS_PER_REPORTER,
    MIN_HEIGHT_MS,
    NetCoord,
    check_pairs,
    first_position,
    update_arrays,
)

PROBE_BACK_MAX = 6
GATEWAY_POOL_PROBES = 16
GATEWAY_RANDOM_PROBES = 4


def gateway_key(index: int) -> str:
    return f"gateway{index}"


_MT_WORDS = 624


def uniforms(rng: random.Random, n: int) -> np.ndarray:
    """The next ``n`` values of ``rng.random()``, bit for bit, drawn by numpy from the same
    Mersenne Twister state; ``rng`` moves on past them as if it had drawn them one by one.
    (Both generate a double from two 32-bit words the same way: MT19937's genrand_res53.)"""
    version, state, gauss = rng.getstate()
    mt = np.random.RandomState()
    mt.set_state(("MT19937", np.array(state[:_MT_WORDS], dtype=np.uint32), state[_MT_WORDS], 0, 0.0))
    out = mt.random_sample(n)
    _, key, pos, _, _ = cast("tuple[str, np.ndarray, int, int, float]", mt.get_state())
    rng.setstate((version, (*key.tolist(), int(pos)), gauss))
    return out


class SimCoordinates:
    def __init__(
        self,
        geo: Geography,
        gateways: list[Endpoint],
        rng: random.Random,
        *,
        probes_per_heartbeat: int,
        noise: float,
        claim_ttl_s: float = 600.0,
    ) -> None:
        self.geo = geo
        self.rng = rng
        self.probes = probes_per_heartbeat
        self.noise = noise
        self.claim_ttl_s = claim_ttl_s
        self._where: dict[str, Endpoint] = {}
        # Every endpoint ever seen has a row for good (an id that comes back keeps its row: the
        # claims others hold about it are still about it).
        self._index: dict[str, int] = {}
        self._ids: list[str] = []
        cap, k = 1024, MAX_CLAIMS_PER_REPORTER
        self._peer = np.full((cap, k), -1, dtype=np.int64)  # row -> claimed peer's row (-1: empty)
        self._rtt = np.zeros((cap, k))
        self._at = np.zeros((cap, k))
        # row -> the slot of the claimed peer's claim about the row's endpoint (-1: it made none)
        self._back = np.full((cap, k), -1, dtype=np.int64)
        # Per row: claimed peer's row -> slot, oldest claim first (a fresh claim is re-inserted last).
        self._slots: list[dict[int, int]] = []
        self._region: list[int] = []  # row -> its region's index (for the RTT measurements)
        self._access: list[float] = []  # row -> its access latency (ms, one way)
        regions = geo.model.regions
        self._half_np = np.array([[geo.model.rtt(a, b) / 2.0 for b in regions] for a in regions])
        self._region_at = {name: i for i, name in enumerate(regions)}
        # A round's writes to the claim arrays, applied at its end: row * K + slot -> value.
        self._put_peer: dict[int, int] = {}
        self._put_rtt: dict[int, float] = {}
        self._put_at = 0.0  # the round's time
        self._known = np.zeros(cap, dtype=bool)  # a live node or a gateway
        self._gateway = np.zeros(cap, dtype=bool)
        self._has = np.zeros(cap, dtype=bool)  # has a coordinate
        self._x = np.zeros((cap, 3))  # coordinates; a row without one holds the origin's
        self._h = np.full(cap, MIN_HEIGHT_MS)
        self._e = np.ones(cap)
        self._rank = np.zeros(0, dtype=np.int64)  # row -> position of its id in sorted order
        self.coords: dict[str, NetCoord | None] = {}
        self.rounds = 0
        self.refits = 0
        self.wall_s = 0.0  # time spent here (machine-dependent)
        for i, e in enumerate(gateways):
            self.add(gateway_key(i), e)
            self._gateway[self._index[gateway_key(i)]] = True

    # -- membership ------------------------------------------------------------
    def _row(self, key: str) -> int:
        r = self._index.get(key)
        if r is None:
            r = self._index[key] = len(self._ids)
            self._ids.append(key)
            self._slots.append({})
            self._region.append(0)
            self._access.append(0.0)
            if r >= len(self._known):
                self._grow(2 * len(self._known))
        return r

    def _grow(self, cap: int) -> None:
        old = len(self._known)

        def more(a: np.ndarray, fill: float) -> np.ndarray:
            b = np.full((cap, *a.shape[1:]), fill, dtype=a.dtype)
            b[:old] = a
            return b

        self._peer, self._back = more(self._peer, -1), more(self._back, -1)
        self._rtt, self._at = more(self._rtt, 0.0), more(self._at, 0.0)
        self._known, self._gateway, self._has = (
            more(self._known, 0),
            more(self._gateway, 0),
            more(self._has, 0),
        )
        self._x, self._h, self._e = more(self._x, 0.0), more(self._h, MIN_HEIGHT_MS), more(self._e, 1.0)

    def add(self, node_id: str, endpoint: Endpoint) -> None:
        self._where[node_id] = endpoint
        r = self._row(node_id)  # (may grow the arrays)
        self._known[r] = True
        self._region[r] = self._region_at[endpoint.region]
        self._access[r] = endpoint.access_ms

    def remove(self, node_id: str) -> None:
        """The node is gone: its claims go, and it is no longer a known peer (claims about it age out)."""
        self._where.pop(node_id, None)
        r = self._index.get(node_id)
        if r is not None:
            for p in self._slots[r]:  # the peers' claims about it lose their other side
                jp = self._slots[p].get(r)
                if jp is not None:
                    self._back[p, jp] = -1
            self._known[r] = self._has[r] = False
            self._peer[r] = self._back[r] = -1
            self._slots[r] = {}
            self._x[r], self._h[r], self._e[r] = 0.0, MIN_HEIGHT_MS, 1.0
        self.coords.pop(node_id, None)

    def coord(self, key: str) -> NetCoord | None:
        return self.coords.get(key)

    # -- one heartbeat's measurements and refits ----------------------------------
    def sync(self, live: dict[str, Endpoint]) -> list[str]:
        """Membership from the serving nodes (id -> where): newcomers become known, the departed are
        forgotten. Returns the live node ids in a fixed order."""
        for gone in [k for k in self._where if k not in live and not k.startswith("gateway")]:
            self.remove(gone)
        for node_id, endpoint in live.items():
            if node_id not in self._where:
                self.add(node_id, endpoint)
        return list(live)

    def _ranks(self) -> np.ndarray:
        if len(self._rank) != len(self._ids):
            ids = self._ids
            rank = np.empty(len(ids), dtype=np.int64)
            rank[sorted(range(len(ids)), key=ids.__getitem__)] = np.arange(len(ids))
            self._rank = rank
        return self._rank

    def _probe_back(self, live: list[str]) -> dict[int, list[int]]:
        """Per live node's row: the rows of at most ``PROBE_BACK_MAX`` (by sorted id) known endpoints
        that claimed it and that it has not claimed, as the tracker's probe-back list."""
        n_rows = len(self._ids)
        rows = np.flatnonzero(self._known[:n_rows])
        if not len(rows):
            return {}
        about = self._back[rows]
        peer = self._peer[rows]
        want = (peer >= 0) & (about < 0)  # row r claimed p, p did not claim r: p should measure r
        want &= self._known[np.where(peer >= 0, peer, 0)]
        r_at, k_at = np.nonzero(want)
        target = peer[r_at, k_at]
        source = rows[r_at]
        order = np.lexsort((self._ranks()[source], target))
        target, source = target[order], source[order]
        first = np.searchsorted(target, target, side="left")
        keep = (np.arange(len(target)) - first) < PROBE_BACK_MAX
        out: dict[int, list[int]] = {}
        for t, src in zip(target[keep].tolist(), source[keep].tolist(), strict=True):
            out.setdefault(t, []).append(src)
        return out

    def heartbeat(
        self,
        now_s: float,
        live: list[str],
        push_pairs: Iterable[tuple[str, str]],
        gateway_pools: list[list[str]],
    ) -> None:
        """Everybody measures (see the module docstring), then every reporter is refitted."""
        t0 = time.perf_counter()
        rng = self.rng
        ids, index, gateway = self._ids, self._index, self._gateway
        back = self._probe_back(live)
        targets: dict[str, dict[str, None]] = {n: {} for n in live}
        for a, b in push_pairs:
            if a in targets and b in self._where and a != b:
                targets[a][b] = None
        n_live = len(live)
        for node in live:
            mine = targets[node]
            if n_live > 1:
                for _ in range(self.probes):
                    peer = live[rng.randrange(n_live)]
                    if peer != node:
                        mine[peer] = None
            for p in back.get(index[node], ()):
                if not gateway[p]:  # gateways cannot be measured back
                    mine[ids[p]] = None
        for g, pool in enumerate(gateway_pools):
            key = gateway_key(g)
            chosen = dict.fromkeys(pool[:GATEWAY_POOL_PROBES])
            for _ in range(GATEWAY_RANDOM_PROBES if n_live else 0):
                chosen[live[rng.randrange(n_live)]] = None
            targets[key] = chosen
        # Every pair's measurement (~60 000 a round at 10 000 nodes): the geography's round trip
        # times 1 + noise x the least of three draws. The draws are the stream's next 3 x pairs
        # random() values, drawn at once (uniforms, bit for bit what rng.random() gives, in order)
        # and the arithmetic is numpy's, the same operations in the same order as per pair.
        where = self._where
        rep_rows: list[int] = []
        peer_rows: list[int] = []
        for reporter, peers in targets.items():
            r = index[reporter]
            for peer in peers:
                if peer in where:
                    rep_rows.append(r)
                    peer_rows.append(index[peer])
        if rep_rows:
            rr = np.array(rep_rows, dtype=np.int64)
            pr = np.array(peer_rows, dtype=np.int64)
            draws = uniforms(rng, 3 * len(rep_rows)).reshape(-1, 3)
            region = np.array(self._region, dtype=np.int64)
            access = np.array(self._access)
            true = 2.0 * ((self._half_np[region[rr], region[pr]] + access[rr]) + access[pr])
            rtts = true * (1.0 + self.noise * draws.min(axis=1))
            self._claims(rep_rows, peer_rows, rtts.tolist(), now_s)
        self._apply_claims()
        # Every reporter is refitted from the coordinates as they were at the start of the round
        # (as a tracker refitting each heartbeat's reporter sees its peers), all at once.
        reporters = list(targets)
        self._refit(np.array([index[k] for k in reporters], dtype=np.int64), now_s - self.claim_ttl_s)
        self.refits += len(reporters)
        self.rounds += 1
        self.wall_s += time.perf_counter() - t0

    def _refit(self, rows: np.ndarray, cutoff: float) -> None:
        """:func:`tracker.coordinates.refit` of every row's endpoint, on arrays (same decisions,
        same arithmetic as ``refit_many``)."""
        peer, rtt, at = self._peer[rows], self._rtt[rows], self._at[rows]
        safe = np.where(peer >= 0, peer, 0)
        claimed = (peer >= 0) & (at >= cutoff)
        usable = claimed & self._known[safe]
        slot = self._back[rows]
        safe_slot = np.where(slot >= 0, slot, 0)
        other = np.where(
            (slot >= 0) & (self._at[safe, safe_slot] >= cutoff), self._rtt[safe, safe_slot], np.nan
        )
        # observations() takes a row's claims sorted by peer id
        order = np.argsort(
            np.where(usable, self._ranks()[safe], np.iinfo(np.int64).max), axis=1, kind="stable"
        )
        width = int(usable.sum(axis=1).max()) if len(rows) else 0
        order = order[:, :width]
        pick = lambda a: np.take_along_axis(a, order, axis=1)  # noqa: E731
        peer_s, safe_s = pick(peer), pick(safe)
        checks = check_pairs(pick(rtt), pick(other), pick(usable))
        # A row without a coordinate starts at first_position() of its id and its claims.
        x, h, e = self._x[rows].copy(), self._h[rows].copy(), self._e[rows].copy()
        has = self._has[rows]
        ids = self._ids
        for i in np.flatnonzero(~has & checks.observed).tolist():
            own = {
                str(p): v
                for p, v in zip(peer[i][claimed[i]].tolist(), rtt[i][claimed[i]].tolist(), strict=True)
            }
            start = first_position(ids[int(rows[i])], own)
            x[i], h[i], e[i] = start.vec, start.height_ms, start.error
        nx, nh, ne = update_arrays(
            x,
            h,
            e,
            self._x[safe_s],
            self._h[safe_s],
            self._e[safe_s],
            checks.rtt,
            checks.confirmed,
            checks.valid,
            lambda i, j: ids[int(peer_s[i, j])],
        )
        finite = np.isfinite(nx).all(axis=1) & np.isfinite(nh) & np.isfinite(ne)
        moved = checks.observed & finite  # a non-finite result keeps the start, as update() does
        x = np.where(moved[:, None], nx, x)
        h = np.where(moved, nh, h)
        e = np.where(moved, ne, e)
        now_has = has | checks.observed
        share = np.divide(checks.disputes, checks.both, out=np.zeros(len(rows)), where=checks.both > 0)
        e = np.where(now_has & (share > e), np.minimum(1.0, share), e)
        self._x[rows], self._h[rows], self._e[rows], self._has[rows] = x, h, e, now_has
        coords = self.coords
        make = NetCoord.__new__
        for key, has_i, xi, hi, ei in zip(
            (ids[r] for r in rows.tolist()), now_has.tolist(), x.tolist(), h.tolist(), e.tolist(), strict=True
        ):
            if has_i:  # finite (a non-finite update kept the start): NetCoord(...) without its checks
                c = make(NetCoord)
                c.__dict__.update(vec=(xi[0], xi[1], xi[2]), height_ms=hi, error=ei)
                coords[key] = c
            else:
                coords[key] = None

    def _claims(self, reporters: list[int], peers: list[int], rtts: list[float], now_s: float) -> None:
        """Keep each reporter's latest claim about each peer, pair by pair in order (at most
        ``MAX_CLAIMS_PER_REPORTER`` per reporter, the oldest goes). The arrays change at
        :meth:`_apply_claims`."""
        slots_of = self._slots
        put_peer, put_rtt = self._put_peer, self._put_rtt
        k = MAX_CLAIMS_PER_REPORTER
        for reporter, peer, rtt in zip(reporters, peers, rtts, strict=True):
            slots = slots_of[reporter]
            j = slots.pop(peer, None)  # re-inserted last: the slots stay ordered from the oldest claim
            if j is None:
                if len(slots) < k:
                    j = len(slots)
                else:  # full: the oldest claim goes (the other sides are redone in _apply_claims)
                    j = slots.pop(next(iter(slots)))
                put_peer[reporter * k + j] = peer
            slots[peer] = j
            put_rtt[reporter * k + j] = rtt
        if reporters:
            self._put_at = now_s

    def _link_back(self, at: np.ndarray, new_peer: np.ndarray, old_peer: np.ndarray) -> None:
        """The other sides of the round's new claims (flat slots ``at``, the peer each now names,
        the peer it named before; ``_peer`` already updated): ``_back[r, j]`` is the slot of the
        claim of ``_peer[r, j]`` about ``r``, -1 where it made none. What keeping it up claim by
        claim gives: an evicted claim's other side loses it, then each new claim finds its other
        side and becomes the other side of it."""
        k = MAX_CLAIMS_PER_REPORTER
        r, j = at // k, at % k
        back = self._back
        gone = old_peer >= 0
        if gone.any():
            o, ro = old_peer[gone], r[gone]
            m = self._peer[o] == ro[:, None]
            hit = m.any(axis=1)
            back[o[hit], m[hit].argmax(axis=1)] = -1
        m = self._peer[new_peer] == r[:, None]  # where the new peer's row claims the reporter
        hit = m.any(axis=1)
        jp = m.argmax(axis=1)
        back[r, j] = np.where(hit, jp, -1)
        back[new_peer[hit], jp[hit]] = j[hit]

    def _apply_claims(self) -> None:
        """The round's claims into the arrays (a later write to a slot wins, as it would one by one)."""
        put = self._put_peer
        if put:
            at = np.fromiter(put, np.int64, len(put))
            new_peer = np.fromiter(put.values(), np.int64, len(put))
            flat = self._peer.reshape(-1)
            old_peer = flat[at]
            flat[at] = new_peer
            put.clear()
            self._link_back(at, new_peer, old_peer)
        rtts = self._put_rtt
        if rtts:
            at = np.fromiter(rtts, np.int64, len(rtts))
            self._rtt.reshape(-1)[at] = np.fromiter(rtts.values(), float, len(rtts))
            self._at.reshape(-1)[at] = self._put_at
            rtts.clear()
