"""Per-identity quotas: sessions at once, tokens per minute, tokens per request (pure).

One :class:`QuotaBook` per gateway, keyed by :attr:`gateway.api_keys.Principal.id`
(an API key's id, or ``anon:<address>`` for anonymous clients). Every call takes
``now`` (seconds, any monotonic clock): no clock and no event loop here, so the
tests drive it with plain numbers.

* **Sessions**: :meth:`QuotaBook.begin` counts a request from the moment it is
  accepted (queued or running) until :meth:`QuotaBook.end`; at the limit the
  next one is refused (429, ``Retry-After`` 1 s: a session may end any time).
* **Tokens per minute**: a token bucket holding at most ``tokens_per_minute``
  tokens, refilled at ``tokens_per_minute / 60`` per second. A request is
  admitted while the bucket is positive; what it used (prompt + completion
  tokens) is taken out when it ends, so the balance may go negative and the
  next request then waits until it refills above zero (``Retry-After`` = that
  time, rounded up). An identity can overshoot its minute by at most one
  request per allowed session, each bounded by ``max_tokens``.
* **Tokens per request**: :func:`cap_max_tokens` gives the request's
  ``max_tokens`` (the limit when the request names none) or refuses one above
  the limit (400, ``param`` ``max_tokens``).

Bounds: identities with nothing running and a full bucket are forgotten
(:meth:`QuotaBook.prune`, also called by :meth:`begin` every
:data:`PRUNE_EVERY` calls), so the book holds at most the identities active in
the last minute; at most :data:`MAX_IDENTITIES` at once (then the oldest idle
ones go first; if none is idle, new identities are refused as overloaded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.api_keys import Limits

PRUNE_EVERY = 256
MAX_IDENTITIES = 100_000


@dataclass(frozen=True)
class QuotaDecision:
    ok: bool
    limit: str = ""  # which limit refused: "sessions", "tokens_per_minute", "identities"
    message: str = ""
    retry_after_s: int = 0


@dataclass
class _Account:
    limits: Limits
    active: int = 0
    balance: float = 0.0  # tokens in the bucket
    updated_s: float = 0.0


class QuotaBook:
    def __init__(self) -> None:
        self._accounts: dict[str, _Account] = {}
        self._calls = 0

    def __len__(self) -> int:
        return len(self._accounts)

    def _account(self, ident: str, limits: Limits, now: float) -> _Account:
        acc = self._accounts.get(ident)
        if acc is None:
            acc = _Account(limits, balance=float(limits.tokens_per_minute), updated_s=now)
            self._accounts[ident] = acc
        elif acc.limits != limits:  # the key file changed: new limits apply from now on
            acc.limits = limits
            acc.balance = min(acc.balance, float(limits.tokens_per_minute))
        self._refill(acc, now)
        return acc

    @staticmethod
    def _refill(acc: _Account, now: float) -> None:
        tpm = acc.limits.tokens_per_minute
        if tpm:
            acc.balance = min(float(tpm), acc.balance + max(0.0, now - acc.updated_s) * tpm / 60.0)
        acc.updated_s = now

    def begin(self, ident: str, limits: Limits, now: float) -> QuotaDecision:
        """A request of ``ident`` wants to start; on ``ok`` it counts until :meth:`end`."""
        self._calls += 1
        if self._calls % PRUNE_EVERY == 0:
            self.prune(now)
        if ident not in self._accounts and len(self._accounts) >= MAX_IDENTITIES:
            self.prune(now)
            if len(self._accounts) >= MAX_IDENTITIES:
                return QuotaDecision(False, "identities", "too many clients at once", 5)
        acc = self._account(ident, limits, now)
        if limits.max_sessions and acc.active >= limits.max_sessions:
            return QuotaDecision(
                False,
                "sessions",
                f"{acc.active} requests of this client are in flight (its limit is {limits.max_sessions})",
                1,
            )
        tpm = limits.tokens_per_minute
        if tpm and acc.balance <= 0:
            wait = (1.0 - acc.balance) * 60.0 / tpm  # until the bucket holds at least one token
            return QuotaDecision(
                False,
                "tokens_per_minute",
                f"this client used its {tpm} tokens per minute",
                max(1, math.ceil(wait)),
            )
        acc.active += 1
        return QuotaDecision(True)

    def end(self, ident: str, tokens: int, now: float) -> None:
        """A request that :meth:`begin` admitted is over; it used ``tokens`` (prompt + completion)."""
        acc = self._accounts.get(ident)
        if acc is None:
            return
        self._refill(acc, now)
        acc.active = max(0, acc.active - 1)
        if acc.limits.tokens_per_minute:
            acc.balance -= max(0, tokens)

    def balance(self, ident: str, now: float) -> float | None:
        acc = self._accounts.get(ident)
        if acc is None:
            return None
        self._refill(acc, now)
        return acc.balance

    def active(self, ident: str) -> int:
        acc = self._accounts.get(ident)
        return acc.active if acc is not None else 0

    def prune(self, now: float) -> None:
        """Forget identities with nothing in flight whose bucket is full again."""
        for ident in list(self._accounts):
            acc = self._accounts[ident]
            self._refill(acc, now)
            if acc.active == 0 and acc.balance >= acc.limits.tokens_per_minute:
                del self._accounts[ident]


def cap_max_tokens(requested: int | None, limits: Limits, who: str = "This API key") -> int | None:
    """The ``max_tokens`` a request runs with under ``limits``; ValueError (with the message for a
    400) when it asks for more than the limit."""
    cap = limits.max_tokens
    if not cap:
        return requested
    if requested is None:
        return cap
    if requested > cap:
        raise ValueError(
            f"max_tokens is too large: {requested}. {who} may ask for at most {cap} per request."
        )
    return requested
