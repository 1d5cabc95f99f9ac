"""Test-only fault injection: make a node lie, to test that the swarm catches liars.

A node lies only when it is started with ``SWARM_TEST_NODE_FAILPOINTS`` *and*
``SWARM_TEST_ONLY_FAILPOINTS=I_ACCEPT_A_LYING_NODE`` in its environment; a
start with the first and not the second is refused with an error (so a stray
variable never turns a volunteer's node into a liar). The specification is a
comma-separated list:

``swap_sampler``
    the last stage replaces every sampled token by another one (its logprob
    kept), like a node whose sampler was swapped;
``perturb_hidden``
    a stage before the last changes one value of its output by one ulp (the
    smallest lie there is);
``no_model``
    the node computes nothing: zeros instead of hidden states, tokens drawn
    from a seeded generator instead of sampled;
``fake_speed``
    the node announces a decode time of 0.01 ms per token (routing must not
    believe it);
``honest_steps=N``
    the lies above start after the node's first N steps (a liar that answers
    the tracker's join challenge honestly and lies to clients afterwards).
``preempt_every=N`` (with ``preempt_times=K``, default 1)
    the last stage answers STATUS_PREEMPTED instead of every N-th token it
    samples, K times in all, as a node whose KV pool ran out does for its
    youngest session (the gateway must release the session everywhere and
    resume it by re-prefill). Not a lie: it tests the gateway's resume on real
    nodes before (or besides) the pool's own preemption.

The hooks run on the node's trio thread on every step outcome
(:func:`corrupt`), before the session machine sees it; nothing else of the
node changes.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from common.config import ConfigError
from node.session_machine import StepOutcome
from proto.codec import Sampled

ENV = "SWARM_TEST_NODE_FAILPOINTS"
CONSENT_ENV = "SWARM_TEST_ONLY_FAILPOINTS"
CONSENT = "I_ACCEPT_A_LYING_NODE"
KINDS = frozenset({"swap_sampler", "perturb_hidden", "no_model", "fake_speed"})


class FailpointError(ConfigError):
    """Failpoints asked for outside a test (or an unknown one)."""


@dataclass(frozen=True)
class Failpoints:
    kinds: frozenset[str] = frozenset()
    n_vocab: int = 1
    honest_steps: int = 0
    preempt_every: int = 0
    preempt_times: int = 1

    @property
    def active(self) -> bool:
        return bool(self.kinds) or self.preempt_every > 0

    def announced_decode_ms(self, measured_ms: float) -> float:
        return 0.01 if "fake_speed" in self.kinds else measured_ms

    def corrupt(self, outcome: StepOutcome, rng: random.Random) -> StepOutcome:
        """The lie this node tells about one step's outcome (unchanged without failpoints)."""
        if not self.kinds or outcome.error_status is not None:
            return outcome
        hidden, sampled = outcome.hidden, outcome.sampled
        if hidden is not None and ("perturb_hidden" in self.kinds or "no_model" in self.kinds):
            hidden = np.array(hidden, dtype=np.float32, copy=True)
            if "no_model" in self.kinds:
                hidden[:] = 0.0
            else:
                hidden.reshape(-1)[0] = np.nextafter(hidden.reshape(-1)[0], np.float32(np.inf))
        if sampled is not None and ("swap_sampler" in self.kinds or "no_model" in self.kinds):
            if "no_model" in self.kinds:
                token = rng.randrange(self.n_vocab)
            else:
                token = (sampled.token_id + 1) % max(2, self.n_vocab)
            sampled = Sampled(token, sampled.logprob, sampled.top_logprobs, False)
        return replace(outcome, hidden=hidden, sampled=sampled)


class Liar:
    """Applies :meth:`Failpoints.corrupt` to a node's step outcomes, after its honest steps."""

    def __init__(self, failpoints: Failpoints, rng: random.Random) -> None:
        self.failpoints = failpoints
        self.rng = rng
        self.steps = 0
        self.sampled = 0
        self.preempted = 0

    def __call__(self, outcome: StepOutcome) -> StepOutcome:
        self.steps += 1
        fp = self.failpoints
        if fp.preempt_every and outcome.sampled is not None and outcome.error_status is None:
            self.sampled += 1
            if self.sampled % fp.preempt_every == 0 and self.preempted < fp.preempt_times:
                self.preempted += 1
                return replace(
                    outcome,
                    hidden=None,
                    sampled=None,
                    error_status="PREEMPTED",
                    error_message="failpoint: KV freed for an older session",
                )
        if self.steps <= self.failpoints.honest_steps:
            return outcome
        return self.failpoints.corrupt(outcome, self.rng)


def from_environment(env: Mapping[str, str] | None = None, *, n_vocab: int = 1) -> Failpoints:
    """The failpoints the environment asks for; raises :class:`FailpointError` outside a test."""
    env = os.environ if env is None else env
    spec = env.get(ENV, "").strip()
    if not spec:
        return Failpoints()
    if env.get(CONSENT_ENV) != CONSENT:
        raise FailpointError(
            f"{ENV} is set: failpoints make this node lie and exist for tests only; refusing to start "
            f"(unset {ENV})"
        )
    kinds: set[str] = set()
    counts = {"honest_steps": 0, "preempt_every": 0, "preempt_times": 1}
    for item in (k.strip() for k in spec.split(",")):
        name = item.split("=", 1)[0]
        if "=" in item and name in counts:
            try:
                counts[name] = int(item.split("=", 1)[1])
            except ValueError:
                raise FailpointError(f"{ENV}: {name} must be an integer, got {item!r}") from None
        elif item:
            kinds.add(item)
    unknown = kinds - KINDS
    if unknown or min(counts.values()) < 0:
        raise FailpointError(
            f"unknown failpoints {sorted(unknown)}; known: {sorted(KINDS)}, honest_steps=N, preempt_every=N,"
            " preempt_times=K"
        )
    return Failpoints(
        frozenset(kinds), n_vocab, counts["honest_steps"], counts["preempt_every"], counts["preempt_times"]
    )
