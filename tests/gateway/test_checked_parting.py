"""A checked request across recipes that parts at a near tie (gateway/checked.py ``CheckedSession``).

In memory: two scripted runs stand in for Route Sessions (a real swarm of two builds is the opt-in
tests/e2e/test_heterogeneous_builds_e2e.py). Both runs report the same tokens, then sample
different tokens the tolerance accepts: the check ends there, one run goes on alone, nobody is
accused -- the primary, unless it holds a node on probation and the shadow holds none."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import trio

from gateway.checked import CheckedSession
from gateway.checks import Tolerance
from gateway.errors import NoRoute
from gateway.session_machine import StageSpec, StepReport
from proto.codec import Sampled

NEAR_A = ((7, -0.70), (9, -0.75), (3, -2.5), (4, -4.0))
NEAR_B = ((9, -0.71), (7, -0.74), (3, -2.6), (4, -3.9))


def sure(token: int) -> Sampled:
    tops = ((token, -0.01), (token + 1, -5.0), (token + 2, -6.0), (token + 3, -7.0))
    return Sampled(token, -0.01, tops, False)


@dataclass
class _Machine:
    stages: list[StageSpec]


@dataclass
class ScriptedRun:
    """What CheckedSession uses of a RouteSession: tokens in order, each with its step report."""

    node: str
    tokens: list[Sampled]
    finished: bool = False
    recoveries: int = 0
    relays: int = 0
    closed: list[bool] = field(default_factory=list)
    on_step: object = None

    def __post_init__(self) -> None:
        self.machine = _Machine([StageSpec(self.node, "", 0, 30, "recipe", b"")])
        self._i = 0

    @property
    def node_ids(self) -> list[str]:
        return [self.node]

    def usage(self) -> list[tuple[str, int, int]]:
        return []

    async def begin(self, prompt: list[int]) -> None:
        await trio.lowlevel.checkpoint()

    async def next_token(self) -> Sampled:
        await trio.lowlevel.checkpoint()
        s = self.tokens[self._i]
        if callable(self.on_step):
            self.on_step(StepReport(0, self.node, 1, self._i, 10 + self._i, 11 + self._i, b"d", s))
        self._i += 1
        return s

    async def close(self, *, release: bool) -> None:
        self.closed.append(release)

    def abort(self) -> None:
        pass


async def _run(
    primary: ScriptedRun, shadow: ScriptedRun, trusted: frozenset[str]
) -> tuple[list[int], CheckedSession]:
    @asynccontextmanager
    async def no_judge(avoid: frozenset[str]) -> AsyncIterator[object]:
        if avoid is not None:  # always: this swarm has no judge (the yield makes it a generator)
            raise NoRoute("no judge here")
        yield

    verdicts: list[object] = []
    async with AsyncExitStack() as stack:
        checked = CheckedSession(
            primary,  # type: ignore[arg-type]
            shadow,  # type: ignore[arg-type]
            stack=stack,
            open_judge=no_judge,  # type: ignore[arg-type]
            on_verdict=lambda v, d, r: verdicts.append(v),
            trusted=trusted,
            numerics={primary.node: "build-avx2", shadow.node: "build-sse"},  # two check fingerprints
            tolerance=Tolerance(0.5),
            greedy=True,
        )
        await checked.begin([1, 2, 3])
        out = [(await checked.next_token()).token_id for _ in range(5)]
    assert verdicts == []
    return out, checked


def _pair() -> tuple[ScriptedRun, ScriptedRun]:
    head = [sure(11), sure(12)]
    primary = ScriptedRun("p", [*head, Sampled(7, -0.70, NEAR_A, False), sure(20), sure(21)])
    shadow = ScriptedRun("s", [*head, Sampled(9, -0.71, NEAR_B, False), sure(30), sure(31)])
    return primary, shadow


async def test_runs_of_two_recipes_part_at_a_near_tie_and_the_primary_goes_on() -> None:
    primary, shadow = _pair()
    tokens, checked = await _run(primary, shadow, frozenset({"p", "s"}))
    assert tokens == [11, 12, 7, 20, 21]  # the primary's text throughout
    assert checked.stats.parted_at == 2 and checked.stats.divergences == 0
    assert shadow.closed == [True]  # released, not cancelled as a liar's run would be
    assert not checked.comparator.exact


async def test_after_a_tie_a_trusted_run_goes_on_rather_than_one_on_probation() -> None:
    primary, shadow = _pair()
    tokens, checked = await _run(primary, shadow, frozenset({"s"}))  # "p" is on probation
    assert tokens == [11, 12, 9, 30, 31]  # from the tie on, the trusted shadow's text
    assert checked.stats.parted_at == 2
    assert primary.closed == [True]
