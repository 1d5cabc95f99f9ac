"""The RTT sampler's warm-up (common/rtt.py): a new sampler measures after 1, 2, 4, 8 s, then every
``interval_s``; the warm-up restarts when most of a round's targets are new, at most once per four
intervals. Virtual time (trio's autojump clock): the ping answers after 2 ms of it."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from common.rtt import WARMUP_RESTART_MIN_S_FACTOR, RttSampler, RttSettings, Target


def _peers(prefix: str, n: int) -> list[Target]:
    return [(f"{prefix}{i}".ljust(64, "0"), f"10.0.0.{i + 1}:7000") for i in range(n)]


async def _round_starts(
    sampler: RttSampler, until_s: float, change: dict[float, list[Target]]
) -> list[float]:
    """Run the sampler until ``until_s`` (virtual); at each time in ``change`` its targets become the
    given list. Returns when each round started (seconds after the start, rounded to 0.1)."""
    starts: list[float] = []
    t0 = trio.current_time()
    measure = sampler.measure_once

    async def timed_round() -> None:
        starts.append(round(trio.current_time() - t0, 1))
        await measure()

    sampler.measure_once = timed_round  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(sampler.run)
        for at in sorted(change):
            await trio.sleep_until(t0 + at)
            sampler.hint(change[at])
        await trio.sleep_until(t0 + until_s)
        nursery.cancel_scope.cancel()
    return starts


def _sampler(settings: RttSettings) -> RttSampler:
    async def ping(_address: str) -> None:
        await trio.sleep(0.002)

    return RttSampler(ping, lambda: [], settings, own_id="f" * 64)


async def test_a_new_sampler_measures_after_1_2_4_8_seconds_then_every_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts = await _round_starts(_sampler(RttSettings(interval_s=15.0)), 80.0, {0.5: _peers("a", 4)})
    assert starts == [0.0, 1.0, 3.0, 7.0, 15.0, 30.0, 45.0, 60.0, 75.0]


async def test_without_warm_up_every_interval(autojump_clock: trio.testing.MockClock) -> None:
    starts = await _round_starts(_sampler(RttSettings(interval_s=15.0, warmup_s=0.0)), 50.0, {})
    assert starts == [0.0, 15.0, 30.0, 45.0]


async def test_new_targets_restart_the_warm_up_at_most_once_per_four_intervals(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """At 20 s most targets are new, but the warm-up began at 0 s (< 60 s ago): no restart. At 62 s
    they are all new again: the round after them restarts it (1, 2, 4, 8 s). From then on a new
    probe list every 10 s restarts it at most once per 60 s."""
    assert WARMUP_RESTART_MIN_S_FACTOR == 4.0
    change = {0.5: _peers("a", 4), 20.0: _peers("b", 4), 62.0: _peers("c", 4)}
    starts = await _round_starts(_sampler(RttSettings(interval_s=15.0)), 100.0, change)
    assert starts == [0.0, 1.0, 3.0, 7.0, 15.0, 30.0, 45.0, 60.0, 75.0, 76.0, 78.0, 82.0, 90.0]
    always_new = {10.0 * k + 0.5: _peers(f"x{k}", 4) for k in range(40)}
    starts = await _round_starts(_sampler(RttSettings(interval_s=15.0)), 400.0, always_new)
    warmups = [s for prev, s in zip(starts, starts[1:], strict=False) if s - prev == 1.0]
    assert len(warmups) <= 400.0 / 60.0 + 1
    gaps = [b - a for a, b in zip(warmups, warmups[1:], strict=False)]
    assert all(g >= 60.0 for g in gaps)


def test_warm_up_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="warmup_s"):
        RttSettings(warmup_s=-1.0).validate()
    with pytest.raises(ValueError, match="warmup_s"):
        RttSettings(warmup_s=float("nan")).validate()
