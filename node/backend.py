"""The engine behind the scheduler: a thin layer over :class:`node.engine.ShardEngine`.

Everything here runs on the scheduler's engine thread (one call at a time).
:class:`EngineBackend` turns the session machine's effects and the
scheduler's slices into engine calls and engine results back into
:class:`~node.session_machine.StepOutcome` pieces. Tests use a fake with the
same methods (see :class:`Backend`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from node.batching import Slice
from node.sampling import SamplingParams
from proto.codec import Sampled


@dataclass(frozen=True)
class SliceResult:
    kv_len: int
    hidden: npt.NDArray[np.float32] | None = None
    sampled: Sampled | None = None
    error_status: str | None = None
    error_message: str = ""
    window: tuple[Sampled, ...] = ()  # a window job (StepJob.drafts): the draws after this slice's rows


class Backend(Protocol):
    n_batch: int

    def open(
        self,
        session_id: str,
        budget: int,
        sampling: SamplingParams,
        source: str = "",
        positions: int = 0,
        move: bool = False,
    ) -> None: ...
    def truncate(self, session_id: str, position: int) -> None: ...
    def free(self, session_id: str) -> None: ...
    def run(self, slices: list[Slice]) -> list[SliceResult]: ...
    def kv_len(self, session_id: str) -> int: ...
    def has_session(self, session_id: str) -> bool: ...


class EngineBackend:
    """:class:`Backend` over a real :class:`~node.engine.ShardEngine`."""

    def __init__(self, engine: object) -> None:
        from node.engine import ShardEngine

        assert isinstance(engine, ShardEngine)
        self.engine = engine
        self.n_batch = engine.n_batch

    def open(
        self,
        session_id: str,
        budget: int,
        sampling: SamplingParams,
        source: str = "",
        positions: int = 0,
        move: bool = False,
    ) -> None:
        self.engine.open_session(
            session_id, sampling=sampling, kv_budget=budget, source=source, positions=positions, move=move
        )

    def truncate(self, session_id: str, position: int) -> None:
        self.engine.truncate(session_id, position)

    def free(self, session_id: str) -> None:
        if self.engine.has_session(session_id):
            self.engine.release(session_id)

    def kv_len(self, session_id: str) -> int:
        return self.engine.kv_len(session_id)

    def has_session(self, session_id: str) -> bool:
        return self.engine.has_session(session_id)

    def run(self, slices: list[Slice]) -> list[SliceResult]:
        from node.engine import Work

        works = []
        for s in slices:
            job = s.pending.job
            a, b = s.offset, s.offset + s.count
            works.append(
                Work(
                    session_id=job.session_id,
                    start_pos=job.start + a,
                    tokens=None if job.tokens is None else job.tokens[a:b],
                    hidden=None if job.hidden is None else job.hidden[a:b],
                    sample=job.sample and s.last and not job.drafts,
                    history=job.history,
                    window_from=job.start if job.drafts else None,
                )
            )
        results = self.engine.step(works)
        out = []
        for r in results:
            if r.error is not None:
                out.append(SliceResult(r.kv_len, error_status=r.error.status, error_message=str(r.error)))
                continue
            sampled = None
            if r.sampled is not None:
                first, *others = [self._out(t) for t in (r.sampled, *r.choices)]
                sampled = Sampled(
                    first.token_id, first.logprob, first.top_logprobs, first.end_of_generation, tuple(others)
                )
            window = tuple(self._out(t) for t in r.window)
            out.append(SliceResult(r.kv_len, hidden=r.hidden, sampled=sampled, window=window))
        return out

    def _out(self, t: Sampled) -> Sampled:
        return dataclasses.replace(t, end_of_generation=self.engine.is_eog(t.token_id))


def now_s() -> float:
    return time.perf_counter()
