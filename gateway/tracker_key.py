"""The tracker key a gateway checks route tickets against (gateway/route_tickets.py).

Where it comes from, first match wins (:func:`resolve_tracker_key`, at start):

1. ``tracker_id`` in the config (64 hex: ``swarm-tracker id``, or ``tracker_id``
   of the tracker's ``/healthz``);
2. the key this gateway learned on an earlier first use, kept in
   ``<data_dir>/tracker.id``;
3. with ``trust_tracker_on_first_use``: nothing yet; the first route look-up
   asks the tracker's ``/healthz`` for its ``tracker_id``, keeps it in that file
   (log ``tracker_key_learned``, a warning) and pins it from then on, restarts
   included. Whoever sits between gateway and tracker at that one moment could
   name their own key: the operator chooses this, it is off by default;
4. otherwise the gateway does not start (a configuration error naming the
   setting): a gateway that cannot check tickets cannot tell the tracker's pins
   from an attacker's.

Tracker replicas share one key (docs/operations.md), so one pin covers them all.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import trio

from common import files
from common.config import ConfigError
from common.logs import event
from gateway.config import GatewayConfig
from gateway.errors import UpstreamFailed

log = logging.getLogger("swarm.gateway")

LEARNED_FILE = "tracker.id"


def _is_key(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


class _HasHealthz(Protocol):
    async def healthz(self) -> dict[str, Any]: ...


class TrackerKey:
    """The trusted tracker key, or (with trust on first use) the place to learn it into."""

    def __init__(self, key: str = "", *, learn_into: Path | None = None) -> None:
        if key and not _is_key(key):
            raise ValueError("a tracker key is 64 lowercase hex characters")
        if not key and learn_into is None:
            raise ValueError("no tracker key and no permission to learn one")
        self._key = key
        self._learn_into = learn_into
        self._lock = trio.Lock()

    @property
    def known(self) -> str:
        """The key, or "" before it was learned."""
        return self._key

    async def get(self, tracker: _HasHealthz) -> str:
        """The key; on first use, asked of the tracker (callers bound the wait and map its errors)."""
        if self._key:
            return self._key
        async with self._lock:
            if self._key:
                return self._key
            if self._learn_into is None:  # the constructor refuses this; for the type checker
                raise UpstreamFailed("no tracker key to check route tickets with")
            answer = await tracker.healthz()
            key = answer.get("tracker_id") if isinstance(answer, dict) else None
            if not isinstance(key, str) or not _is_key(key):
                raise UpstreamFailed("the tracker's /healthz names no tracker_id to check tickets with")
            await files.write_atomic(self._learn_into, (key + "\n").encode("ascii"), mode=0o600)
            self._key = key
            event(
                log,
                "tracker_key_learned",
                level=logging.WARNING,
                tracker_id=key,
                kept_in=str(self._learn_into),
                note="trusted on first use; set tracker_id to pin it yourself",
            )
            return key


async def resolve_tracker_key(config: GatewayConfig) -> TrackerKey:
    """:class:`TrackerKey` from the config and the data directory, or :class:`ConfigError`."""
    if config.tracker_id:
        return TrackerKey(config.tracker_id)
    learned = config.resolved_data_dir() / LEARNED_FILE
    if await files.is_file(learned):
        try:
            text = (await files.read_bytes(learned)).decode("ascii").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{learned}: {err}") from err
        if not _is_key(text):
            raise ConfigError(
                f"{learned} holds no tracker key (64 lowercase hex); delete it or set tracker_id"
            )
        return TrackerKey(text)
    if config.trust_tracker_on_first_use:
        return TrackerKey(learn_into=learned)
    raise ConfigError(
        "tracker_id is not set: the gateway checks every route ticket against the tracker's key "
        "(give it: `swarm-tracker id` on the tracker, or tracker_id in its /healthz), or allow "
        "trust_tracker_on_first_use"
    )
