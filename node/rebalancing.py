"""Live rebalancing: a node that asks the tracker whether to move, then drains, fetches and rejoins.

With ``rebalance_interval_s > 0`` (``swarm-node start --rebalance-interval-s``), :func:`run_node`
runs the node through :func:`run_moving_node`: every interval the node asks the tracker
(``POST /v1/rebalance``, signed; the answer is signed by the tracker's key and names the node
and the question's nonce, anything else is ignored). The tracker judges with
:func:`tracker.rebalance.advise` over its live registry and the models' recent demand; the
node adds its own hysteresis (:mod:`node.move_policy`: a cool-down after it starts or moves,
the same advice several times in a row; ``pin_span`` turns moves off). A move, in order:

1. **drain**: the node refuses new sessions (a gateway that tries gets ``UNAVAILABLE`` and
   takes another route) and leaves the tracker (signed leave: no new routes name it); its
   sessions get ``rebalance_drain_s`` to finish;
2. **hand back**: what is still open is freed with an unsolicited ``session_closed`` notice,
   on which the gateway replaces this stage and replays the session's history there
   (docs/gateway.md, recovery) -- no request is lost, it is only slower;
3. **fetch**: the node starts again through the joining machinery (:mod:`node.joining`) with
   the advised model and ``START:END``: its own model file when it has one, else the model's
   name or fingerprint in the tracker's registry, whose sources and peers serve only the
   span's tensors (:mod:`node.fetch`);
4. **rejoin**: load, benchmark, announce (same key, same gRPC and admin ports). A new span
   that cannot be fetched or loaded sends the node back to the span it left (logged as
   ``rebalance_move_failed``; that path has no test yet).

One incarnation of :class:`~node.daemon.NodeDaemon` serves one span; the loop here starts the
next. Readiness (``task_status``) is reported once, for the first span.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import httpx
import trio

from common.logs import event
from node.move_policy import MovePolicy, MoveState, Target, on_advice
from proto.announce import PayloadError
from proto.rebalance import ADVICE_KIND, MoveAdvice, RebalanceAdvice, RebalanceRequest
from proto.signing import NonceCache, SignatureError, open_envelope

if TYPE_CHECKING:
    from node.config import NodeConfig
    from node.daemon import NodeDaemon, NodeReady

log = logging.getLogger("swarm.node.rebalance")
ADVICE_SKEW_S = 120.0  # how far the tracker's clock may be from ours on a signed advice
ASK_TIMEOUT_S = 15.0
DRAIN_POLL_S = 0.25


def capacity_share(daemon: NodeDaemon) -> float:
    """The share of a model's layers this node can hold: its layer capacity (measured at join, or
    the configured one, or its span) over its model's layer count."""
    n_layers = max(1, daemon.meta.n_layers)
    span = daemon.spec.shard_end - daemon.spec.shard_start
    cap = daemon.joined.capacity_layers or daemon.config.capacity_layers or span
    return min(1.0, max(1, cap) / n_layers)


def read_advice(
    envelope: Any, *, tracker_id: str, node_id: str, nonce: str, nonces: NonceCache
) -> RebalanceAdvice:
    """The tracker's signed advice, checked: its key, this node, this question (raises ValueError)."""
    try:
        payload = open_envelope(
            envelope, kind=ADVICE_KIND, now_s=time.time(), skew_s=ADVICE_SKEW_S, nonces=nonces,
            signer_field="tracker_id",
        )  # fmt: skip
        advice = RebalanceAdvice.from_json(payload)
    except (SignatureError, PayloadError) as err:
        raise ValueError(f"unusable rebalancing advice: {err}") from err
    if payload.get("tracker_id") != tracker_id:
        raise ValueError("rebalancing advice signed by another key than the tracker's")
    if advice.node_id != node_id or advice.request_nonce != nonce:
        raise ValueError("rebalancing advice for another node or another question")
    return advice


class _Mover:
    """Asks, decides, drains; one per incarnation of the daemon."""

    def __init__(self, daemon: NodeDaemon, state: MoveState, policy: MovePolicy) -> None:
        self.daemon = daemon
        self.state = state
        self.policy = policy
        self.nonces = NonceCache(4096)
        self.move: MoveAdvice | None = None

    async def ask(self, client: Any) -> MoveAdvice | None:
        from common.tracker_client import TrackerClientError

        d = self.daemon
        tracker_id = d.verifier.tracker_public_key
        if tracker_id is None:
            return None  # the tracker's key is not known yet (no announce answered): ask later
        request = RebalanceRequest(
            d.node_id, capacity_share(d), d.config.rebalance_model_list(), d.config.pin_span
        )
        try:
            with trio.fail_after(ASK_TIMEOUT_S):
                answer, nonce = await client.rebalance(request)
            advice = read_advice(
                answer.get("advice"),
                tracker_id=tracker_id,
                node_id=d.node_id,
                nonce=nonce,
                nonces=self.nonces,
            )
        except (TrackerClientError, httpx.HTTPError, trio.TooSlowError, ValueError, AttributeError) as err:
            d.metrics.inc("swarm_node_tracker_calls_total", kind="rebalance", outcome="failed")
            event(log, "rebalance_ask_failed", level=logging.WARNING, error=repr(err)[:300])
            return None
        d.metrics.inc("swarm_node_tracker_calls_total", kind="rebalance", outcome="ok")
        target: Target | None = None
        if advice.move is not None:
            m = advice.move
            target = (m.model_fingerprint, m.start, m.end)
        self.state, go = on_advice(self.policy, self.state, target, time.monotonic())
        event(
            log,
            "rebalance_advice",
            advice="stay" if advice.move is None else "move",
            why=advice.why or None,
            to=list(target) if target else None,
            reason=advice.move.reason if advice.move else None,
            gain=None if advice.move is None or math.isinf(advice.move.gain) else round(advice.move.gain, 3),
            confirmations=self.state.seen,
            moving=go,
        )
        return advice.move if go else None

    async def run(self, stop: trio.Event) -> None:
        """Ask every interval until a move is decided; then drain and set ``stop``."""
        from common.tracker_client import TrackerClient

        d = self.daemon
        cfg = d.config
        async with TrackerClient(d.tracker_url, d.key, tls=cfg.tracker_tls()) as client:
            while self.move is None:
                await trio.sleep(cfg.rebalance_interval_s)
                self.move = await self.ask(client)
        await self.drain()
        stop.set()

    async def drain(self) -> None:
        d = self.daemon
        assert self.move is not None
        before = d.machine.statistics()
        event(
            log,
            "rebalance_draining",
            to=[self.move.model_fingerprint, self.move.start, self.move.end],
            sessions=before.sessions,
            drain_s=d.config.rebalance_drain_s,
        )
        d.machine.draining = True  # new OPENs: UNAVAILABLE, the gateway takes another route
        d.draining = True
        await d.leave_tracker()  # no route handed out from now on names this node
        t0 = time.monotonic()
        with trio.move_on_after(d.config.rebalance_drain_s):
            # The session count is a plain figure of the frame server, with no event to wait on.
            while d.machine.statistics().sessions > 0:  # noqa: ASYNC110
                await trio.sleep(DRAIN_POLL_S)
        left = d.machine.statistics().sessions
        event(
            log,
            "rebalance_drained",
            waited_s=round(time.monotonic() - t0, 2),
            sessions_handed_back=left,  # freed with a notice: their gateways replay them elsewhere
        )


def _next_config(cfg: NodeConfig, ready: NodeReady, move: MoveAdvice, specs: dict[str, str]) -> NodeConfig:
    """The settings of the next incarnation: the advised model and span, the same ports."""
    spec = specs.get(move.model_fingerprint) or move.model_name or move.model_fingerprint
    return dataclasses.replace(
        cfg,
        model=spec,
        layers=f"{move.start}:{move.end}",
        port=ready.grpc_port,
        admin_port=ready.admin_port if ready.admin_port is not None else cfg.admin_port,
    )


async def _serve_once(
    cfg: NodeConfig,
    shutdown: trio.Event,
    policy: MovePolicy,
    *,
    task_status: trio.TaskStatus[NodeReady] = trio.TASK_STATUS_IGNORED,
) -> tuple[NodeReady | None, MoveAdvice | None]:
    """One incarnation: serve ``cfg``'s span until ``shutdown`` or a decided move (then drained).
    A shutdown while the span is still being fetched or loaded ends it at once (None, None)."""
    from node.daemon import NodeDaemon

    daemon = NodeDaemon(cfg)
    stop = trio.Event()
    mover: _Mover | None = None
    ready: NodeReady | None = None
    async with trio.open_nursery() as nursery:

        async def serve(*, task_status: trio.TaskStatus[NodeReady]) -> None:
            await daemon.run(stop, task_status=task_status)
            nursery.cancel_scope.cancel()  # the asker and the watcher end with this incarnation

        async def watch_shutdown() -> None:
            await shutdown.wait()
            stop.set()  # a serving daemon stops (leave, drain); one still joining is cancelled
            if ready is None:
                nursery.cancel_scope.cancel()

        nursery.start_soon(watch_shutdown)
        ready = await nursery.start(serve)
        task_status.started(ready)
        if daemon.tracker_url:
            mover = _Mover(daemon, MoveState(time.monotonic()), policy)
            nursery.start_soon(mover.run, stop)
    return ready, (mover.move if mover is not None and not shutdown.is_set() else None)


async def run_moving_node(
    config: NodeConfig,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[NodeReady] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve, ask, move, serve again -- until ``shutdown``. Readiness is reported for the first span."""
    cfg = config
    policy = MovePolicy(cfg.rebalance_cooldown_s, cfg.rebalance_confirmations, cfg.pin_span)
    specs: dict[str, str] = {}  # model fingerprint -> how to join it again (its own file first)
    moves = 0
    status = task_status
    previous: NodeConfig | None = None  # the span served before the last move, to go back to
    while True:
        try:
            ready, move = await _serve_once(cfg, shutdown, policy, task_status=status)
        except Exception as err:  # a new span that cannot be fetched or loaded: back to the old one
            if previous is None:
                raise
            event(
                log,
                "rebalance_move_failed",
                level=logging.ERROR,
                model=cfg.model,
                layers=cfg.layers,
                error=repr(err)[:500],
                back_to=[previous.model, previous.layers],
            )
            cfg, previous = previous, None
            continue
        status = trio.TASK_STATUS_IGNORED  # readiness is reported once
        if ready is None or move is None:
            return
        specs.setdefault(ready.model_fingerprint, cfg.model)
        moves += 1
        previous = dataclasses.replace(
            cfg,
            layers=f"{ready.shard_start}:{ready.shard_end}",
            port=ready.grpc_port,
            admin_port=ready.admin_port if ready.admin_port is not None else cfg.admin_port,
        )
        cfg = _next_config(cfg, ready, move, specs)
        event(log, "rebalance_moving", model=cfg.model, layers=cfg.layers, moves=moves)
