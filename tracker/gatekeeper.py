"""The tracker's gate: what every signed message and every database call passes through.

One :class:`Gatekeeper` per registry, handed to each room that verifies messages or calls the
store (the registry itself, the trust room ``tracker/trust.py``, the challenger, the rebalancing
advice):

* :meth:`Gatekeeper.open_envelope` verifies a signed envelope (signature, timestamp within
  ``signature_skew_s``, size) and its nonce: the signing key is charged (``key_messages_per_s``;
  registered gateways exempt) and may hold at most ``nonces_per_key_max`` nonces in memory; a
  nonce this replica already saw is refused (memory, bounded by ``nonce_cache_max_entries``). The
  answer carries the nonce as a :class:`tracker.database.NonceRecord` for the write.
* :meth:`Gatekeeper.signed_write` runs the store write the message authorises; the store records
  the nonce in the same transaction, so a replay another replica saw is refused there, counted
  and logged like any refusal, and nothing is written.
* :meth:`Gatekeeper.run_db` runs a blocking store call in a worker thread behind one
  :class:`trio.CapacityLimiter` (``db_threads``), waiting at most ``db_timeout_s``; a database
  that is away or slow becomes :class:`tracker.errors.StorageUnavailable`.

Every refusal is counted (``swarm_tracker_refusals_total``) and logged
(``signed_message_refused``) here, whichever room refused.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import trio
from sqlalchemy.exc import InterfaceError, OperationalError

from common.logs import event
from proto.signing import NonceCache, SignatureError, open_envelope
from tracker.config import TrackerConfig
from tracker.database import NonceRecord
from tracker.errors import RateLimited, StorageUnavailable
from tracker.json_input import check_json
from tracker.metrics import Metrics
from tracker.ratelimit import NonceShare, TokenBuckets

log = logging.getLogger("swarm.tracker")
T = TypeVar("T")


class Gatekeeper:
    def __init__(self, config: TrackerConfig, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.nonces = NonceCache(config.nonce_cache_max_entries)
        # Quotas per signing key (tracker/ratelimit.py); the operator's registered gateways are exempt
        # from the rate (their usage reports follow client traffic), not from the nonce share.
        self.nonce_share = NonceShare(config.nonces_per_key_max)
        self.key_limits = TokenBuckets(
            config.key_messages_per_s, config.key_messages_burst, config.rate_limit_max_identities
        )
        self.exempt_keys = config.gateway_keys()
        self.limiter = trio.CapacityLimiter(config.resolved_db_threads())

    # --- signed messages --------------------------------------------------------------------------

    def open_envelope(
        self, envelope: Any, kind: str, signer_field: str = "node_id", *, max_payload_bytes: int = 0
    ) -> tuple[dict[str, Any], NonceRecord | None]:
        """The verified payload of a signed ``kind`` message and its nonce (for :meth:`signed_write`).
        Raises :class:`SignatureError` (401; counted and logged) or :class:`RateLimited` (429)."""
        grab = _NonceGrab(self)
        try:
            payload = open_envelope(
                envelope,
                kind=kind,
                now_s=self.clock(),
                skew_s=self.config.signature_skew_s,
                nonces=grab,
                signer_field=signer_field,
                max_payload_bytes=max_payload_bytes or self.config.max_body_bytes,
            )
        except SignatureError as err:
            self.refused(kind, err)
            raise
        check_json(payload, what=f"the signed {kind} payload")  # a lone surrogate would fail in storage
        return payload, grab.record

    def refused(self, kind: str, err: SignatureError) -> None:
        """Count and log a refused ``kind`` message (the caller raises ``err``)."""
        self.metrics.inc("swarm_tracker_refusals_total", reason=err.reason)
        event(
            log,
            "signed_message_refused",
            level=logging.WARNING,
            kind=kind,
            reason=err.reason,
            detail=err.message,
        )

    async def signed_write(self, kind: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` through :meth:`run_db`: a store write that also records the message's nonce;
        a replay another replica saw is refused here (SignatureError from the store), counted and
        logged like any refusal."""
        try:
            return await self.run_db(fn, *args)
        except SignatureError as err:
            self.refused(kind, err)
            raise

    # --- the database ------------------------------------------------------------------------------

    async def run_db(self, fn: Callable[..., T], *args: Any, bounded: bool = True) -> T:
        """``fn(*args)`` in a database thread. ``bounded``: the caller waits at most ``db_timeout_s``
        (queue included), then gets :class:`StorageUnavailable`; the abandoned call still holds its
        thread until it returns, so the limiter keeps the number of threads bounded. A write abandoned
        this way may still commit: its signed message cannot be replayed (the nonce), a node re-signs."""
        call = functools.partial(fn, *args)
        try:
            if not bounded:
                return await trio.to_thread.run_sync(call, limiter=self.limiter)
            with trio.fail_after(self.config.db_timeout_s):
                return await trio.to_thread.run_sync(call, limiter=self.limiter, abandon_on_cancel=True)
        except (OperationalError, InterfaceError) as err:  # connection-level: the database is away
            event(log, "storage_unavailable", level=logging.ERROR, error=str(err).splitlines()[0][:300])
            raise StorageUnavailable("the tracker's database is unavailable; retry later") from err
        except trio.TooSlowError as err:
            event(log, "storage_slow", level=logging.WARNING, call=getattr(fn, "__name__", "?"))
            raise StorageUnavailable("the tracker's database did not answer in time; retry later") from err


class _NonceGrab:
    """The nonce sink handed to ``open_envelope`` (called once the signature checked out): charges
    the signing key's quota, refuses what this replica already saw (memory, bounded in all and per
    key) and keeps the nonce so the write records it in the shared table."""

    def __init__(self, gate: Gatekeeper) -> None:
        self.gate = gate
        self.record: NonceRecord | None = None

    def check_and_add(self, public_key: str, nonce: str, expires_at_s: float, now_s: float) -> None:
        gate = self.gate
        config = gate.config
        if public_key not in gate.exempt_keys:
            decision = gate.key_limits.take(public_key, now_s)
            if not decision.allowed:
                gate.metrics.inc("swarm_tracker_rate_limited_total", scope="key")
                raise RateLimited(
                    f"more than {config.key_messages_per_s:g} signed messages per second from this key; "
                    "slow down",
                    decision.retry_after_s,
                )
        if gate.nonce_share.full(public_key, now_s):
            gate.metrics.inc("swarm_tracker_rate_limited_total", scope="key_nonces")
            raise RateLimited(
                f"this key has {config.nonces_per_key_max} signed messages in the replay window; retry later",
                max(1.0, expires_at_s - now_s),
            )
        gate.nonces.check_and_add(public_key, nonce, expires_at_s, now_s)
        gate.nonce_share.add(public_key, expires_at_s)
        self.record = NonceRecord(public_key, nonce, expires_at_s, config.nonces_per_key_max)


__all__ = ["Gatekeeper"]
