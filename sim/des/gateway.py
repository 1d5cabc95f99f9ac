"""The gateway: admission, Route Sessions, the data plane and recovery.

Data planes (``gateway.data_plane``, docs/simulation.md). ``relay``: the gateway
opens one stream per stage and relays every frame, so a hop is gateway ->
stage -> gateway. ``push``: the gateway sends token ids to the first stage; each
stage pushes its hidden states straight to the next; the last stage sends the
sampled token to the gateway and, for the next decode step, straight to the
first stage (the decode ring), so decode runs without the gateway. The first
stage receives token ids, later stages hidden states (``n_tokens * n_embd * 2``
bytes), the last stage sends the sampled token. Recovery replays through the
gateway in both.

Routes
    Each gateway keeps, per model, a pool of ``routes_k`` data-parallel routes
    from the routing policy, refreshed every ``heartbeat_interval_s`` (when the
    tracker's load view changes) or sooner -- but at most once per
    ``route_refresh_min_s`` -- when no pooled route can take a new session and
    the swarm changed since. A new session goes to the pooled
    route whose stages all accept sessions and whose expected time per token,
    scaled by its busiest stage's occupancy, is lowest. If none can, the
    request waits in a bounded FIFO queue (``max_queue``) for at most
    ``admission_timeout_s``.

Recovery
    When a stage is lost (crash, detected after ``failure_detect_s``; or the end
    of a graceful drain), the session's in-flight work is abandoned (its epoch
    grows) and the gateway asks the routing policy for a replacement of the
    lost span, excluding the lost nodes. New stages first replay the
    committed context (prompt plus tokens generated so far) as prefill chunks;
    then the interrupted prefill continues, or the interrupted decode step is
    redone from the first stage. The outage -- from the loss to the resumed
    work -- is the time lost to recovery. A session with no replacement after
    ``recovery_timeout_s`` fails.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from sim.des.config import GatewayConfig, ModelConfig
from sim.des.events import EventLoop
from sim.des.geography import Geography
from sim.des.metrics import Metrics
from sim.des.node import GONE, SERVING, SimNode, WorkItem
from sim.des.policies import PlannedRoute, Routing
from sim.des.session import DECODE, DONE, FAILED, PREFILL, QUEUED, RECOVERING, REPLAY, Session
from sim.des.snapshots import SnapshotCache
from tracker.routing import Route, repriced_ms


@dataclass
class _Pool:
    version: int
    computed_s: float
    routes: list[tuple[list[SimNode], float, Route | None]]
    n_embd: int


class Gateways:
    def __init__(
        self,
        cfg: GatewayConfig,
        models: tuple[ModelConfig, ...],
        fingerprints: list[str],
        n_gateways: int,
        bandwidth_mbps: float,
        refresh_s: float,
        loop: EventLoop,
        nodes: dict[str, SimNode],
        cache: SnapshotCache,
        routing: Routing,
        metrics: Metrics,
        rng: random.Random,
        on_session_left_node: Callable[[SimNode], None],
        geo: Geography | None = None,
    ) -> None:
        self.cfg = cfg
        self._push = cfg.data_plane == "push"
        self._reprice = cfg.reprice_routes
        self._geo = geo
        if self._push and geo is None:
            raise ValueError("the push data plane needs the geography (node-to-node latency)")
        self.models = models
        self.fingerprints = fingerprints
        self.n_gateways = n_gateways
        self._bps = bandwidth_mbps * 1e6
        self._refresh_s = refresh_s
        self.loop = loop
        self.nodes = nodes
        self.cache = cache
        self.routing = routing
        self.metrics = metrics
        self.rng = rng
        self._left_node = on_session_left_node
        self._pools: dict[tuple[int, int], _Pool] = {}
        self._queues: dict[tuple[int, int], deque[Session]] = {
            (g, m): deque() for g in range(n_gateways) for m in range(len(models))
        }
        self.sessions: dict[int, Session] = {}  # not yet ended

    # -- admission ------------------------------------------------------------
    def submit(self, s: Session) -> None:
        self.metrics.arrived += 1
        self.sessions[s.id] = s
        q = self._queues[(s.gateway, s.model_index)]
        if not q and self._try_admit(s):
            return
        if len(q) >= self.cfg.max_queue:
            self._fail(s, "queue_full")
            return
        q.append(s)
        self.loop.schedule_in(self.cfg.admission_timeout_s, self._admission_deadline, s)

    def _admission_deadline(self, s: Session) -> None:
        if s.phase == QUEUED:
            self._fail(s, "no_route" if not self._has_any_route(s) else "admission_timeout")

    def _has_any_route(self, s: Session) -> bool:
        pool = self._pools.get((s.gateway, s.model_index))
        return bool(pool and pool.routes)

    def drain_queues(self, model_index: int | None = None) -> None:
        """Admit waiting requests while routes have room (FIFO per gateway and model)."""
        for (_g, m), q in self._queues.items():
            if model_index is not None and m != model_index:
                continue
            while q:
                s = q[0]
                if s.phase != QUEUED:
                    q.popleft()
                    continue
                if not self._try_admit(s):
                    break
                q.popleft()

    def queued_count(self) -> int:
        return sum(1 for q in self._queues.values() for s in q if s.phase == QUEUED)

    def _pool(self, g: int, m: int, force: bool = False) -> _Pool:
        key = (g, m)
        pool = self._pools.get(key)
        now = self.loop.now
        stale = pool is None or (
            pool.version != self.cache.version and now - pool.computed_s >= self._refresh_s
        )
        if (
            force
            and pool is not None
            and pool.version != self.cache.version
            and now - pool.computed_s >= self.cfg.route_refresh_min_s
        ):
            stale = True
        if stale:
            planned = self.routing.select(
                self.cache.routable(), self.fingerprints[m], self.cfg.routes_k, g, self.rng
            )
            pool = _Pool(
                self.cache.version,
                now,
                [(self._resolve(p), p.expected_ms_per_token, p.route) for p in planned],
                self.models[m].n_embd,
            )
            self._pools[key] = pool
        assert pool is not None
        return pool

    def _resolve(self, p: PlannedRoute) -> list[SimNode]:
        return [self.nodes[nid] for nid in p.node_ids]

    def _choose(self, pool: _Pool) -> list[SimNode] | None:
        """The pooled route to place a new session on. With the tracker's routes: the one whose
        cost re-priced at its stages' current load (:func:`tracker.routing.repriced_ms`) is lowest;
        otherwise the expected time per token scaled by the busiest stage's occupancy."""
        best: list[SimNode] | None = None
        best_score = 0.0
        bound = self.cfg.max_route_ms_per_token
        costs = self.routing.costs
        for route, expected_ms, priced in pool.routes:
            if bound and expected_ms > bound:
                continue
            occupancy = 0.0
            ok = True
            for n in route:
                if not n.accepting:
                    ok = False
                    break
                occ = len(n.sessions) / n.profile.max_sessions
                if occ > occupancy:
                    occupancy = occ
            if not ok:
                continue
            if priced is not None and self._reprice:
                score = repriced_ms(priced, {n.node_id: len(n.sessions) for n in route}, pool.n_embd, costs)
            else:
                score = expected_ms * (1.0 + occupancy)
            if best is None or score < best_score:
                best, best_score = route, score
        return best

    def _try_admit(self, s: Session) -> bool:
        pool = self._pool(s.gateway, s.model_index)
        route = self._choose(pool)
        if route is None:
            pool = self._pool(s.gateway, s.model_index, force=True)
            route = self._choose(pool)
        if route is None:
            return False
        self._set_route(s, list(route))
        for n in route:
            n.sessions[s.id] = s
        self.metrics.stages_per_session[len(route)] += 1
        s.phase = PREFILL
        s.ring_prefill = s.ring_tokens = 0
        self._send_prefill(s)
        return True

    def pools(self) -> list[list[str]]:
        """Per gateway: the node ids of its pooled routes (what it measures for coordinates)."""
        out: list[list[str]] = [[] for _ in range(self.n_gateways)]
        for (g, _m), pool in sorted(self._pools.items()):
            seen = dict.fromkeys(out[g])
            for route, _, _ in pool.routes:
                for n in route:
                    seen[n.node_id] = None
            out[g] = list(seen)
        return out

    def push_pairs(self) -> list[tuple[str, str]]:
        """(stage, next stage) of every running session's route, with the ring (last, first)."""
        pairs: dict[tuple[str, str], None] = {}
        for s in self.sessions.values():
            r = s.route
            for a, b in zip(r, r[1:] + r[:1], strict=True):
                if a is not b:
                    pairs[(a.node_id, b.node_id)] = None
        return list(pairs)

    # -- the session's work ----------------------------------------------------
    def _set_route(self, s: Session, route: list[SimNode]) -> None:
        """The session's route, and with direct push the one-way latency (s) of each hop after
        each stage: stage i -> stage i + 1, and last -> first (the ring)."""
        s.route = route
        if self._push:
            s.hop_s = [self._one_way_s(a, b) for a, b in zip(route, route[1:] + route[:1], strict=True)]
        else:
            s.hop_s = []

    def _send(self, s: Session, item: WorkItem, hidden: bool) -> None:
        node = s.route[item.hop]
        n_bytes = item.n_tokens * (self.models[s.model_index].n_embd * 2 if hidden else 4)
        loop = self.loop
        loop.push(loop.now + n_bytes * 8.0 / self._bps + node.gateway_latency_s[s.gateway], node.arrive, item)

    def _send_prefill(self, s: Session) -> None:
        chunk = self.cfg.prefill_chunk_tokens
        last = len(s.route) - 1
        pos = s.prefill_tokens_done
        while pos < s.prompt_tokens:
            n = min(chunk, s.prompt_tokens - pos)
            self._send(s, WorkItem(s, 0, last, n, n * (pos + n / 2.0), False, "prefill"), hidden=False)
            pos += n

    def _send_decode(self, s: Session) -> None:
        ctx = s.prompt_tokens + s.tokens_out
        self._send(s, WorkItem(s, 0, len(s.route) - 1, 1, float(ctx), True, "decode"), hidden=False)

    def on_output(self, node: SimNode, item: WorkItem, t_sent: float) -> None:
        """A stage's output frame left ``node``'s uplink at ``t_sent``."""
        s = item.session
        if self._push:
            if s.epoch != item.epoch or s.phase == DONE or s.phase == FAILED:  # item.stale
                return
            hop = item.hop
            if hop < item.last_hop:  # straight to the next stage
                nxt = s.route[hop + 1]
                item.hop = hop + 1
                self.loop.push(t_sent + s.hop_s[hop], nxt.arrive, item)
                return
            if item.kind != "replay" and item.last_hop == len(s.route) - 1:
                self._ring(node, item, t_sent)
            self.loop.push(t_sent + node.gateway_latency_s[s.gateway], self._pass_done, item)
            return
        t_at_gateway = t_sent + node.gateway_latency_s[s.gateway]
        if item.hop < item.last_hop:
            item.hop += 1
            nxt = s.route[item.hop]
            n_bytes = item.n_tokens * self.models[s.model_index].n_embd * 2
            t = t_at_gateway + n_bytes * 8.0 / self._bps + nxt.gateway_latency_s[s.gateway]
            self.loop.schedule_at(t, nxt.arrive, item)
        else:
            self.loop.schedule_at(t_at_gateway, self._pass_done, item)

    def _one_way_s(self, a: SimNode, b: SimNode) -> float:
        if a is b:
            return 0.0
        assert self._geo is not None
        return self._geo.one_way_ms(a.endpoint, b.endpoint) / 1000.0

    def _ring(self, last: SimNode, item: WorkItem, t_sent: float) -> None:
        """Push: the last stage sampled a token; unless it was the last one, it sends the next
        decode step to the first stage itself."""
        s = item.session
        if item.kind == "prefill":
            s.ring_prefill += item.n_tokens
            if s.ring_prefill < s.prompt_tokens:
                return
            s.ring_tokens = 1
        else:
            s.ring_tokens += 1
        if s.ring_tokens >= s.output_tokens:
            return
        route = s.route
        step = WorkItem(s, 0, len(route) - 1, 1, float(s.prompt_tokens + s.ring_tokens), True, "decode")
        self.loop.push(t_sent + s.hop_s[-1], route[0].arrive, step)

    def _pass_done(self, item: WorkItem) -> None:
        if item.stale:
            return
        s = item.session
        now = self.loop.now
        if item.kind == "decode":
            s.tokens_out += 1
            metrics = self.metrics
            metrics.tokens_delivered += 1  # metrics.token()
            metrics.inter_token_s.append(now - s.last_token_s)
            s.last_token_s = now
            if s.tokens_out >= s.output_tokens:
                self._complete(s)
            elif not self._push:  # with push the last stage already sent the next step
                self._send_decode(s)
        elif item.kind == "prefill":
            s.prefill_tokens_done += item.n_tokens
            if s.prefill_tokens_done >= s.prompt_tokens:
                s.tokens_out = 1  # the last stage samples the first token at the end of prefill
                self.metrics.token()
                s.last_token_s = now
                self.metrics.ttft_s.append(now - s.arrival_s)
                if s.tokens_out >= s.output_tokens:
                    self._complete(s)
                else:
                    s.phase = DECODE
                    if not self._push:
                        self._send_decode(s)
        else:  # replay
            s.replay_chunks_left -= 1
            if s.replay_chunks_left == 0:
                self._resume(s)

    # -- endings --------------------------------------------------------------
    def _release(self, s: Session, nodes: list[SimNode]) -> None:
        for n in nodes:
            if n.sessions.pop(s.id, None) is not None:
                self._left_node(n)

    def _complete(self, s: Session) -> None:
        s.phase = DONE
        s.end_s = self.loop.now
        self.metrics.completed += 1
        self.metrics.e2e_s.append(self.loop.now - s.arrival_s)
        self._end(s)

    def _fail(self, s: Session, reason: str) -> None:
        s.phase = FAILED
        s.end_s = self.loop.now
        self.metrics.fail(reason)
        self._end(s)

    def _end(self, s: Session) -> None:
        self.sessions.pop(s.id, None)
        route = s.route
        self._set_route(s, [])
        self._release(s, route)
        if route:
            self.drain_queues(s.model_index)

    # -- recovery ---------------------------------------------------------------
    def stage_lost(self, node: SimNode, detect_s: float) -> None:
        """``node`` stopped serving; every session routed through it must recover."""
        for s in list(node.sessions.values()):
            self._begin_recovery(s, detect_s)

    def _begin_recovery(self, s: Session, detect_s: float) -> None:
        if s.finished or s.phase == QUEUED:
            return
        if s.phase == RECOVERING:
            return  # an attempt is already scheduled; it will see every lost stage
        if s.phase != REPLAY:
            s.resume_phase = PREFILL if s.tokens_out == 0 else DECODE
        s.epoch += 1
        s.phase = RECOVERING
        if s.failure_s is None:
            s.failure_s = self.loop.now
        self.loop.schedule_in(detect_s, self._attempt, s, s.epoch)

    def _attempt(self, s: Session, epoch: int) -> None:
        if s.epoch != epoch or s.finished:
            return
        now = self.loop.now
        self.metrics.recovery_attempts += 1
        lost = [i for i, n in enumerate(s.route) if n.state == GONE]
        if not lost:
            self._resume(s)
            return
        exclude = frozenset(s.route[i].node_id for i in lost)
        views = [self.cache.view(n.node_id) for n in s.route]
        planned = self.routing.replace(
            self.cache.routable(), self.fingerprints[s.model_index], views, lost, s.gateway, self.rng, exclude
        )
        new_route = self._resolve(planned) if planned is not None else None
        old = set(id(n) for n in s.route)
        if new_route is not None and any(not n.accepting for n in new_route if id(n) not in old):
            new_route = None  # a replacement stage has no room (or is no longer serving)
        if new_route is None:
            assert s.failure_s is not None
            if now + self.cfg.recovery_retry_s - s.failure_s > self.cfg.recovery_timeout_s:
                self._fail(s, "recovery_failed")
            else:
                self.loop.schedule_in(self.cfg.recovery_retry_s, self._attempt, s, epoch)
            return
        keep = set(id(n) for n in new_route)
        self._release(s, [n for n in s.route if id(n) not in keep])
        for n in new_route:
            n.sessions[s.id] = s
        changed = [i for i, n in enumerate(new_route) if id(n) not in old]
        self._set_route(s, new_route)
        context = s.committed_context
        if not changed or context == 0:
            self._resume(s)
            return
        i0, i1 = changed[0], changed[-1]
        chunk = self.cfg.prefill_chunk_tokens
        s.phase = REPLAY
        s.replay_chunks_left = 0
        pos = 0
        while pos < context:
            size = min(chunk, context - pos)
            s.replay_chunks_left += 1
            self._send(
                s, WorkItem(s, i0, i1, size, size * (pos + size / 2.0), False, "replay"), hidden=i0 > 0
            )
            pos += size
        self.metrics.replayed_tokens += context * (i1 - i0 + 1)

    def _resume(self, s: Session) -> None:
        assert s.failure_s is not None
        lost = self.loop.now - s.failure_s
        s.failure_s = None
        s.recoveries += 1
        s.recovery_lost_s += lost
        self.metrics.recovered(lost)
        s.phase = s.resume_phase
        s.ring_prefill, s.ring_tokens = s.prefill_tokens_done, s.tokens_out
        if s.phase == PREFILL:
            self._send_prefill(s)
        else:
            self._send_decode(s)

    def in_flight_by_phase(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.sessions.values():
            counts[s.phase] = counts.get(s.phase, 0) + 1
        return counts

    def recovering_count(self) -> int:
        return sum(1 for s in self.sessions.values() if s.phase in (RECOVERING, REPLAY))

    def active_count(self) -> int:
        return sum(1 for s in self.sessions.values() if s.phase != QUEUED)


__all__ = ["Gateways", "SERVING"]
