"""Rebalancing messages: a node asks the tracker whether to move (signed by the node), and the
tracker's advice (signed by the tracker, bound to the question by its nonce).

Pure (no I/O). The request travels as a ``rebalance_request`` envelope signed by the node's
key (``node_id`` = signer); the answer carries a ``rebalance_advice`` envelope signed by the
tracker's key (``tracker_id`` = signer) that repeats the node's id and the request's nonce,
so an advice meant for another node, or for an older question, is refused by the node.
docs/tracker.md, ``POST /v1/rebalance``, describes both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proto.announce import (
    ENVELOPE_FIELDS,
    MAX_LAYERS,
    MAX_NAME,
    PayloadError,
    _bool,
    _check_keys,
    _hex64,
    _int,
    _num,
    _obj,
    _str,
    _str_list,
)

REQUEST_KIND = "rebalance_request"
ADVICE_KIND = "rebalance_advice"
MAX_MODELS = 16  # models besides its own a node may offer to serve
REASONS = ("throughput", "single_point_of_failure")


@dataclass(frozen=True)
class RebalanceRequest:
    """Should this node serve another span?

    ``models``: names or fingerprints of the models, besides the one it serves, it is willing
    to move to (empty: only other spans of its own model). ``capacity_share``: the share of a
    model's layers it can hold, in (0, 1] (its layer capacity over its model's layer count;
    the tracker applies the same share to the other models). ``pinned``: the operator fixed
    its span -- the answer is always "stay" (asked anyway, so the tracker's view is complete).
    """

    node_id: str
    capacity_share: float
    models: tuple[str, ...] = ()
    pinned: bool = False

    @classmethod
    def from_json(cls, obj: Any) -> RebalanceRequest:
        w = "rebalance_request"
        o = _obj(obj, w)
        _check_keys(o, frozenset({"node_id", "capacity_share", "models", "pinned"}) | ENVELOPE_FIELDS, w)
        return cls(
            _hex64(o, "node_id", w),
            _num(o, "capacity_share", 0.0, 1.0, w, open_lo=True),
            _str_list(o, "models", w, max_items=MAX_MODELS) if "models" in o else (),
            _bool(o, "pinned", w) if "pinned" in o else False,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "capacity_share": self.capacity_share,
            "models": list(self.models),
            "pinned": self.pinned,
        }


@dataclass(frozen=True)
class MoveAdvice:
    """Serve ``[start, end)`` of ``model_fingerprint`` instead (``model_name``: how the tracker's
    registry names it, "" when unregistered)."""

    model_fingerprint: str
    start: int
    end: int
    reason: str
    gain: float
    model_name: str = ""

    @classmethod
    def from_json(cls, obj: Any) -> MoveAdvice:
        w = "rebalance_advice.move"
        o = _obj(obj, w)
        _check_keys(o, frozenset({"model_fingerprint", "model_name", "start", "end", "reason", "gain"}), w)
        start = _int(o, "start", 0, MAX_LAYERS - 1, w)
        end = _int(o, "end", start + 1, MAX_LAYERS, w)
        reason = _str(o, "reason", w)
        if reason not in REASONS:
            raise PayloadError(f"{w}.reason must be one of {REASONS}")
        gain = o.get("gain")
        if gain is None:  # an infinite gain (a model nobody serves) travels as null
            gain_value = float("inf")
        else:
            gain_value = _num(o, "gain", -1.0, 1e12, w)
        name = _str(o, "model_name", w, max_len=MAX_NAME, min_len=0) if "model_name" in o else ""
        return cls(_hex64(o, "model_fingerprint", w), start, end, reason, gain_value, name)

    def to_json(self) -> dict[str, Any]:
        return {
            "model_fingerprint": self.model_fingerprint,
            "model_name": self.model_name,
            "start": self.start,
            "end": self.end,
            "reason": self.reason,
            "gain": None if self.gain == float("inf") else round(self.gain, 6),
        }


@dataclass(frozen=True)
class RebalanceAdvice:
    """The tracker's answer: ``move`` None = stay (``why`` says why, for the node's log)."""

    node_id: str
    request_nonce: str
    move: MoveAdvice | None
    why: str = ""

    @classmethod
    def from_json(cls, obj: Any) -> RebalanceAdvice:
        w = "rebalance_advice"
        o = _obj(obj, w)
        allowed = frozenset({"node_id", "request_nonce", "move", "why", "tracker_id"}) | ENVELOPE_FIELDS
        _check_keys(o, allowed, w)
        raw = o.get("move")
        return cls(
            _hex64(o, "node_id", w),
            _str(o, "request_nonce", w, max_len=64),
            None if raw is None else MoveAdvice.from_json(raw),
            _str(o, "why", w, max_len=MAX_NAME, min_len=0) if "why" in o else "",
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "request_nonce": self.request_nonce,
            "move": None if self.move is None else self.move.to_json(),
            "why": self.why,
        }


__all__ = [
    "ADVICE_KIND",
    "REQUEST_KIND",
    "MoveAdvice",
    "RebalanceAdvice",
    "RebalanceRequest",
]
