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
  (:func:`tracker.coordinates.refit_many`, vectorised; each reads the coordinates the
  round started with).

Coordinates reach routing through the snapshot (``ShardView.coord``) at the next
load refresh, and the gateway's own as the ``origin`` of its route requests.
Deterministic: one ``random.Random`` stream, fixed iteration orders.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable

from sim.des.geography import Endpoint, Geography
from tracker.coordinates import MAX_CLAIMS_PER_REPORTER, NetCoord, refit_many

PROBE_BACK_MAX = 6
GATEWAY_POOL_PROBES = 16
GATEWAY_RANDOM_PROBES = 4


def gateway_key(index: int) -> str:
    return f"gateway{index}"


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
        self._where: dict[str, Endpoint] = {gateway_key(i): e for i, e in enumerate(gateways)}
        self._claims: dict[str, dict[str, tuple[float, float]]] = {}  # reporter -> peer -> (rtt, at)
        self._about: dict[str, dict[str, tuple[float, float]]] = {}  # peer -> reporter -> (rtt, at)
        self.coords: dict[str, NetCoord | None] = {}
        self.rounds = 0
        self.refits = 0
        self.wall_s = 0.0  # time spent here (machine-dependent)

    # -- membership ------------------------------------------------------------
    def add(self, node_id: str, endpoint: Endpoint) -> None:
        self._where[node_id] = endpoint

    def remove(self, node_id: str) -> None:
        """The node is gone: its claims go, and it is no longer a known peer (claims about it age out)."""
        self._where.pop(node_id, None)
        for peer in self._claims.pop(node_id, {}):
            self._about.get(peer, {}).pop(node_id, None)
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
            own = self._claims.get(node, {})
            back = [p for p in self._about.get(node, {}) if p not in own and p in self._where]
            for peer in sorted(back)[:PROBE_BACK_MAX]:
                if not peer.startswith("gateway"):  # gateways cannot be measured back
                    mine[peer] = None
        for g, pool in enumerate(gateway_pools):
            key = gateway_key(g)
            chosen = dict.fromkeys(pool[:GATEWAY_POOL_PROBES])
            for _ in range(GATEWAY_RANDOM_PROBES if n_live else 0):
                chosen[live[rng.randrange(n_live)]] = None
            targets[key] = chosen
        for reporter, peers in targets.items():
            for peer in peers:
                if peer in self._where:
                    self._claim(reporter, peer, self._measure(reporter, peer), now_s)
        # Every reporter is refitted from the coordinates as they were at the start of the round
        # (as a tracker refitting each heartbeat's reporter sees its peers), in one vectorised call.
        reporters = list(targets)
        cutoff = now_s - self.claim_ttl_s
        items: list[
            tuple[str, NetCoord | None, dict[str, float], dict[str, float], dict[str, NetCoord | None]]
        ] = []
        where, coords = self._where, self.coords
        for key in reporters:
            claimed = {p: r for p, (r, at) in self._claims.get(key, {}).items() if at >= cutoff}
            about = {p: r for p, (r, at) in self._about.get(key, {}).items() if at >= cutoff}
            known = {p: coords.get(p) for p in (*claimed, *about) if p in where}
            items.append((key, coords.get(key), claimed, about, known))
        for key, new in zip(reporters, refit_many(items), strict=True):
            coords[key] = new
        self.refits += len(reporters)
        self.rounds += 1
        self.wall_s += time.perf_counter() - t0

    def _measure(self, a: str, b: str) -> float:
        true = 2.0 * self.geo.one_way_ms(self._where[a], self._where[b])
        r = self.rng.random
        return true * (1.0 + self.noise * min(r(), r(), r()))

    def _claim(self, reporter: str, peer: str, rtt: float, now_s: float) -> None:
        table = self._claims.setdefault(reporter, {})
        table.pop(peer, None)  # re-inserted last: the table stays ordered from the oldest claim
        table[peer] = (rtt, now_s)
        self._about.setdefault(peer, {})[reporter] = (rtt, now_s)
        if len(table) > MAX_CLAIMS_PER_REPORTER:
            oldest = next(iter(table))
            del table[oldest]
            self._about.get(oldest, {}).pop(reporter, None)
