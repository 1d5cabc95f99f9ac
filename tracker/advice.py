"""``POST /v1/rebalance``: a node asks whether another span would serve the swarm better.

The shell around :func:`tracker.rebalance.advise`: it opens the node's signed question
(:class:`proto.rebalance.RebalanceRequest`), judges it over the live registry's snapshot
with the moves already advised and not yet done applied (:func:`tracker.rebalance.apply_moves`,
so two nodes asking one after the other do not both rush into the same gap), the models'
recent demand (:class:`tracker.demand.DemandMeter`, fed by route look-ups) and the tracker's
``rebalance_*`` settings, and answers with a ``rebalance_advice`` envelope signed by the
tracker's key that names the node and the question's nonce. docs/tracker.md, Rebalancing.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING, Any

from common.logs import event
from proto.announce import PayloadError
from proto.rebalance import ADVICE_KIND, REQUEST_KIND, MoveAdvice, RebalanceAdvice, RebalanceRequest
from proto.signing import make_payload, sign_envelope
from tracker.demand import DemandMeter
from tracker.errors import BadRequest, UnknownModel, UnknownNode
from tracker.rebalance import Move, PendingMoves, RebalanceParams, advise, apply_moves
from tracker.snapshot import SwarmSnapshot

if TYPE_CHECKING:
    from tracker.service import Registry

log = logging.getLogger("swarm.tracker.rebalance")


class RebalanceService:
    def __init__(self, registry: Registry) -> None:
        cfg = registry.config
        self.registry = registry
        self.demand = DemandMeter(half_life_s=cfg.demand_half_life_s)
        self.pending = PendingMoves(keep_s=cfg.rebalance_pending_s)
        self.params = RebalanceParams(min_gain=cfg.rebalance_min_gain, min_holders=cfg.rebalance_min_holders)

    def looked_up(self, model_fingerprint: str, now_s: float) -> None:
        """A route look-up for the model, or a request a gateway reported served: one unit of its
        demand each (a gateway reuses pooled routes, so look-ups alone under-count a busy model;
        a request no route can serve is reported by nobody, so usage alone misses it)."""
        self.demand.record(model_fingerprint, now_s)

    def _capacities(self, snap: SwarmSnapshot, own_fp: str, req: RebalanceRequest) -> dict[str, int]:
        """Model fingerprint -> layers the node can hold of it (its share of each model's layers)."""
        reg = self.registry
        out: dict[str, int] = {}
        fps = [own_fp]
        for spec in req.models:
            try:
                fps.append(reg.resolve_model(snap, spec).fingerprint)
            except UnknownModel:
                continue  # a model the swarm does not know (yet): nothing to move to
        for fp in fps:
            info = snap.model(fp)
            if info is not None and info.n_layers >= 1 and fp not in out:
                out[fp] = max(1, min(info.n_layers, math.floor(req.capacity_share * info.n_layers + 1e-9)))
        return out

    async def answer(self, envelope: Any) -> dict[str, Any]:
        reg = self.registry
        payload, _nonce = reg.gate.open_envelope(envelope, REQUEST_KIND)
        try:
            req = RebalanceRequest.from_json(payload)
        except PayloadError as err:
            raise BadRequest(str(err)) from err
        snap = await reg.snapshot()
        mine = [s for s in snap.shards if s.node_id == req.node_id]
        if not mine:
            raise UnknownNode(f"node {req.node_id} is not serving (not announced, challenged or gone)")
        now = reg.clock()
        capacities = self._capacities(snap, mine[0].model_fingerprint, req)
        demand = self.demand.rates(now)
        view = apply_moves(snap, self.pending.active(now, besides=req.node_id))
        decide = functools.partial(
            advise, view, req.node_id, capacities, demand, rng=reg.rng, pinned=req.pinned, params=self.params,
            present=snap,
        )  # fmt: skip
        move: Move | None = await reg.on_route_cpu(decide)
        here = mine[0].model_fingerprint
        why = ""
        if req.pinned:
            why = "pinned"
        elif move is None:
            why = "no span gains enough, or leaving would leave a layer with too few holders"
        elif self.pending.reverses(here, move.model_fingerprint, now):
            move, why = None, "another node is moving the other way"
        advice_move = None
        if move is not None:
            self.pending.record(req.node_id, move, now, origin=here)
            names = {fp: name for name, fp in snap.registered_names.items()}
            info = snap.model(move.model_fingerprint)
            advice_move = MoveAdvice(
                move.model_fingerprint,
                move.start,
                move.end,
                move.reason,
                move.gain,
                names.get(move.model_fingerprint, info.name if info is not None else ""),
            )
        advice = RebalanceAdvice(req.node_id, str(payload["nonce"]), advice_move, why)
        label = "stay" if move is None else f"move_{move.reason}"
        reg.metrics.inc("swarm_tracker_rebalance_advice_total", advice=label)
        event(
            log,
            "rebalance_advice",
            node_id=req.node_id,
            advice=label,
            model=mine[0].model_fingerprint,
            span=[mine[0].start, mine[0].end],
            to=None if move is None else [move.model_fingerprint, move.start, move.end],
            gain=None if move is None or math.isinf(move.gain) else round(move.gain, 3),
            demand={fp[:12]: round(r, 4) for fp, r in sorted(demand.items())},
        )
        signed = sign_envelope(
            reg.key, make_payload(ADVICE_KIND, "tracker_id", reg.key, now, advice.to_json())
        )
        return {"advice": signed}


__all__ = ["RebalanceService"]
