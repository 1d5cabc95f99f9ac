"""Routes from the tracker, cached per model, and what each node of a route told us (Info).

:class:`RouteCache` asks the tracker for ``routes_k`` data-parallel routes of a
model and keeps them for ``route_ttl_s`` (or until their tickets come within
:data:`TICKET_MARGIN_S` of expiry, or a session on them failed); one look-up
per model at a time, concurrent requests wait for it. :meth:`RouteCache.acquire`
hands out the route that is cheapest at its stages' load now, the policy the
simulator's gateway follows (docs/simulation.md): the tracker's expected time per
token re-priced (``common.route_cost.repriced_ms``: batch growth, the wait for a
slot as a stage fills, the uplink's queue) with each stage's load taken as the
sessions the tracker reported there when it answered plus the sessions this
gateway runs there now (counted per node, so a refresh that pairs the same nodes
differently keeps the count; a session of this gateway the report already held is
counted twice, erring towards spreading). So a near, idle route takes sessions
until its load costs more than the distance to the next, and not past it. Where
the tracker sent no load figures (an older tracker), the route whose nodes carry
the fewest of this gateway's sessions (``gateway.admission.least_loaded``).

Tracker outages. Routes carry tracker-signed tickets with an expiry (the
tracker's ``route_ticket_ttl_s``, 300 s by default). When a look-up fails
because the tracker is unreachable, times out or answers 5xx/429, the cache
serves the routes it holds whose tickets stay valid for at least
:data:`STALE_MARGIN_S` more (metric outcome ``stale``, log
``routes_served_stale`` once per outage), and does not call the tracker again
for :data:`TRACKER_RETRY_S` (requests do not each wait for a dead tracker).
Routes whose node failed are marked stale rather than dropped, so they remain
such a fallback (the failed node itself is excluded by the caller). The first
successful look-up after the outage replaces them (``routes_refreshed``).
Several tracker URLs (``tracker_url`` with commas) are tried in turn by
``common.tracker_client.TrackerClient`` before a look-up counts as failed.

:class:`NodeInfoCache` keeps each node's ``Info`` (recipe fingerprint, width,
limits) for ``node_info_ttl_s``; a route's stages must agree on the recipe.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from common.logs import event
from common.prefix_chain import is_head
from common.route_cost import DEFAULT_LOAD_COSTS, LoadCosts, StageLoad, repriced_ms
from common.tls import is_fingerprint
from common.tls_http import pin_refusal
from common.tracker_client import TrackerClient, TrackerClientError
from gateway.admission import cheapest_now
from gateway.errors import ModelNotFound, NoRoute, StageFailed, UpstreamFailed
from gateway.grpc_bridge import CertificateRefused, NodeChannels, StreamError
from gateway.metrics import Metrics
from gateway.route_tickets import TicketRefused, verify_route
from gateway.tracker_key import TrackerKey
from proto.announce import MAX_PREFIX_HEADS
from proto.recipe import Recipe
from proto.signing import canonical_json

log = logging.getLogger("swarm.gateway")


TICKET_MARGIN_S = 30.0
STALE_MARGIN_S = 5.0  # a ticket served from the cache during an outage stays valid at least this long
TRACKER_RETRY_S = 5.0  # after a failed look-up, the cache answers alone for this long
MAX_ROUTE_PREFIX_HEADS = 256  # = tracker.routing.MAX_ROUTE_PREFIX_HEADS: heads one look-up names
PREFIX_KEY_BLOCKS = 16  # a prompt's prefix look-up is remembered by its first 256 positions
MAX_PREFIX_LOOKUPS = 1024  # prefix look-ups remembered


@dataclass(frozen=True)
class Hop:
    node_id: str
    start: int
    end: int
    address: str
    relay: bool = False
    # The tracker's estimates for the link that carries this stage's input (from the previous
    # stage; for the first stage, from this gateway), None where nothing was measured: the round
    # trip (network coordinates) and the sender's uplink (for the first stage always None).
    rtt_ms: float | None = None
    bandwidth_mbit_s: float | None = None
    probation: bool = False  # the tracker has not seen this node pass enough spot checks yet
    # sha256 of the node's gRPC TLS certificate, from its signed announcement ("" = plaintext).
    tls_fingerprint: str = ""
    # Free KV positions the node's last heartbeat announced (its KV pool's free blocks x 16), as the
    # tracker saw it when it answered; None = not known.
    kv_free_tokens: int | None = None
    # The stage's load figures as the tracker priced the route (None: an older tracker said nothing).
    load: StageLoad | None = None
    # Heads of the KV block chains the node keeps (its last heartbeat; common/prefix_chain.py).
    prefix_heads: frozenset[str] = frozenset()
    # The tracker's operator lists this node in its trusted_nodes: never on probation here either.
    operator_trusted: bool = False


@dataclass(frozen=True)
class Route:
    route_id: str  # the node chain, short ids joined by ">", e.g. "3fa2c1d0[0:15)>9bd1e2f3[15:30)"
    model_fingerprint: str
    model_name: str
    n_layers: int
    hops: tuple[Hop, ...]
    ticket: bytes  # canonical JSON of the tracker-signed envelope, passed to every stage in OPEN
    expires_at_s: float
    expected_ms_per_token: float
    ring_rtt_ms: float | None = None  # estimated round trip last stage <-> first stage (the decode ring)
    exit_rtt_ms: float | None = None  # estimated round trip last stage <-> this gateway
    n_embd: int = 0  # the model's width (what a stage sends the next per token); 0 = not said
    # When this gateway got the answer (its clock): the hops' kv_free_tokens are at most one heartbeat
    # older (gateway.admission.KvLedger); -inf = not known.
    fetched_at_s: float = -math.inf

    @property
    def stage_loads(self) -> tuple[StageLoad, ...] | None:
        """Every stage's load figures, None unless the tracker sent them for all."""
        loads = tuple(h.load for h in self.hops if h.load is not None)
        return loads if loads and len(loads) == len(self.hops) else None


@dataclass(frozen=True)
class ModelRoutes:
    fingerprint: str
    name: str
    routes: tuple[Route, ...]
    fetched_at_s: float
    # The tracker's view of the whole swarm (not only these routes): the most KV positions one session
    # can hold on some complete route, and what some route has free for one now; None = not known.
    kv_session_max_tokens: int | None = None
    kv_free_max_tokens: int | None = None
    # Node id -> the sessions it reported (its last heartbeat before the tracker answered).
    reported_sessions: dict[str, int] = dataclasses.field(default_factory=dict)


def route_id(hops: Sequence[Hop]) -> str:
    return ">".join(f"{h.node_id[:8]}[{h.start}:{h.end})" for h in hops)


def _opt_float(value: Any) -> float | None:
    """An optional estimate from the tracker: a finite number >= 0, or None (absent, null, nonsense)."""
    if value is None or isinstance(value, bool):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


def _opt_count(value: Any) -> int | None:
    """An optional count from the tracker: an integer >= 0, or None (absent, null, nonsense)."""
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _tls_fingerprint(value: Any) -> str:
    """A hop's pin: 64 lowercase hex, or "" (absent, null); anything else is a malformed answer."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not is_fingerprint(value):
        raise ValueError(f"tls_fingerprint {value!r} is not 64 lowercase hex digits")
    return value


def _stage_load(h: dict[str, Any]) -> StageLoad | None:
    """A hop's load figures (tracker.service: decode_ms_per_token, max_sessions, priced_sessions,
    queue_depth), None when any is absent or nonsense; the uplink is filled in by the caller."""
    decode = _opt_float(h.get("decode_ms_per_token"))
    limit = _opt_count(h.get("max_sessions"))
    priced = _opt_float(h.get("priced_sessions"))
    if decode is None or limit is None or priced is None:
        return None
    return StageLoad(
        decode, limit, priced, _opt_count(h.get("queue_depth")) or 0, _opt_count(h.get("kv_free_tokens"))
    )


def _with_uplinks(hops: tuple[Hop, ...]) -> tuple[Hop, ...]:
    """Each stage's uplink is what the tracker named as the sender's for the next stage's input."""
    out = []
    for i, hop in enumerate(hops):
        if hop.load is not None and i + 1 < len(hops):
            hop = dataclasses.replace(
                hop, load=dataclasses.replace(hop.load, uplink_mbit_s=hops[i + 1].bandwidth_mbit_s)
            )
        out.append(hop)
    return tuple(out)


def _prefix_heads(value: Any) -> frozenset[str]:
    """A hop's reported prefix heads: the well-formed ones (a hint: nonsense is ignored, not fatal)."""
    if not isinstance(value, list):
        return frozenset()
    return frozenset(x for x in value[:MAX_PREFIX_HEADS] if is_head(x))


def _reported_sessions(h: dict[str, Any]) -> int:
    return _opt_count(h.get("active_sessions")) or 0


def parse_routes(body: dict[str, Any], now_s: float) -> ModelRoutes:
    """A ``/v1/routes`` answer (docs/tracker.md) -> :class:`ModelRoutes` (UpstreamFailed if malformed)."""
    try:
        model = body["model"]
        routes: list[Route] = []
        reported: dict[str, int] = {}
        for r in body["routes"]:
            hops = tuple(
                Hop(
                    str(h["node_id"]),
                    int(h["start"]),
                    int(h["end"]),
                    str(h["address"]),
                    bool(h.get("relay", False)),
                    _opt_float(h.get("rtt_ms")),
                    _opt_float(h.get("bandwidth_mbit_s")),
                    bool(h.get("probation", False)),
                    _tls_fingerprint(h.get("tls_fingerprint")),
                    _opt_count(h.get("kv_free_tokens")),
                    _stage_load(h),
                    prefix_heads=_prefix_heads(h.get("prefix_heads")),
                    operator_trusted=h.get("operator_trusted") is True,
                )
                for h in r["hops"]
            )
            hops = _with_uplinks(hops)
            for h in r["hops"]:
                reported[str(h["node_id"])] = _reported_sessions(h)
            routes.append(
                Route(
                    route_id(hops),
                    str(model["fingerprint"]),
                    str(model["name"]),
                    int(model["n_layers"]),
                    hops,
                    canonical_json(r["ticket"]),
                    float(r["expires_at"]),
                    float(r["expected_ms_per_token"]),
                    _opt_float(r.get("ring_rtt_ms")),
                    _opt_float(r.get("exit_rtt_ms")),
                    _opt_count(model.get("n_embd")) or 0,
                    now_s,
                )
            )
        raw_kv = body.get("kv")
        kv: dict[str, Any] = raw_kv if isinstance(raw_kv, dict) else {}
        return ModelRoutes(
            str(model["fingerprint"]),
            str(model["name"]),
            tuple(routes),
            now_s,
            _opt_count(kv.get("session_max_tokens")),
            _opt_count(kv.get("free_max_tokens")),
            reported,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise UpstreamFailed(f"the tracker's route answer is malformed: {err!r}") from err


class RouteCache:
    def __init__(
        self,
        tracker: TrackerClient,
        *,
        k: int,
        ttl_s: float,
        tracker_timeout_s: float,
        metrics: Metrics,
        tracker_key: TrackerKey,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._tracker = tracker
        self._tracker_key = tracker_key
        self._k = k
        self._ttl_s = ttl_s
        self._timeout_s = tracker_timeout_s
        self._metrics = metrics
        self._clock = clock
        self._models: dict[str, ModelRoutes] = {}  # by the name or fingerprint clients use
        self._locks: dict[str, trio.Lock] = {}
        self._inflight: dict[str, int] = {}  # by route id (for metrics)
        self._node_inflight: dict[str, int] = {}  # by node id (for balancing)
        self._reported: dict[str, int] = {}  # node id -> sessions it reported, as of the last look-up
        self.costs: LoadCosts = DEFAULT_LOAD_COSTS  # the tracker's defaults (tracker.routing.DEFAULT_COSTS)
        self._tracker_down_until = -math.inf  # clock time before which the tracker is not asked again
        self._outage = False  # serving stale routes since the last failed look-up
        # (model, head of the prompt's PREFIX_KEY_BLOCKS-th block) -> the look-up naming that prefix
        # (None: it failed), for ttl_s; bounded, the oldest go first.
        self._by_prefix: dict[tuple[str, str], tuple[float, ModelRoutes | None]] = {}

    def _fresh(self, cached: ModelRoutes | None) -> bool:
        if cached is None or not cached.routes:
            return False
        now = self._clock()
        if now - cached.fetched_at_s > self._ttl_s:
            return False
        return all(r.expires_at_s - now > TICKET_MARGIN_S for r in cached.routes)

    async def routes(self, model: str) -> ModelRoutes:
        cached = self._models.get(model)
        if self._fresh(cached):
            assert cached is not None
            return cached
        lock = self._locks.setdefault(model, trio.Lock())
        async with lock:
            cached = self._models.get(model)
            if self._fresh(cached):
                assert cached is not None
                return cached
            try:
                fetched = await self._fetch_or_hold(model)
            except UpstreamFailed:
                stale = self._stale(cached)
                if stale is None:
                    raise
                return stale
            self._models[model] = fetched
            if len(self._models) > 256:  # bounded: forget the oldest look-ups
                oldest = min(self._models, key=lambda m: self._models[m].fetched_at_s)
                self._models.pop(oldest, None)
                self._locks.pop(oldest, None)
            return fetched

    def _stale(self, cached: ModelRoutes | None, exclude: frozenset[str] = frozenset()) -> ModelRoutes | None:
        """During a tracker outage: the cached routes whose tickets stay valid long enough (and that
        avoid ``exclude``), or None."""
        if cached is None:
            return None
        now = self._clock()
        valid = tuple(
            r
            for r in cached.routes
            if r.expires_at_s - now > STALE_MARGIN_S and not exclude & {h.node_id for h in r.hops}
        )
        if not valid:
            return None
        self._metrics.inc("swarm_gateway_tracker_route_requests_total", outcome="stale")
        if not self._outage:
            self._outage = True
            event(
                log,
                "routes_served_stale",
                level=logging.WARNING,
                model=cached.name,
                routes=len(valid),
                ticket_valid_s=round(min(r.expires_at_s for r in valid) - now, 1),
            )
        return dataclasses.replace(cached, routes=valid)

    async def _fetch_or_hold(
        self,
        model: str,
        exclude: frozenset[str] = frozenset(),
        *,
        kv_tokens: int = 0,
        prefix_heads: tuple[str, ...] = (),
    ) -> ModelRoutes:
        """:meth:`_fetch`, unless the tracker failed less than :data:`TRACKER_RETRY_S` ago."""
        if self._clock() < self._tracker_down_until:
            raise UpstreamFailed("the tracker is unreachable (a recent look-up failed)", retry_after_s=5)
        try:
            fetched = await self._fetch(model, exclude, kv_tokens=kv_tokens, prefix_heads=prefix_heads)
        except UpstreamFailed as err:
            # Logged for the look-ups that failed; the requests refused during the hold that follows
            # name it only as "a recent look-up failed".
            self._tracker_down_until = self._clock() + TRACKER_RETRY_S
            event(
                log,
                "tracker_lookup_failed",
                level=logging.WARNING,
                model=model,
                error=err.message,
                hold_s=TRACKER_RETRY_S,
            )
            raise
        if self._outage:
            self._outage = False
            event(log, "routes_refreshed", model=fetched.name, routes=len(fetched.routes))
        return fetched

    async def routes_for_prefix(self, model: str, heads: Sequence[str]) -> ModelRoutes | None:
        """Routes the tracker prices for a prompt whose blocks have these heads (the route holding its
        longest prefix preferred, weighed against load; at most MAX_ROUTE_PREFIX_HEADS sent), for a
        warm request that no cached route shows a prefix of. One look-up per model and first
        PREFIX_KEY_BLOCKS blocks (an app's system prompt) per ``ttl_s``, its answer reused in between;
        None when the look-up failed (the request goes on without it)."""
        if len(heads) < PREFIX_KEY_BLOCKS:
            return None
        key = (model, heads[PREFIX_KEY_BLOCKS - 1])
        now = self._clock()
        known = self._by_prefix.get(key)
        if known is not None and now - known[0] <= self._ttl_s:
            return known[1]
        try:
            found: ModelRoutes | None = await self._fetch_or_hold(
                model, prefix_heads=tuple(heads[:MAX_ROUTE_PREFIX_HEADS])
            )
        except (UpstreamFailed, NoRoute, ModelNotFound):
            found = None
        self._by_prefix.pop(key, None)
        self._by_prefix[key] = (now, found)
        while len(self._by_prefix) > MAX_PREFIX_LOOKUPS:
            self._by_prefix.pop(next(iter(self._by_prefix)))
        return found

    async def fetch_for_kv(self, model: str, kv_tokens: int) -> ModelRoutes:
        """Fresh routes whose nodes announced room for ``kv_tokens`` positions (a prompt longer than
        every cached route holds, where the tracker says the swarm has a route for it); not cached."""
        return await self._fetch_or_hold(model, kv_tokens=kv_tokens)

    async def _fetch(
        self,
        model: str,
        exclude: frozenset[str] = frozenset(),
        *,
        kv_tokens: int = 0,
        prefix_heads: tuple[str, ...] = (),
    ) -> ModelRoutes:
        try:
            with trio.fail_after(self._timeout_s):
                # The key every ticket must be signed with (asked of the tracker only on a first use).
                tracker_id = await self._tracker_key.get(self._tracker)
                # Our id lets the tracker price routes from where this gateway is (its coordinate).
                # Signed with our key: the tickets name this gateway, and only its OPENs use them.
                body = await self._tracker.routes(
                    model,
                    k=self._k,
                    exclude=exclude,
                    gateway_id=self._tracker.key_id,
                    sign=True,
                    kv_tokens=kv_tokens,
                    prefix_heads=prefix_heads,
                )
        except TrackerClientError as err:
            self._metrics.inc("swarm_gateway_tracker_route_requests_total", outcome=str(err.status))
            if err.status == 404:
                raise ModelNotFound(
                    f"The model '{model}' does not exist or no node serves it", param="model"
                ) from err
            if err.status == 400:
                raise ModelNotFound(f"The model '{model}' is not a valid model name", param="model") from err
            raise UpstreamFailed(f"the tracker refused the route request: {err}", retry_after_s=5) from err
        except (httpx.HTTPError, trio.TooSlowError) as err:
            refused = pin_refusal(err)
            if refused is not None:  # not the tracker we pinned: say so in the log, not to the client
                self._metrics.inc("swarm_gateway_tracker_route_requests_total", outcome="tls_refused")
                event(log, "tracker_tls_refused", level=logging.ERROR, error=str(refused))
                raise UpstreamFailed(
                    "the tracker's TLS certificate is not the one this gateway pins (see its log)",
                    retry_after_s=5,
                ) from err
            self._metrics.inc("swarm_gateway_tracker_route_requests_total", outcome="unreachable")
            raise UpstreamFailed(f"the tracker is unreachable: {err!r}", retry_after_s=5) from err
        parsed = parse_routes(body, self._clock()) if body.get("routes") else None
        if parsed is None:
            self._metrics.inc("swarm_gateway_tracker_route_requests_total", outcome="no_route")
            uncovered = body.get("uncovered", [])
            raise NoRoute(
                f"no complete route for model '{model}' right now (layers not covered: {uncovered})",
                retry_after_s=5,
            )
        parsed = self._verified(parsed, tracker_id)
        self.note_reported(parsed)
        if not parsed.routes:
            self._metrics.inc("swarm_gateway_tracker_route_requests_total", outcome="refused")
            raise NoRoute(
                f"no route for model '{model}' right now: the tracker's answer held no route with a valid "
                "ticket for its hops",
                retry_after_s=5,
            )
        self._metrics.inc("swarm_gateway_tracker_route_requests_total", outcome="ok")
        return parsed

    def _verified(self, parsed: ModelRoutes, tracker_id: str) -> ModelRoutes:
        """The routes whose tracker-signed ticket vouches for every hop (gateway/route_tickets.py), with
        the ticket's addresses, pins and expiry; each other route is dropped with one warning line."""
        now = self._clock()
        kept: list[Route] = []
        for route in parsed.routes:
            try:
                ticket = verify_route(
                    route.ticket,
                    route.hops,
                    model_fingerprint=route.model_fingerprint,
                    tracker_id=tracker_id,
                    gateway_id=self._tracker.key_id,
                    now_s=now,
                )
            except TicketRefused as err:
                self._metrics.inc("swarm_gateway_route_tickets_refused_total", reason=err.reason)
                event(
                    log,
                    "route_ticket_refused",
                    level=logging.WARNING,
                    model=parsed.name,
                    route=route.route_id,
                    reason=err.reason,
                    detail=err.message,
                )
                continue
            hops = tuple(
                dataclasses.replace(hop, address=signed.address, tls_fingerprint=signed.tls_fingerprint)
                for hop, signed in zip(route.hops, ticket.hops, strict=True)
            )
            kept.append(dataclasses.replace(route, hops=hops, expires_at_s=ticket.expires_at_s))
        return dataclasses.replace(parsed, routes=tuple(kept))

    async def fetch_excluding(self, model: str, exclude: frozenset[str]) -> ModelRoutes:
        """Fresh routes that avoid ``exclude`` (after a refusal at OPEN); not cached. During a
        tracker outage: the cached routes that avoid ``exclude`` and hold valid tickets."""
        try:
            return await self._fetch_or_hold(model, exclude)
        except UpstreamFailed:
            stale = self._stale(self._models.get(model), exclude)
            if stale is None:
                raise
            return stale

    def invalidate(self, model: str) -> None:
        """Ask the tracker again at the next request (a node failed); the routes stay as the
        fallback for an outage."""
        cached = self._models.get(model)
        if cached is not None:
            self._models[model] = dataclasses.replace(cached, fetched_at_s=-math.inf)

    def cached(self, model: str) -> ModelRoutes | None:
        """The last answer for ``model`` (fresh or not), without asking the tracker."""
        return self._models.get(model)

    def route_load(self, route: Route) -> int:
        """Sessions this gateway runs on the route's nodes (a refresh may pair the same nodes differently)."""
        return sum(self._node_inflight.get(h.node_id, 0) for h in route.hops)

    def note_reported(self, answer: ModelRoutes) -> None:
        """Keep the load the nodes of a fresh answer reported (what :meth:`sessions_now` adds to)."""
        self._reported.update(answer.reported_sessions)

    def sessions_now(self, route: Route) -> list[float]:
        """Each stage's load now as this gateway knows it: what its node reported to the tracker
        (when the routes were fetched) plus this gateway's sessions there."""
        reported = self._reported
        return [float(reported.get(h.node_id, 0) + self._node_inflight.get(h.node_id, 0)) for h in route.hops]

    def route_cost(self, route: Route) -> float | None:
        """The route's expected time per token at its stages' load now (module docstring); None
        when the tracker sent no load figures for it."""
        loads = route.stage_loads
        if loads is None:
            return None
        return repriced_ms(
            route.expected_ms_per_token, loads, self.sessions_now(route), route.n_embd, self.costs
        )

    def acquire(self, routes: Sequence[Route]) -> Route:
        route = cheapest_now(routes, self.route_cost, self.route_load, lambda r: r.expected_ms_per_token)
        self._inflight[route.route_id] = self._inflight.get(route.route_id, 0) + 1
        for hop in route.hops:
            self._node_inflight[hop.node_id] = self._node_inflight.get(hop.node_id, 0) + 1
        return route

    @staticmethod
    def _decrement(counts: dict[str, int], key: str) -> None:
        left = counts.get(key, 0) - 1
        if left > 0:
            counts[key] = left
        else:
            counts.pop(key, None)

    def release(self, route: Route) -> None:
        self._decrement(self._inflight, route.route_id)
        for hop in route.hops:
            self._decrement(self._node_inflight, hop.node_id)

    def inflight(self) -> dict[str, int]:
        return dict(self._inflight)

    def peers(self) -> list[tuple[str, str]]:
        """(node id, address) of the nodes of the cached routes reached over gRPC (what this gateway
        pings for the tracker's network coordinates), busiest models' routes first."""
        out: dict[str, str] = {}
        for cached in sorted(self._models.values(), key=lambda m: -m.fetched_at_s):
            for route in cached.routes:
                for hop in route.hops:
                    if not hop.relay and hop.address:
                        out.setdefault(hop.node_id, hop.address)
        return list(out.items())

    def cached_counts(self) -> dict[str, int]:
        return {m.name: len(m.routes) for m in self._models.values()}


@dataclass(frozen=True)
class StageInfo:
    """What a route needs to know about one node (from its Info)."""

    node_id: str
    address: str
    recipe_fingerprint: str
    n_embd: int
    n_layers: int
    n_ctx_train: int
    is_last: bool
    serves_vocab: bool
    max_frame_bytes: int
    max_step_tokens: int
    max_kv_tokens_per_session: int
    fetched_at_s: float
    # Recipe.check_fingerprint: nodes compared bit for bit share it (CPU features included).
    check_fingerprint: str = ""


class NodeInfoCache:
    def __init__(
        self,
        channels: NodeChannels,
        *,
        ttl_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._channels = channels
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        # (node id, address, model fingerprint, start, end): a node that moved to another model or span
        # (tracker/rebalance.py) at the same address and id is asked again, not served its old Info.
        self._infos: dict[tuple[str, str, str, int, int], StageInfo] = {}

    async def get(self, hop: Hop, model_fingerprint: str) -> StageInfo:
        key = (hop.node_id, hop.address, model_fingerprint, hop.start, hop.end)
        if hop.relay:
            # Relayed through us: the Info the node sent when its socket connected (gateway/relay.py).
            relay_info = getattr(self._channels, "relay_info", None)
            try:
                if relay_info is None:
                    raise StreamError("this gateway serves no relay")
                info = relay_info(hop)
            except StreamError as err:
                raise StageFailed(
                    f"node {hop.node_id[:8]} is reachable only through a relay: {err}", node_id=hop.node_id
                ) from err
        else:
            cached = self._infos.get(key)
            if cached is not None and self._clock() - cached.fetched_at_s <= self._ttl_s:
                return cached
            try:
                with trio.fail_after(self._timeout_s):
                    info = await self._channels.info(hop.address, hop.tls_fingerprint)
            except (StreamError, trio.TooSlowError) as err:
                raise StageFailed(
                    f"node {hop.node_id[:8]} at {hop.address} did not answer Info: {err}",
                    node_id=hop.node_id,
                    answered=isinstance(err, CertificateRefused),
                ) from err
        if info.node_id != hop.node_id:
            raise StageFailed(
                f"node at {hop.address} is {info.node_id[:8]}, not {hop.node_id[:8]} as routed",
                node_id=hop.node_id,
            )
        if info.model.fingerprint != model_fingerprint or (info.shard.start, info.shard.end) != (
            hop.start,
            hop.end,
        ):
            raise StageFailed(
                f"node {hop.node_id[:8]} serves another model or shard than routed", node_id=hop.node_id
            )
        limits = info.limits
        # The most positions one session may hold there: what the node's Info says. A node too old to
        # say (0) is held to the model's trained context, and its OPEN grant is checked against the
        # session's budget anyway (gateway.session_machine: fewer granted = busy); a node that names
        # neither cannot be sized, and is not routed to (no guessed default).
        session_kv = int(limits.max_kv_tokens_per_session) or int(info.model.n_ctx_train)
        if session_kv <= 0:
            raise StageFailed(
                f"node {hop.node_id[:8]}'s Info names neither its per-session KV limit nor the model's "
                "context (an old or broken node): not routed to",
                node_id=hop.node_id,
                answered=True,
            )
        stage = StageInfo(
            node_id=info.node_id,
            address=hop.address,
            recipe_fingerprint=(recipe := Recipe.from_wire(info.recipe)).fingerprint(),
            check_fingerprint=recipe.check_fingerprint(),
            n_embd=int(info.model.n_embd),
            n_layers=int(info.model.n_layers),
            n_ctx_train=int(info.model.n_ctx_train),
            is_last=bool(info.is_last),
            serves_vocab=bool(info.serves_vocab),
            max_frame_bytes=int(limits.max_frame_bytes) or 4 * 1024 * 1024,
            max_step_tokens=int(limits.max_step_tokens) or 512,
            max_kv_tokens_per_session=session_kv,
            fetched_at_s=self._clock(),
        )
        if len(self._infos) > 4096:
            self._infos.clear()  # bounded; refilled on demand
        self._infos[key] = stage
        return stage

    def forget(self, hop: Hop) -> None:
        for key in [k for k in self._infos if k[:2] == (hop.node_id, hop.address)]:  # at most 4096
            del self._infos[key]


def step_limit(stages: Sequence[StageInfo], wanted: int) -> int:
    return max(1, min([wanted, *(s.max_step_tokens for s in stages)]))


def frame_limit(stages: Sequence[StageInfo], own: int) -> int:
    return min([own, *(s.max_frame_bytes for s in stages)])
