"""Recent demand per model: how many route look-ups each model had, decayed over time.

Rebalancing (:mod:`tracker.rebalance`) weighs a model's capacity against its demand. The
tracker sees demand as route look-ups (``/v1/routes``): each one counts 1, and a count
halves every ``half_life_s`` seconds, so the meter follows a shift of demand from one
model to another within a few half-lives and forgets a burst. A gateway keeps a pool of
routes and asks again as it uses them, so look-ups follow requests (roughly: a gateway
that asks for k routes per look-up counts once).

Pure (no clock: times are passed in) and bounded: at most ``max_models`` models, the one
with the least demand going first.
"""

from __future__ import annotations

import math


class DemandMeter:
    def __init__(self, half_life_s: float, max_models: int = 10_000) -> None:
        if half_life_s <= 0 or max_models < 1:
            raise ValueError("half_life_s must be > 0 and max_models >= 1")
        self.half_life_s = half_life_s
        self.max_models = max_models
        self._counts: dict[str, tuple[float, float]] = {}  # model -> (decayed count, as of time)

    def _decayed(self, count: float, since_s: float, now_s: float) -> float:
        age = max(0.0, now_s - since_s)
        return count * math.exp2(-age / self.half_life_s)

    def record(self, model_fingerprint: str, now_s: float, weight: float = 1.0) -> None:
        """One look-up for ``model_fingerprint`` at ``now_s``."""
        count, since = self._counts.get(model_fingerprint, (0.0, now_s))
        self._counts[model_fingerprint] = (self._decayed(count, since, now_s) + weight, now_s)
        if len(self._counts) > self.max_models:
            rates = self.rates(now_s)
            del self._counts[min(rates, key=lambda m: (rates[m], m))]

    def rates(self, now_s: float) -> dict[str, float]:
        """Model -> decayed look-ups per second (the count over the decay's mean life)."""
        mean_life = self.half_life_s / math.log(2)
        return {m: self._decayed(c, t, now_s) / mean_life for m, (c, t) in self._counts.items()}

    def __len__(self) -> int:
        return len(self._counts)


__all__ = ["DemandMeter"]
