"""A fake engine backend for session-machine, scheduler and gRPC tests that need no llama.cpp."""

from __future__ import annotations

import numpy as np

from node.backend import SliceResult
from node.batching import Slice
from node.sampling import SamplingParams
from proto.codec import Sampled

N_EMBD = 8
MODEL_FP = "a" * 64
RECIPE_FP = "b" * 64


class FakeBackend:
    """Hidden out = hidden in (or token id, first stage) + position; KV tracked per session."""

    def __init__(self, *, is_first: bool = True, is_last: bool = False, max_sessions: int = 4) -> None:
        self.is_first = is_first
        self.is_last = is_last
        self.n_batch = 64
        self.max_sessions = max_sessions
        self.kv: dict[str, int] = {}
        self.batches: list[list[tuple[str, int, int]]] = []
        self.fail_next: str | None = None
        self.fail_at_offset: tuple[str, int] | None = None  # fail this session's slice at this offset
        self.log: list[tuple[str, str]] = []

    def open(
        self,
        session_id: str,
        budget: int,
        sampling: SamplingParams,
        source: str = "",
        positions: int = 0,
        move: bool = False,
    ) -> None:
        if session_id in self.kv:
            raise RuntimeError(f"{session_id} already open")
        if source and self.kv.get(source, -1) < positions:
            raise RuntimeError(f"{source} holds fewer than {positions} positions")
        if len(self.kv) >= self.max_sessions and not (source and move):
            raise RuntimeError("no slot")
        if source and move:
            del self.kv[source]
        self.kv[session_id] = positions if source else 0
        self.log.append(("open", session_id) if not source else ("open", session_id, source, positions, move))

    def truncate(self, session_id: str, position: int) -> None:
        if session_id not in self.kv:
            raise KeyError(session_id)
        self.kv[session_id] = position
        self.log.append(("truncate", session_id))

    def free(self, session_id: str) -> None:
        self.kv.pop(session_id, None)
        self.log.append(("free", session_id))

    def kv_len(self, session_id: str) -> int:
        return self.kv[session_id]

    def has_session(self, session_id: str) -> bool:
        return session_id in self.kv

    def run(self, slices: list[Slice]) -> list[SliceResult]:
        self.batches.append([(s.pending.job.session_id, s.offset, s.count) for s in slices])
        out = []
        for s in slices:
            job = s.pending.job
            sid = job.session_id
            if sid not in self.kv:
                out.append(SliceResult(0, error_status="UNKNOWN_SESSION", error_message="gone"))
                continue
            start = job.start + s.offset
            if self.kv[sid] != start:
                out.append(SliceResult(self.kv[sid], error_status="POSITION_MISMATCH", error_message="pos"))
                continue
            if self.fail_next == sid or self.fail_at_offset == (sid, s.offset):
                self.fail_next = None
                out.append(SliceResult(self.kv[sid], error_status="INTERNAL", error_message="boom"))
                continue
            self.kv[sid] += s.count
            pos = np.arange(start, start + s.count, dtype=np.float32)[:, None]
            if job.tokens is not None:
                base = np.repeat(
                    job.tokens[s.offset : s.offset + s.count, None].astype(np.float32), N_EMBD, 1
                )
            else:
                assert job.hidden is not None
                base = job.hidden[s.offset : s.offset + s.count]
            hidden = (base + pos).astype(np.float32)
            sampled = None
            if self.is_last and job.sample and s.last:
                sampled = Sampled(token_id=int(hidden[-1, 0]) % 100, logprob=-0.5)
            out.append(SliceResult(self.kv[sid], hidden=None if self.is_last else hidden, sampled=sampled))
        return out
