"""Span recovery: the policy a Route Session uses to replace one failed stage mid-generation.

When a stage fails, :class:`gateway.session_machine.RouteMachine` asks a
:data:`ReplacementFinder` (``gateway.span_finder``: a tracker look-up) for a
live node serving **exactly the same layers**, re-opens the surviving stages
with the next route epoch (they keep their KV up to the last position every
stage applied), opens the replacement empty and has its inputs replayed: the
token ids for the first stage, else the outputs the stage before it kept
(REPLAY; docs/protocol.md). Healthy stages never re-prefill.

Why same-span only: a replacement with other boundaries would change the
neighbours' inputs or outputs too. When the finder has no same-span node to
offer (none live, or none answering), it raises :class:`NoSameSpan`, naming
why; the service then falls back to re-running the request on a fresh route
with the whole token history as prefill (``gateway.serving``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.session_machine import RecoveryReport

__all__ = [
    "NoSameSpan",
    "RecoveryPolicy",
    "RecoveryReport",
    "Replacement",
    "ReplacementFinder",
]

DEFAULT_MAX_RECOVERIES = 3  # stage replacements per session


class NoSameSpan(Exception):
    """Raised by a finder: live nodes cover the layers, but none with exactly the failed stage's span."""


@dataclass(frozen=True)
class Replacement:
    """A live node for the failed span, and a tracker ticket that names it for those layers."""

    hop: object  # gateway.routes.Hop (kept untyped here: routes.py imports trio)
    info: object  # gateway.routes.StageInfo
    ticket: bytes


# (start, end, excluded node ids) -> Replacement; raises NoSameSpan when it has none to offer.
ReplacementFinder = Callable[[int, int, frozenset[str]], Awaitable[Replacement]]


@dataclass
class RecoveryPolicy:
    find: ReplacementFinder
    max_recoveries: int = DEFAULT_MAX_RECOVERIES
    on_report: Callable[[RecoveryReport], None] = lambda report: None
