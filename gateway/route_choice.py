"""Route choice: which route of the candidates a request runs on, and its prepared prompt there.

* **Prepare** (:meth:`RouteChoice.prepare`): the route's stages' infos (concurrently), the
  model's vocabulary, the prompt rendered (chat template, tools) and tokenized, the request's
  budget on the route (:mod:`gateway.prompt_plan`).
* **Pick** (:meth:`RouteChoice.pick`): choices 1..n-1 go to choice 0's route (its KV is their
  source); else the least loaded candidate, then -- when the prompt passes that route's context --
  another that holds it (:meth:`_longer_route`: nodes with a KV pool serve longer contexts; one
  look-up for routes with room when the tracker says some route holds that many positions; else
  413 ``prompt_too_long``), then -- when its nodes announced less free KV than the request needs --
  one that announced room (:meth:`_kv_fit`; none: ``KvExhausted``, the KV wait), and last a warm
  request's kept prefix: the route keeping it when it has room (at most ``prefix_route_slack``
  more sessions than the one picked) and no node on probation another route could check. A prompt
  this gateway keeps nothing for may still start with a prefix some route's nodes keep (another
  gateway's request, or one this gateway forgot): each node reports heads of its kept block chains
  (common/prefix_chain.py) through the tracker, and :meth:`_reported_prefix` prefers the route whose
  every stage holds the longest prefix of the prompt, within the same slack, opening it with a copy
  named by the prefix's chain hash (``KvSource "blocks:<hex>"``; shared across clients, so only with
  ``prefix_share_min_tokens`` > 0 and at least that many positions).

Every route returned is acquired (``RouteCache.acquire``): the caller releases it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from common.prefix_chain import BLOCK_TOKENS, MAX_SOURCE_HASHES, chain, head, held_blocks, source_id
from gateway import tools
from gateway.admission import fits_kv, kv_need, kv_room, kv_verdict
from gateway.config import GatewayConfig
from gateway.errors import InvalidRequest, KvExhausted, NoRoute, StageFailed
from gateway.gate import KvGate, KvShort
from gateway.groups import single_exception
from gateway.metrics import Metrics
from gateway.prefix_cache import Hit, Kept, PrefixCache
from gateway.prompt_plan import TooLongHere, budget, context_limit
from gateway.protocol import GenerationRequest
from gateway.routes import NodeInfoCache, Route, RouteCache, StageInfo, step_limit
from gateway.spot_checks import SpotChecks
from gateway.vocab_store import LoadedVocab, VocabStore

FIT_PROBES = 4  # routes fits() tries (distinct routes of one model mostly share their limits)


@dataclass
class Prepared:
    route: Route
    stages: list[StageInfo]
    vocab: LoadedVocab
    prompt: list[int]
    max_new: int
    kv_budget: int
    grammar: str = ""
    # A resume or route replay: positions from here on (the generated tokens) are prefilled one per step
    # (RouteConfig.single_from; 0 = chunked). Shadows and judges of a spot check use the same.
    replay_from: int = 0


class RouteChoice:
    def __init__(
        self,
        config: GatewayConfig,
        metrics: Metrics,
        routes: RouteCache,
        node_infos: NodeInfoCache,
        vocabs: VocabStore,
        prefix: PrefixCache,
        spot: SpotChecks,
        kv_retry_after_s: Callable[[], int],
        kv_gate: KvGate | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.routes = routes
        self.node_infos = node_infos
        self.vocabs = vocabs
        self.prefix = prefix
        self.spot = spot
        self._kv_retry_after_s = kv_retry_after_s
        self.kv_gate = kv_gate  # its ledger: the KV this gateway committed since the heartbeats

    async def fits(self, request: GenerationRequest, model: str) -> bool:
        """Whether the request's prompt plus max_tokens fits a route of ``model`` now: the prompt is
        rendered and tokenized as for a request, nothing is opened (a conversation's compaction asks
        this before a turn). No route known: True, and the request itself reports what is wrong."""
        routes = (await self.routes.routes(model)).routes
        for route in routes[:FIT_PROBES]:
            try:
                await self.prepare(request, route)
                return True
            except TooLongHere:
                continue
        return not routes

    async def prepare(self, request: GenerationRequest, route: Route) -> Prepared:
        infos: dict[int, StageInfo] = {}

        async def fetch(i: int) -> None:
            infos[i] = await self.node_infos.get(route.hops[i], route.model_fingerprint)

        with single_exception():
            async with trio.open_nursery() as nursery:
                for i in range(len(route.hops)):
                    nursery.start_soon(fetch, i)
        stages = [infos[i] for i in range(len(route.hops))]
        vocab = await self.vocabs.get(route.model_fingerprint, stages)
        if request.kind == "chat":
            messages, extra = tools.template_messages(request, vocab.template.source)
            text = await vocab.render_chat(messages, add_generation_prompt=True, **extra)
            prompt = await vocab.tokenize(text, add_special=False)
        elif request.prompt_tokens is not None:
            vocab.check_ids(request.prompt_tokens)
            prompt = list(request.prompt_tokens)
        else:
            prompt = await vocab.tokenize(request.prompt_text or "", add_special=True)
        if not prompt:
            raise InvalidRequest("the prompt is empty after tokenization", param="prompt")
        bad = [t for t, _ in request.logit_bias if t >= vocab.n_vocab]
        if bad:
            raise InvalidRequest(
                f"logit_bias names token {bad[0]}, outside the vocabulary (size {vocab.n_vocab})",
                param="logit_bias",
            )
        plan = budget(request, len(prompt), context_limit(stages))
        return Prepared(route, stages, vocab, prompt, plan.max_new, plan.kv_budget)

    def warm(self, request: GenerationRequest) -> bool:
        """The request keeps its KV for a next turn, and may start from a kept prefix."""
        return self.config.kv_keep_s > 0 and request.cache_prompt and request.n == 1

    async def pick(
        self,
        request: GenerationRequest,
        candidates: list[Route],
        *,
        model: str,
        client: str,
        fork: tuple[Route, Prepared] | None = None,
    ) -> tuple[Route, Prepared, Hit | None]:
        """The route and the prepared prompt: n > 1 choices go to choice 0's route; a request whose
        prompt extends a kept prefix of its client goes to the route keeping it when that route has
        room (at most ``prefix_route_slack`` more sessions than the least loaded); else least loaded."""
        if fork is not None:
            same = [r for r in candidates if r.hops == fork[0].hops]
            if same:
                route = self.routes.acquire(same)
                p = fork[1]
                return route, Prepared(route, p.stages, p.vocab, p.prompt, p.max_new, p.kv_budget), None
        route = self.routes.acquire(candidates)
        try:
            prepared = await self.prepare(request, route)
        except TooLongHere as too_long:
            self.routes.release(route)
            route, prepared = await self._longer_route(
                model, request, [r for r in candidates if r is not route], too_long
            )
        except BaseException:
            self.routes.release(route)
            raise
        route, prepared = await self._kv_fit(request, route, prepared, candidates, model)
        if not self.warm(request):
            return route, prepared, None
        hit = self.prefix.lookup(client, route.model_fingerprint, prepared.prompt, trio.current_time())
        if hit is None:
            self.prefix.take(None)
            return await self._reported_prefix(request, route, prepared, candidates, model)
        holder = next((r for r in candidates if tuple(h.node_id for h in r.hops) == hit.entry.nodes), None)
        suspects = set() if holder is None else {h.node_id for h in holder.hops if self.spot.on_probation(h)}
        if suspects and any(not suspects <= {h.node_id for h in r.hops} for r in candidates):
            # A warm turn cannot be checked (the shadow holds no kept KV) and a node can tell one
            # from a cold request: through a node on probation that another route could check,
            # every request runs cold, and checked.
            holder = None
        if holder is None or (
            holder is not route
            and self.routes.route_load(holder)
            > self.routes.route_load(route) + self.config.prefix_route_slack
        ):
            self.prefix.take(None)
            return route, prepared, None
        self.prefix.take(hit)
        if holder is not route:
            self.routes.release(route)
            route = self.routes.acquire([holder])
            try:
                prepared = await self.prepare(request, route)
            except BaseException:
                self.routes.release(route)
                raise
        if hit.shared:
            hit = self._by_blocks(hit, prepared)
        return route, prepared, hit

    def _by_blocks(self, hit: Hit, prepared: Prepared) -> Hit:
        """Another client's kept prefix, named by the prompt's chain hashes instead of that session's id
        (``blocks:<deepest>+...``, down to ``prefix_share_min_tokens``): each node copies the deepest of
        them any kept session holds. The session this gateway remembers may be gone (a node keeps fewer
        sessions than this index, and evicts the least recently used first) while another kept session
        of the same app holds the same system prompt; by its id the request would start empty and
        prefill the whole prompt. Cut at whole blocks (and steps, with ``prefix_exact``); a hit too
        short for that stays as it was."""
        step = step_limit(prepared.stages, self.config.prefill_step_tokens) if self.prefix.exact else 0
        unit = math.lcm(BLOCK_TOKENS, step) if step > 0 else BLOCK_TOKENS
        deepest = hit.positions // unit * unit
        low = -(-max(self.config.prefix_min_tokens, self.config.prefix_share_min_tokens, 1) // unit) * unit
        if deepest < low:
            return hit
        named = prefix_names(prepared.stages[0].recipe_fingerprint, prepared.prompt, deepest, low, unit)
        entry = dataclasses.replace(
            hit.entry,
            session_id=source_id(named[0], step, named[1:]),
            tokens=tuple(prepared.prompt[:deepest]),
            exact=deepest,
            step=max(1, step),
        )
        return Hit(entry, deepest, shared=True)

    async def _reported_prefix(
        self,
        request: GenerationRequest,
        route: Route,
        prepared: Prepared,
        candidates: list[Route],
        model: str,
    ) -> tuple[Route, Prepared, Hit | None]:
        """The candidate whose every stage reported (heartbeat heads) the longest prefix of the prompt,
        when it carries at most ``prefix_route_slack`` more sessions than ``route`` (the one picked);
        the hit names the prefix by its chain hashes and is copied on every stage. When no candidate
        shows any of it and the prompt is long enough to share: the candidates of a look-up naming
        the prompt's heads too (``RouteCache.routes_for_prefix``: the tracker prices the prefix,
        weighed against load). None found: ``route`` as it was, cold."""
        share = self.config.prefix_share_min_tokens
        least = max(self.config.prefix_min_tokens, share)
        if share <= 0 or len(prepared.prompt) <= least:
            return route, prepared, None
        step = step_limit(prepared.stages, self.config.prefill_step_tokens) if self.prefix.exact else 0
        fingerprint = prepared.stages[0].recipe_fingerprint
        heads = [head(h) for h in chain(fingerprint, prepared.prompt[: len(prepared.prompt) - 1])]
        wanted = set(heads)

        def shows(routes: list[Route]) -> bool:
            return any(not wanted.isdisjoint(h.prefix_heads) for r in routes for h in r.hops)

        if not shows(candidates):
            asked = await self.routes.routes_for_prefix(model, heads)
            known = {tuple(h.node_id for h in r.hops) for r in candidates}
            more = (
                []
                if asked is None
                else [r for r in asked.routes if tuple(h.node_id for h in r.hops) not in known]
            )
            if not shows(more):
                return route, prepared, None
            candidates = [*candidates, *more]

        def suspect(r: Route) -> bool:
            # As for a kept prefix: not through a node on probation that another route could check.
            on = {h.node_id for h in r.hops if self.spot.on_probation(h)}
            return bool(on) and any(not on <= {h.node_id for h in o.hops} for o in candidates)

        found = reported_prefix(
            prepared.prompt,
            fingerprint,
            candidates,
            route,
            self.routes.route_load,
            slack=self.config.prefix_route_slack,
            least=least,
            step=step,
            suspect=suspect,
        )
        if found is None:
            return route, prepared, None
        holder, positions, named = found
        if holder is not route:
            self.routes.release(route)
            route = self.routes.acquire([holder])
            try:
                other = await self.prepare(request, route)
            except BaseException:
                self.routes.release(route)
                raise
            if other.stages[0].recipe_fingerprint != prepared.stages[0].recipe_fingerprint:
                return route, other, None  # another recipe: its chains differ (a head collision)
            prepared = other
        entry = Kept(
            "",
            route.model_fingerprint,
            tuple(h.node_id for h in route.hops),
            source_id(named[0], step, named[1:]),
            tuple(prepared.prompt[:positions]),
            math.inf,
            positions,
            max(1, step),
        )
        hit = Hit(entry, positions, shared=True)
        self.prefix.take(hit)
        return route, prepared, hit

    async def _longer_route(
        self, model: str, request: GenerationRequest, others: list[Route], too_long: TooLongHere
    ) -> tuple[Route, Prepared]:
        """The prompt passes the picked route's context (its nodes' per-session KV): the first other
        candidate whose stages can hold it (nodes with a KV pool serve longer contexts). None does:
        when the tracker said some route of the swarm holds that many positions per session
        (``kv.session_max_tokens`` of its answer), one look-up for routes with room for it, and
        :class:`KvExhausted` (the KV wait) when none has room now; else 413 ``prompt_too_long``
        naming the largest context of the routes tried and of the tracker's answer."""
        largest = too_long.limit
        swarm_max = (await self.routes.routes(model)).kv_session_max_tokens
        if swarm_max is not None and swarm_max >= too_long.wanted:
            try:
                others = [*others, *(await self.routes.fetch_for_kv(model, too_long.wanted)).routes]
            except NoRoute as err:
                raise KvExhausted(
                    f"a route of the swarm holds {too_long.wanted} positions per session, but none has "
                    "them free now",
                    retry_after_s=self._kv_retry_after_s(),
                ) from err
        for other in others:
            route = self.routes.acquire([other])
            try:
                return route, await self.prepare(request, route)
            except TooLongHere as shorter:
                largest = max(largest, shorter.limit)
                self.routes.release(route)
            except StageFailed:
                # Not answering now: the refusal stands unless another fits.
                self.routes.release(route)
            except BaseException:
                self.routes.release(route)
                raise
        if swarm_max is not None and swarm_max < too_long.wanted:
            largest = max(largest, swarm_max)
        self.metrics.inc("swarm_gateway_prompt_too_long_total")
        raise too_long.refusal(largest)

    def _free(self, route: Route) -> list[int | None]:
        """Each stage's free KV as this gateway believes it: announced less what it committed since
        (gateway.admission.KvLedger)."""
        if self.kv_gate is None:
            return [h.kv_free_tokens for h in route.hops]
        ledger = self.kv_gate.ledger
        return [ledger.free(h.node_id, h.kv_free_tokens, route.fetched_at_s) for h in route.hops]

    def kv_room_now(self, model: str) -> int | None:
        """The most positions one cached route of ``model`` can take now, as this gateway believes
        (None: not known -- no answer, or a stage announced nothing)."""
        cached = self.routes.cached(model)
        if cached is None or not cached.routes:
            return None
        rooms = [kv_room(self._free(r)) for r in cached.routes]
        if any(r is None for r in rooms):
            return None
        return max(r for r in rooms if r is not None)

    def _commit(self, request: GenerationRequest, route: Route, need: int) -> None:
        if self.kv_gate is not None:
            self.kv_gate.ledger.commit(id(request), [h.node_id for h in route.hops], need, time.time())

    async def _kv_fit(
        self,
        request: GenerationRequest,
        route: Route,
        prepared: Prepared,
        candidates: list[Route],
        model: str = "",
    ) -> tuple[Route, Prepared]:
        """The picked route, or another candidate when the picked one's nodes have less free KV than
        the prompt plus max_tokens needs and the other's do not (gateway.admission.fits_kv, on the
        free KV this gateway believes: :meth:`_free`). When no candidate has room, or others of the
        model wait for KV room before it (its turn comes in the wait): :class:`KvExhausted`, which the
        caller waits out in the KV wait (gateway.gate.KvGate) -- the request fits a route's context
        (``prepare`` checked), not the free KV now. The route returned has the request's need
        committed in the ledger (the caller releases it)."""
        need = kv_need(len(prepared.prompt), request.max_tokens)
        if self.kv_gate is not None and self.kv_gate.must_wait(id(request), model):
            self.routes.release(route)
            raise KvShort(
                f"other requests wait for KV room before this one ({need} positions)",
                need_tokens=need,
                queued=True,
                retry_after_s=self._kv_retry_after_s(),
            )
        if fits_kv(self._free(route), need):
            self._commit(request, route, need)
            return route, prepared
        roomy = [r for r in candidates if r is not route and fits_kv(self._free(r), need)]
        if not roomy:
            rooms = [kv_room(self._free(r)) for r in candidates]
            if kv_verdict(need, None, rooms) == "wait":
                self.routes.release(route)
                raise KvShort(
                    f"no route announced {need} free KV positions (the prompt's {len(prepared.prompt)} "
                    f"plus max_tokens)",
                    need_tokens=need,
                    retry_after_s=self._kv_retry_after_s(),
                )
            self._commit(request, route, need)
            return route, prepared
        self.routes.release(route)
        other = self.routes.acquire(roomy)
        self._commit(request, other, need)
        try:
            return other, await self.prepare(request, other)
        except BaseException:
            self.routes.release(other)
            if self.kv_gate is not None:
                self.kv_gate.ledger.release(id(request), time.time())
            raise


def reported_prefix(
    prompt: Sequence[int],
    fingerprint: str,
    candidates: Sequence[Route],
    picked: Route,
    load: Callable[[Route], int],
    *,
    slack: int,
    least: int,
    step: int = 0,
    suspect: Callable[[Route], bool] = lambda r: False,
) -> tuple[Route, int, tuple[bytes, ...]] | None:
    """Prefix-aware choice (pure): (route, positions, chain hashes) of the candidate whose every stage
    reported the longest prefix of ``prompt`` among its heads, or None. The hashes name the prompt's
    prefixes the OPEN asks for, the deepest first: ``positions`` long, then shorter ones down to what
    the heads showed every stage holds (common.prefix_chain.source_id: each node copies the deepest it
    holds, so a prompt sharing 1,500 positions with a kept one reuses them all, not only the heads'
    ladder step below; at most MAX_SOURCE_HASHES of them, evenly spaced when the span holds more).

    Positions are cut at a multiple of ``step`` (> 0: exact reuse, whole prefill steps) and of the
    16-position block, leave at least one prompt token to prefill, and are at least ``least``. A route
    qualifies when every stage reported a head of the prompt at least one such cut deep; routes rank
    by the positions every stage reported. Load: only routes carrying at most ``slack`` more sessions
    than ``picked`` (the least loaded) qualify, so one hot prefix does not pile every request on one
    route -- past the slack its requests go elsewhere and start another copy there. Ties: the lighter
    route, then ``picked``. Routes with a node ``suspect`` (on probation, when another route could check it: a
    warm request is not checked) are left out."""
    hashes = chain(fingerprint, prompt[: len(prompt) - 1])
    if not hashes:
        return None
    heads = [head(h) for h in hashes]
    unit = math.lcm(BLOCK_TOKENS, step) if step > 0 else BLOCK_TOKENS
    ceiling = len(hashes) * BLOCK_TOKENS // unit * unit
    low = -(-max(least, 1) // unit) * unit  # the shortest prefix worth naming
    if ceiling < low:
        return None
    limit = load(picked) + slack
    best: tuple[int, int, int] | None = None  # (positions every stage reported, -load, picked?)
    chosen: Route | None = None
    for r in candidates:
        if load(r) > limit or suspect(r) or not all(h.prefix_heads for h in r.hops):
            continue
        blocks = min(held_blocks(tuple(h.prefix_heads), heads) for h in r.hops)
        key = ((blocks * BLOCK_TOKENS) // unit * unit, -load(r), int(r is picked))
        if key[0] == 0:
            continue  # not one whole step that every stage showed it holds
        if best is None or key > best:
            best, chosen = key, r
    if best is None or chosen is None:
        return None
    return chosen, ceiling, prefix_names(fingerprint, prompt, ceiling, max(low, best[0]), unit, hashes)


def prefix_names(
    fingerprint: str,
    prompt: Sequence[int],
    deepest: int,
    low: int,
    unit: int,
    hashes: Sequence[bytes] | None = None,
) -> tuple[bytes, ...]:
    """The chain hashes of ``prompt``'s prefixes of ``deepest``, ``deepest - unit``, ... down to
    ``low`` positions (multiples of ``unit``, itself a multiple of the 16-position block; ``low`` >= 1
    unit), deepest first; at most MAX_SOURCE_HASHES, evenly spaced (the deepest and ``low`` always
    among them) when the span holds more. ``hashes``: the prompt's chain, when computed already."""
    chained = chain(fingerprint, prompt[:deepest]) if hashes is None else hashes
    wanted = list(range(deepest, low - 1, -unit))
    if len(wanted) > MAX_SOURCE_HASHES:
        last = len(wanted) - 1
        picks = sorted({round(k * last / (MAX_SOURCE_HASHES - 1)) for k in range(MAX_SOURCE_HASHES)})
        wanted = [wanted[k] for k in picks]
    return tuple(chained[p // BLOCK_TOKENS - 1] for p in wanted)
