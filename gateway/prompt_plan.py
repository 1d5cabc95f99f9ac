"""The prompt plan (pure): how many tokens a request may generate on a route, the KV it holds,
why a prompt is too long for it, and the sampling settings its Route Sessions carry.

* **Context.** A route serves ``context_limit`` positions per session: the smallest per-session
  KV grant of its stages, and never past the model's trained context (a stage with a KV pool grants
  up to the pool; the trained context is the model's own bound).
* **Budget.** With ``max_tokens``: the prompt plus ``max_tokens`` must fit, else
  :class:`TooLongHere`. Without: the rest of the context (at most ``max_tokens_cap`` where the
  gateway caps it), and at least one token, else :class:`TooLongHere`. The KV a session holds is
  ``prompt + max_new - 1`` positions: the last token sampled is never fed back.
* **Too long.** :class:`TooLongHere` is one route's refusal; the service tries the other routes
  and, when none holds the request, answers :meth:`TooLongHere.refusal` (413
  ``prompt_too_long``) naming the largest context the swarm can serve now.
* **Sampling.** :func:`sampling_settings`: the client's settings, the seed of choice ``index``,
  and at least ``check_top_logprobs`` candidates per token while spot checks are on (every session
  asks for them, checked or not, so a node cannot tell; the client gets the ones it asked for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.errors import ContextLengthExceeded, PromptTooLong
from gateway.protocol import GenerationRequest
from proto import codec
from proto.swarm.v1 import frame_pb2

SEED_MODULUS = 1 << 63


class StageLimits(Protocol):
    """What one stage says bounds a session (``gateway.routes.StageInfo`` has both)."""

    @property
    def max_kv_tokens_per_session(self) -> int: ...

    @property
    def n_ctx_train(self) -> int: ...


def context_limit(stages: Sequence[StageLimits]) -> int:
    """Positions one session may hold on a route of these stages (0: no stage)."""
    kv = min((s.max_kv_tokens_per_session for s in stages), default=0)
    trained = max((s.n_ctx_train for s in stages), default=0)
    return min(kv, trained) if trained else kv


class TooLongHere(ContextLengthExceeded):
    """The prompt (plus max_tokens) passes one route's context ``limit``: the service tries the other
    routes and answers :class:`PromptTooLong` (413) when none holds it. A ContextLengthExceeded, so
    whoever asks whether a prompt fits one route reads it as such."""

    def __init__(self, limit: int, prompt: int, wanted: int, where: str, max_tokens: int | None) -> None:
        super().__init__(
            f"This model's context limit on this route is {limit} tokens, but {wanted} were requested",
            param=where,
        )
        self.limit, self.prompt, self.wanted = limit, prompt, wanted
        self.where, self.max_tokens = where, max_tokens

    def refusal(self, largest: int) -> PromptTooLong:
        where = self.where
        if self.max_tokens is None:
            verb = "have" if where == "messages" else "has"
            text = (
                f"The {where} {verb} {self.prompt} tokens, but the largest context this swarm can serve now "
                f"is {largest} tokens (prompt plus completion). Shorten the {where}."
            )
        else:
            text = (
                f"The request needs {self.wanted} tokens of context ({self.prompt} in the {where} and "
                f"{self.max_tokens} for the completion), but the largest context this swarm can serve now "
                f"is {largest} tokens. Shorten the {where} or lower max_tokens."
            )
        return PromptTooLong(text, max_context_tokens=largest, param=where)


@dataclass(frozen=True)
class Budget:
    max_new: int  # tokens the request may generate
    kv_budget: int  # positions its session holds at most on every stage


def budget(request: GenerationRequest, prompt_tokens: int, limit: int) -> Budget:
    """The request's budget on a route of ``limit`` positions per session; :class:`TooLongHere`
    when it does not fit."""
    where = "messages" if request.kind == "chat" else "prompt"
    if request.max_tokens is not None:
        wanted = prompt_tokens + request.max_tokens
        if wanted > limit:
            raise TooLongHere(limit, prompt_tokens, wanted, where, request.max_tokens)
        max_new = request.max_tokens
    else:
        max_new = limit - prompt_tokens
        if request.max_tokens_cap:
            max_new = min(max_new, request.max_tokens_cap)
        if max_new < 1:
            raise TooLongHere(limit, prompt_tokens, prompt_tokens + 1, where, None)
    return Budget(max_new, prompt_tokens + max_new - 1)


# The request's speculation proposer (GenerationRequest.proposer) as the OPEN carries it.
PROPOSERS = {
    "": frame_pb2.PROPOSER_UNSPECIFIED,
    "ngram": frame_pb2.PROPOSER_NGRAM,
    "draft": frame_pb2.PROPOSER_DRAFT,
}


def sampling_settings(
    request: GenerationRequest,
    *,
    seed: int,
    index: int,
    grammar: str,
    prompt_tokens: int,
    check_top_logprobs: int,
) -> codec.SamplingSettings:
    """What the Route Session of choice ``index`` samples with (``seed``: the request's)."""
    return codec.SamplingSettings(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=(seed + index) % SEED_MODULUS,
        repetition_penalty=request.repetition_penalty,
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        n_top_logprobs=max(request.n_top_logprobs, check_top_logprobs),
        logit_bias=request.logit_bias,
        grammar=grammar,
        completion_start=prompt_tokens,
        choices=request.n if index == 0 else 1,
        proposer=PROPOSERS[request.proposer],
    )
