"""A client request and the Route Session that serves it.

Phases (``Session.phase``)::

    queued --admit--> prefill --last chunk back--> decode --last token--> done
       |                 |  \\                        |
       |                 |   +--stage lost--> recovering --replacement, replay--> (prefill | decode)
       +--timeout/full--> failed <--no replacement in time--+

A request ends exactly once, as ``done`` or ``failed`` (with a reason);
whatever has not ended when the simulation stops is counted as in flight.
``epoch`` grows whenever in-flight work must be abandoned (a stage was lost),
so frames of the old epoch are ignored wherever they land.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.des.node import SimNode

QUEUED, PREFILL, DECODE, RECOVERING, REPLAY, DONE, FAILED = (
    "queued",
    "prefill",
    "decode",
    "recovering",
    "replay",
    "done",
    "failed",
)


class Session:
    __slots__ = (
        "id",
        "model_index",
        "gateway",
        "arrival_s",
        "prompt_tokens",
        "output_tokens",
        "phase",
        "epoch",
        "route",
        "hop_s",
        "prefill_tokens_done",
        "tokens_out",
        "last_token_s",
        "end_s",
        "failure_s",
        "resume_phase",
        "recoveries",
        "recovery_lost_s",
        "replay_chunks_left",
        "recovery_attempts",
        "ring_prefill",
        "ring_tokens",
    )

    def __init__(
        self,
        sid: int,
        model_index: int,
        gateway: int,
        arrival_s: float,
        prompt_tokens: int,
        output_tokens: int,
    ) -> None:
        self.id = sid
        self.model_index = model_index
        self.gateway = gateway
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.phase = QUEUED
        self.epoch = 0
        self.route: list[SimNode] = []
        # With direct push: one-way latency (s) from stage i to stage i + 1, the last entry the
        # ring's (last -> first); set with the route (the gateway's _set_route).
        self.hop_s: list[float] = []
        self.prefill_tokens_done = 0  # prompt tokens that went through every stage
        self.tokens_out = 0
        self.last_token_s = 0.0
        self.end_s: float | None = None
        self.failure_s: float | None = None  # when the current outage began
        self.resume_phase = ""
        self.recoveries = 0
        self.recovery_lost_s = 0.0
        self.replay_chunks_left = 0
        self.recovery_attempts = 0
        # Direct push: what has left the last stage (it pushes the next decode step to the first
        # stage itself, before the gateway counted the token).
        self.ring_prefill = 0
        self.ring_tokens = 0

    @property
    def finished(self) -> bool:
        return self.phase == DONE or self.phase == FAILED

    @property
    def committed_context(self) -> int:
        """Positions every stage has processed end to end (what a new stage must replay)."""
        if self.tokens_out == 0:
            return self.prefill_tokens_done
        # The newest sampled token is the input of the step in progress, not yet in any KV.
        return self.prompt_tokens + self.tokens_out - 1
