"""Client requests: when they arrive, for which model, how long prompts and answers are.

Requests start at ``start_s`` (so a swarm can form first). Poisson arrivals
at ``rate_per_s`` plus any bursts (a flash crowd adds its rate
for its window); since Poisson is memoryless, the next arrival is drawn at
the current rate and redrawn from a rate boundary if it would cross one.
Lengths are log-normal around a median, clipped. A trace file (JSON lines)
replays recorded arrivals instead.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sim.des.config import ScenarioError, WorkloadConfig


@dataclass(frozen=True)
class Request:
    t_s: float
    model_index: int
    prompt_tokens: int
    output_tokens: int


def _lognormal_int(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    v = median * math.exp(rng.gauss(0.0, sigma)) if sigma > 0 else median
    return max(1, min(cap, int(round(v))))


def poisson_requests(
    cfg: WorkloadConfig,
    model_shares: list[float],
    end_s: float,
    rng: random.Random,
    model_names: list[str] | None = None,
) -> Iterator[Request]:
    changes = sorted(
        {0.0, end_s, *(b.start_s for b in cfg.bursts), *(b.start_s + b.duration_s for b in cfg.bursts)}
    )

    def rate(t: float) -> float:
        return cfg.rate_per_s + sum(
            b.rate_per_s for b in cfg.bursts if b.start_s <= t < b.start_s + b.duration_s
        )

    def next_change(t: float) -> float:
        for c in changes:
            if c > t:
                return c
        return math.inf

    models = list(range(len(model_shares)))
    t = cfg.start_s
    while t < end_s:
        r = rate(t)
        boundary = next_change(t)
        if r <= 0:
            t = boundary
            continue
        dt = rng.expovariate(r)
        if t + dt >= boundary:
            t = boundary
            continue
        t += dt
        m = rng.choices(models, weights=model_shares)[0] if len(models) > 1 else 0
        named = [b for b in cfg.bursts if b.model and b.start_s <= t < b.start_s + b.duration_s]
        if named and model_names:  # a burst for one model: its share of the rate goes there
            pick = rng.random() * r
            for b in named:
                pick -= b.rate_per_s
                if pick < 0:
                    m = model_names.index(b.model)
                    break
        yield Request(
            t,
            m,
            _lognormal_int(rng, cfg.prompt_tokens_median, cfg.prompt_tokens_sigma, cfg.prompt_tokens_max),
            _lognormal_int(rng, cfg.output_tokens_median, cfg.output_tokens_sigma, cfg.output_tokens_max),
        )


def trace_requests(
    path: Path, model_names: list[str], end_s: float, start_s: float = 0.0
) -> Iterator[Request]:
    rows: list[Request] = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                t = float(row["t"])
                prompt, output = int(row["prompt_tokens"]), int(row["output_tokens"])
                name = row.get("model", model_names[0])
            except (ValueError, KeyError, TypeError) as err:
                raise ScenarioError(f"{path}:{lineno}: bad trace row: {err}") from err
            unknown = set(row) - {"t", "prompt_tokens", "output_tokens", "model"}
            if unknown:
                raise ScenarioError(f"{path}:{lineno}: unknown key(s) {sorted(unknown)}")
            if name not in model_names:
                raise ScenarioError(f"{path}:{lineno}: unknown model {name!r}")
            if prompt < 1 or output < 1 or t < 0:
                raise ScenarioError(f"{path}:{lineno}: lengths must be >= 1 and t >= 0")
            if t + start_s < end_s:
                rows.append(Request(t + start_s, model_names.index(name), prompt, output))
    rows.sort(key=lambda r: r.t_s)
    return iter(rows)
