"""Where nodes and gateways are, and the network latency between them.

Nodes are placed in regions (with a share of the volunteers each); one-way
latency between two endpoints is half the inter-region round-trip time plus
each endpoint's own last-mile latency (drawn once per endpoint). The
inter-region RTTs of the "world" preset are typical public-internet medians
between large cities (rounded); "continent" is one continent's spread;
"lan" is one switch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RegionModel:
    regions: tuple[str, ...]
    node_share: tuple[float, ...]
    rtt_ms: dict[tuple[str, str], float]  # symmetric; both orders present

    def rtt(self, a: str, b: str) -> float:
        return self.rtt_ms[(a, b)]


def _model(
    regions: list[tuple[str, float]], same_region_rtt_ms: float, pairs: dict[tuple[str, str], float]
) -> RegionModel:
    names = tuple(r for r, _ in regions)
    rtt: dict[tuple[str, str], float] = {}
    for a in names:
        rtt[(a, a)] = same_region_rtt_ms
    for (a, b), v in pairs.items():
        rtt[(a, b)] = v
        rtt[(b, a)] = v
    missing = [(a, b) for a in names for b in names if (a, b) not in rtt]
    if missing:  # pragma: no cover - a preset bug
        raise ValueError(f"RTT missing for {missing}")
    return RegionModel(names, tuple(s for _, s in regions), rtt)


PRESETS: dict[str, RegionModel] = {
    "lan": _model([("lan", 1.0)], 0.2, {}),
    "continent": _model(
        [("eu-west", 0.4), ("eu-central", 0.4), ("eu-north", 0.2)],
        8.0,
        {("eu-west", "eu-central"): 15.0, ("eu-west", "eu-north"): 30.0, ("eu-central", "eu-north"): 25.0},
    ),
    "world": _model(
        [
            ("us-east", 0.25),
            ("us-west", 0.15),
            ("europe", 0.3),
            ("asia", 0.2),
            ("south-america", 0.05),
            ("oceania", 0.05),
        ],
        15.0,
        {
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
        },
    ),
}


@dataclass
class Endpoint:
    region: str
    access_ms: float  # one-way last-mile latency


class Geography:
    """Draws endpoint locations and answers one-way latency between endpoints."""

    def __init__(
        self, model: RegionModel, access_ms_min: float, access_ms_max: float, rng: random.Random
    ) -> None:
        self.model = model
        self._lo = access_ms_min
        self._hi = access_ms_max
        self._rng = rng
        self._half_rtt = {k: v / 2.0 for k, v in model.rtt_ms.items()}

    def place_node(self) -> Endpoint:
        region = self._rng.choices(self.model.regions, weights=self.model.node_share)[0]
        return Endpoint(region, self._rng.uniform(self._lo, self._hi))

    def place_in(self, region: str, access_ms: float = 0.05) -> Endpoint:
        return Endpoint(region, access_ms)

    def one_way_ms(self, a: Endpoint, b: Endpoint) -> float:
        return self._half_rtt[(a.region, b.region)] + a.access_ms + b.access_ms
