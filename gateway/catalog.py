"""The gateway's model catalog: which models the swarm serves, under which ids, and what a request's
``model`` names (a trio shell around the tracker's model list).

State, all bounded: the tracker's last model list (one list, replaced whole), when it was fetched,
and whether the tracker failed a moment ago. A tracker outage keeps the last list: it still names
the models the cached routes serve, and requests do not each wait for a dead tracker (the next
attempt waits :data:`gateway.routes.TRACKER_RETRY_S`). Without any list yet, an outage is
``UpstreamFailed`` (503 with Retry-After).

Names: a model is reachable by its fingerprint, by the configured aliases, and by its name or the
name's stable id (:func:`gateway.protocol.model_id`) where the tracker says the name resolves to it
(tracker/names.py: a registered model, or one served by trusted nodes -- never fresh keys).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import trio

from common.logs import event
from common.tracker_client import TrackerClient, TrackerClientError
from gateway import protocol, tools
from gateway.config import GatewayConfig
from gateway.errors import UpstreamFailed
from gateway.routes import TRACKER_RETRY_S
from gateway.vocab_store import VocabStore

log = logging.getLogger("swarm.gateway")


class ModelCatalog:
    def __init__(self, config: GatewayConfig, tracker: TrackerClient, vocabs: VocabStore) -> None:
        self.config = config
        self.tracker = tracker
        self.vocabs = vocabs
        self.aliases = config.aliases()
        self._models: list[dict[str, Any]] = []
        self._models_at = -1e9
        self._stale = False  # serving the last model list: the tracker did not answer
        self._retry_at = -1e9

    async def tracker_models(self, max_age_s: float = 0.0) -> list[dict[str, Any]]:
        """The tracker's models (cached for ``max_age_s``)."""
        now = trio.current_time()
        if now - self._models_at <= max_age_s and self._models:
            return self._models
        if self._stale and now < self._retry_at:
            return self._models  # the tracker failed a moment ago: do not wait for it again yet
        try:
            with trio.fail_after(self.config.tracker_timeout_s):
                models = await self.tracker.models()
        except (TrackerClientError, httpx.HTTPError, trio.TooSlowError) as err:
            if self._models:
                # A tracker outage: the last list still names the models the cached routes serve.
                self._retry_at = now + TRACKER_RETRY_S
                if not self._stale:
                    self._stale = True
                    event(log, "tracker_unreachable", level=logging.WARNING, error=repr(err))
                return self._models
            raise UpstreamFailed(f"the tracker is unreachable: {err!r}", retry_after_s=5) from err
        if self._stale:
            self._stale = False
            event(log, "tracker_reachable")
        self._models, self._models_at = models, now
        return models

    async def list_models(self) -> dict[str, Any]:
        """Every model the tracker knows: routable ones, and those still being assembled with their
        coverage; under the stable id (see :func:`protocol.model_id`) and every alias."""
        models = await self.tracker_models()
        formats = {fp: tools.tool_format(v.template.source) for fp, v in self.vocabs.loaded().items()}
        if any(not m.get("routable") for m in models):
            models = await self._with_coverage(models)
        return protocol.model_list(models, int(time.time()), self.aliases, formats)

    async def _with_coverage(self, models: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Models still being assembled: the share of their layers some live node serves."""
        try:
            with trio.fail_after(self.config.tracker_timeout_s):
                swarm = await self.tracker.swarm()
        except (TrackerClientError, httpx.HTTPError, trio.TooSlowError):
            return models
        covered: dict[str, set[int]] = {}
        for node in swarm.get("nodes", []):
            shard = node.get("shard") if isinstance(node, dict) else None
            if node.get("state") != "live" or not isinstance(shard, dict):
                continue
            layers = covered.setdefault(str(shard.get("model_fingerprint")), set())
            layers.update(range(int(shard.get("start", 0)), int(shard.get("end", 0))))
        out = []
        for m in models:
            n = int(m.get("n_layers") or 0)
            share = len(covered.get(str(m.get("fingerprint")), ())) / n if n else 0.0
            out.append({**m, "coverage": round(share, 4)})
        return out

    async def resolve(self, model: str) -> str:
        """A model id, alias, name or fingerprint -> what the tracker knows the model by."""
        target = self.aliases.get(model, model)
        try:
            models = await self.tracker_models(max_age_s=10.0)
        except UpstreamFailed:
            return target
        for m in models:
            if target == m.get("fingerprint"):
                return target
        for m in models:
            # A name counts only where the tracker says it resolves to this model (tracker/names.py:
            # registered, or served by trusted nodes); a tracker without the field: every name does.
            if not m.get("name_resolves", True):
                continue
            if target in (m.get("name"), protocol.model_id(str(m.get("name", "")))):
                return str(m.get("fingerprint") or m.get("name"))
        return target
