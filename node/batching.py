"""Which pieces of which sessions' work go into the next engine batch (pure).

The scheduler keeps every accepted job (one per session at most) in arrival
order. Each engine call takes one batch of at most ``max_tokens`` positions:

1. every decode step first (one position each, oldest first): interactive
   sessions never wait behind a long prompt;
2. then prefill jobs in arrival order, each contributing at most
   ``prefill_chunk`` positions per batch, so a 4000-token prompt advances in
   bounded slices while decode steps of other sessions ride along.

A job is finished when all its positions have been through the engine; its
slices always start where the previous one ended (the engine checks it
against the session's KV length anyway).

Isolated jobs (a session opened with ``OpenSession.isolated``: the runs of a
spot check) never share a batch. Some llama.cpp CPU kernels (flash
attention's tiled path, quantized matrix products) pick their algorithm by
the number of rows in a ubatch, so a row's low-order bits can depend on what
else was batched with it; two honest nodes must compute a checked step alike.
So an isolated job's batch holds that job alone, cut into slices of
``ISOLATED_SLICE_TOKENS`` positions counted from the step's own start: the
cut depends only on the step as the gateway sent it, never on this node's
``max_tokens`` / ``prefill_chunk`` (node-local settings). The node's batch
size is at least ``ISOLATED_SLICE_TOKENS`` (node config), so the engine runs
each slice as one ``llama_decode`` of one ubatch. When isolated and shared
work both wait, batches alternate (``after_isolated``): neither starves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from node.session_machine import StepJob
from proto.codec import ISOLATED_SLICE_TOKENS, Sampled


@dataclass(eq=False)  # identity: jobs hold numpy arrays
class PendingJob:
    job: StepJob
    done: int = 0  # positions already through the engine
    hidden_parts: list[npt.NDArray[np.float32]] = field(default_factory=list)
    window_parts: list[Sampled] = field(default_factory=list)  # a window job's draws, slice by slice
    compute_s: float = 0.0
    dropped: bool = False
    submitted_s: float = 0.0  # the scheduler's clock when the job was queued
    queue_s: float | None = None  # queued until its first batch started (set by the scheduler)

    @property
    def remaining(self) -> int:
        return self.job.n_tokens - self.done


@dataclass(frozen=True)
class Slice:
    """``count`` positions of a pending job, starting ``offset`` positions into it."""

    pending: PendingJob
    offset: int
    count: int

    @property
    def last(self) -> bool:
        return self.offset + self.count == self.pending.job.n_tokens


def plan_batch(
    pending: Sequence[PendingJob], max_tokens: int, prefill_chunk: int, *, after_isolated: bool = False
) -> list[Slice]:
    """The slices of the next batch (see the module docstring); empty when nothing is pending.

    ``after_isolated``: the previous batch was an isolated one, so shared work goes first if any waits.
    """
    if max_tokens < 1 or prefill_chunk < 1:
        raise ValueError("max_tokens and prefill_chunk must be >= 1")
    room = max_tokens
    out: list[Slice] = []
    live = [p for p in pending if not p.dropped and p.remaining > 0]
    isolated = [p for p in live if p.job.isolated]
    live = [p for p in live if not p.job.isolated]
    if isolated and not (after_isolated and live):
        p = isolated[0]
        return [Slice(p, p.done, min(p.remaining, ISOLATED_SLICE_TOKENS))]
    for p in live:
        if room == 0:
            return out
        if p.job.is_decode:
            take = min(p.remaining, room)
            out.append(Slice(p, p.done, take))
            room -= take
    for p in live:
        if room == 0:
            break
        if not p.job.is_decode:
            take = min(p.remaining, prefill_chunk, room)
            out.append(Slice(p, p.done, take))
            room -= take
    return out
