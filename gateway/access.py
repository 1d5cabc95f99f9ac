"""Client access: the key file, authentication and per-identity quotas (the trio shell).

:class:`Access` holds the :class:`gateway.api_keys.KeyTable` read from the key
file and re-reads it when the file changes (checked at most every
:data:`RELOAD_CHECK_S`, so ``swarm-gateway keys revoke`` takes effect on a
running gateway within seconds); a file that stops parsing keeps the keys in
force and logs ``api_keys_invalid``. The quota logic itself is
:mod:`gateway.quota` (pure). Outcomes are counted without key material:
``swarm_gateway_auth_total{outcome}`` (``key``, ``anonymous``,
``invalid_key``, ``missing_key``) and
``swarm_gateway_quota_rejections_total{limit}``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import trio

from common import files
from common.keyfile import KeyFileError
from common.logs import event
from gateway.api_keys import AuthPolicy, KeyTable, Limits, Principal, parse_key_file
from gateway.errors import AuthenticationFailed, InvalidRequest, Overloaded, RateLimited
from gateway.metrics import Metrics
from gateway.quota import QuotaBook, cap_max_tokens

log = logging.getLogger("swarm.gateway")
RELOAD_CHECK_S = 2.0


def read_key_table(path: Path) -> tuple[KeyTable, float]:
    """The keys in ``path`` and its mtime (an empty table and -1 when the file does not exist)."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return KeyTable(), -1.0
    return KeyTable(parse_key_file(path.read_text(encoding="utf-8"))), stat.st_mtime


class Access:
    def __init__(
        self,
        path: Path,
        policy: AuthPolicy,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.path = path
        self.policy = policy
        self.metrics = metrics
        self.quotas = QuotaBook()
        self._clock = clock
        self._table, self._mtime = read_key_table(path)  # a broken file at start-up is a config error
        self._checked_at = -1e18

    @property
    def keys(self) -> int:
        return len(self._table)

    async def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked_at < RELOAD_CHECK_S:
            return
        self._checked_at = now

        def mtime() -> float:
            try:
                return os.stat(self.path).st_mtime
            except FileNotFoundError:
                return -1.0

        current = await files.run_sync(mtime)
        if current == self._mtime:
            return
        try:
            self._table, self._mtime = await files.run_sync(read_key_table, self.path)
        except (KeyFileError, OSError, UnicodeDecodeError) as err:
            self._mtime = current  # do not re-read the same broken file every time
            event(log, "api_keys_invalid", level=logging.ERROR, path=str(self.path), error=str(err))
            return
        event(log, "api_keys_loaded", path=str(self.path), keys=len(self._table))

    async def principal(self, authorization: str, address: str) -> Principal:
        """Who sends a request with this ``Authorization`` header; 401 when it may not."""
        await self._maybe_reload()
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer":
            bearer = token.strip() or None  # "Bearer" alone (an empty key): no key
        else:
            bearer = authorization.strip() or None  # not a bearer token: never a valid key
        try:
            who = self._table.authenticate(bearer, address, self.policy)
        except AuthenticationFailed as err:
            self.metrics.inc("swarm_gateway_auth_total", outcome=err.code or "invalid_key")
            raise
        self.metrics.inc("swarm_gateway_auth_total", outcome="anonymous" if who.anonymous else "key")
        return who

    def cap(self, who: Principal, max_tokens: int | None) -> int | None:
        """The request's ``max_tokens`` under its principal's cap (400 above it)."""
        try:
            return cap_max_tokens(
                max_tokens, who.limits, "An anonymous request" if who.anonymous else "This API key"
            )
        except ValueError as err:
            self.metrics.inc("swarm_gateway_quota_rejections_total", limit="max_tokens")
            raise InvalidRequest(str(err), param="max_tokens", code="invalid_value") from err

    def begin(self, who: Principal) -> None:
        decision = self.quotas.begin(who.id, who.limits, self._clock())
        if decision.ok:
            return
        self.metrics.inc("swarm_gateway_quota_rejections_total", limit=decision.limit)
        if decision.limit == "identities":
            raise Overloaded(f"The gateway is at capacity: {decision.message}.", retry_after_s=5)
        raise RateLimited(
            f"Rate limit reached: {decision.message}. Retry after {decision.retry_after_s} s.",
            retry_after_s=decision.retry_after_s,
        )

    def end(self, who: Principal, tokens: int) -> None:
        self.quotas.end(who.id, tokens, self._clock())


def anonymous_limits(max_tokens: int, tokens_per_minute: int) -> Limits:
    return Limits(0, tokens_per_minute, max_tokens)
