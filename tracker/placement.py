"""Shard placement: which layer span a joining node should serve.

Pure function over a :class:`~tracker.snapshot.SwarmSnapshot`; no I/O, no clock,
ties broken with the injected ``random.Random``.

Coverage
    The throughput of a shard is ``1000 / decode_ms_per_token`` tokens per second
    through its whole span; a layer's coverage is the sum over the shards that
    hold it. Load is ignored on purpose: placement is a long-lived decision and
    load moves by the second.

Choice
    Candidate spans are at most ``capacity_layers`` long and anchored on existing
    boundaries: starting at 0 or where some shard ends, ending at ``L`` or where
    some shard starts, and spans anchored at both ends. Each candidate scores the
    sum of ``1 / (coverage + epsilon)`` over its layers, so uncovered layers
    dominate, then the weakest ones. A span whose two ends both meet existing
    boundaries (so a route can actually pass through it) keeps its full score; a
    span anchored at one end only is scaled by ``half_aligned_weight``. Exact
    ties go to the lower start, then to the rng.

Split points
    A model that can only be cut at some boundaries (``ModelInfo.split_points``,
    e.g. one served whole) gets spans that start and end there: a span is
    shortened to the last split point within capacity.

Memory
    A joining node may also say how many bytes it has for weights and KV
    (:class:`SpanMemory`); for a model whose per-layer bytes are known
    (``ModelInfo.layer_bytes``, from the registered manifest) only spans whose
    weights, KV and first/last-stage extras (token embeddings, LM head) fit
    are candidates.

Invariants
    ``0 <= start < end <= L``, both ends at split points, ``end - start <=
    capacity_layers``, and the span fits the node's memory when both are known;
    when no span does, :class:`tracker.errors.NoFittingSpan` (the node then
    asks again with less, or cannot serve this model). With no shards for the
    model and no split points the answer is ``(0, min(capacity_layers, L))``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from tracker.errors import NoFittingSpan, UnknownModel
from tracker.snapshot import ModelInfo, SwarmSnapshot


@dataclass(frozen=True)
class PlacementWeights:
    epsilon_tokens_per_s: float = 1e-3  # keeps uncovered layers finite but dominant
    half_aligned_weight: float = 0.6  # a span meeting the existing boundaries at one end only
    min_decode_ms_per_token: float = 0.001


DEFAULT_WEIGHTS = PlacementWeights()


@dataclass(frozen=True)
class SpanMemory:
    """What a joining node has for a span: bytes for weights and KV, and its KV bytes per layer."""

    memory_bytes: int
    kv_bytes_per_layer: int = 0

    def fits(self, model: ModelInfo, start: int, end: int) -> bool:
        """True when ``[start, end)`` fits (always, when the model's layer bytes are unknown)."""
        if model.layer_bytes is None or len(model.layer_bytes) != model.n_layers:
            return True
        need = sum(model.layer_bytes[start:end]) + self.kv_bytes_per_layer * (end - start)
        if start == 0:
            need += model.first_extra_bytes
        if end == model.n_layers:
            need += model.last_extra_bytes
        return need <= self.memory_bytes


_START, _END, _DECODE = attrgetter("start"), attrgetter("end"), attrgetter("decode_ms_per_token")


def _spans(
    snapshot: SwarmSnapshot, model_fingerprint: str, n_layers: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp], npt.NDArray[np.float64]]:
    """Start, end and single-token time of the model's shards inside ``0..n_layers``, in snapshot
    order, as arrays; once per snapshot (``SwarmSnapshot.memo``: a joining swarm of 10 000s of
    nodes asks for every join)."""
    key = ("placement.spans", model_fingerprint, n_layers)
    found = snapshot.memo.get(key)
    if found is not None:
        return found  # type: ignore[return-value]
    mine = [s for s in snapshot.shards if s.model_fingerprint == model_fingerprint]
    n = len(mine)
    start = np.fromiter(map(_START, mine), dtype=np.intp, count=n)
    end = np.fromiter(map(_END, mine), dtype=np.intp, count=n)
    decode = np.fromiter(map(_DECODE, mine), dtype=float, count=n)
    return provide_spans(snapshot, model_fingerprint, n_layers, start, end, decode)


def provide_spans(
    snapshot: SwarmSnapshot,
    model_fingerprint: str,
    n_layers: int,
    start: npt.ArrayLike,
    end: npt.ArrayLike,
    decode_ms_per_token: npt.ArrayLike,
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp], npt.NDArray[np.float64]]:
    """Hand placement the start, end and single-token time of the model's shards in ``snapshot``,
    in snapshot order, as arrays -- for a caller that keeps them anyway (the simulator's snapshot
    cache: otherwise every join of a 10 000-node swarm, each on a new snapshot, reads every
    shard again). They must be what the snapshot's shards say; shards outside ``0..n_layers``
    are left out as when placement reads them itself. Returns what placement will use."""
    a = np.asarray(start, dtype=np.intp)
    b = np.asarray(end, dtype=np.intp)
    d = np.asarray(decode_ms_per_token, dtype=float)
    if not a.ndim == b.ndim == d.ndim == 1 or not a.size == b.size == d.size:
        raise ValueError("provide_spans needs three one-dimensional arrays of one length")
    ok = (a >= 0) & (a < b) & (b <= n_layers)
    spans = (a[ok], b[ok], d[ok])
    snapshot.memo[("placement.spans", model_fingerprint, n_layers)] = spans
    return spans


def layer_coverage(
    snapshot: SwarmSnapshot,
    model_fingerprint: str,
    n_layers: int,
    weights: PlacementWeights = DEFAULT_WEIGHTS,
) -> list[float]:
    """Tokens per second available at each layer ``0..n_layers-1``."""
    start, end, decode = _spans(snapshot, model_fingerprint, n_layers)
    tps = 1000.0 / np.maximum(decode, weights.min_decode_ms_per_token)
    # Each shard adds at its start and takes away at its end, in snapshot order (np.add.at is
    # unbuffered and in order: the same sums, to the last bit, as one shard after another).
    where = np.empty(2 * start.size, dtype=np.intp)
    where[0::2], where[1::2] = start, end
    amount = np.empty(2 * start.size)
    amount[0::2], amount[1::2] = tps, -tps
    summed = np.zeros(n_layers + 1)
    np.add.at(summed, where, amount)
    diff: list[float] = summed.tolist()
    # exact, so float residue never hides an uncovered layer
    count: list[int] = (
        np.bincount(start, minlength=n_layers + 1) - np.bincount(end, minlength=n_layers + 1)
    ).tolist()
    cover: list[float] = []
    run, holders = 0.0, 0
    for i in range(n_layers):
        run += diff[i]
        holders += count[i]
        cover.append(max(run, 0.0) if holders else 0.0)
    return cover


def recommend_span(
    snapshot: SwarmSnapshot,
    model_fingerprint: str,
    capacity_layers: int,
    *,
    rng: random.Random,
    weights: PlacementWeights = DEFAULT_WEIGHTS,
    memory: SpanMemory | None = None,
) -> tuple[int, int]:
    """The half-open span ``(start, end)`` a node holding ``capacity_layers`` layers should serve.

    Raises :class:`tracker.errors.UnknownModel` for a model not in the snapshot,
    :class:`tracker.errors.NoFittingSpan` when no span fits, and ``ValueError``
    for ``capacity_layers < 1``.
    """
    if capacity_layers < 1:
        raise ValueError(f"capacity_layers must be >= 1, got {capacity_layers}")
    model = snapshot.model(model_fingerprint)
    if model is None:
        raise UnknownModel(f"unknown model fingerprint {model_fingerprint!r}")
    n = model.n_layers
    if n < 1:
        raise ValueError(f"model {model_fingerprint!r} has no layers")
    cap = min(capacity_layers, n)
    points = None if model.split_points is None else sorted({0, n, *model.split_points})

    def fits(a: int, b: int) -> bool:
        return memory is None or memory.fits(model, a, b)

    def end_from(a: int) -> int:
        """The farthest allowed end from ``a`` within capacity that fits (``a`` itself if none)."""
        ends = (
            range(min(a + cap, n), a, -1)
            if points is None
            else sorted((p for p in points if a < p <= a + cap), reverse=True)
        )
        return next((b for b in ends if fits(a, b)), a)

    def start_to(b: int) -> int:
        """The earliest allowed start before ``b`` within capacity that fits (``b`` itself if none)."""
        starts = (
            range(max(b - cap, 0), b) if points is None else sorted(p for p in points if b - cap <= p < b)
        )
        return next((a for a in starts if fits(a, b)), b)

    cover = layer_coverage(snapshot, model_fingerprint, n, weights)
    prefix = [0.0]
    for c in cover:
        prefix.append(prefix[-1] + 1.0 / (c + weights.epsilon_tokens_per_s))

    # Boundaries a route can continue from (a span may start there) and lead into (a span may end there).
    starts, ends, _ = _spans(snapshot, model_fingerprint, n)
    open_starts = {0, *np.unique(ends).tolist()}
    open_ends = {n, *np.unique(starts).tolist()}
    open_starts.discard(n)
    open_ends.discard(0)

    candidates: set[tuple[int, int]] = set()
    for a in open_starts:
        candidates.add((a, end_from(a)))
        for b in open_ends:
            if a < b <= a + cap:
                candidates.add((a, b))
    for b in open_ends:
        candidates.add((start_to(b), b))
    candidates = {(a, b) for a, b in candidates if a < b and model.allows(a, b) and fits(a, b)}
    if not candidates:
        # Nothing anchored fits (a node that holds fewer layers than a first or last stage needs,
        # split points farther apart than its capacity): any span that fits, the longest first.
        allowed = range(n + 1) if points is None else points
        spans = [(a, b) for a in allowed for b in allowed if 0 < b - a <= cap and fits(a, b)]
        if not spans:
            raise NoFittingSpan(
                f"no span of model {model_fingerprint[:16]} fits: at most {capacity_layers} layers"
                + (f" and {memory.memory_bytes} bytes" if memory is not None else "")
                + ("" if points is None else f", cut only at {', '.join(map(str, points))}")
            )
        candidates = {max(spans, key=lambda s: (s[1] - s[0], -s[0]))}

    best: tuple[float, int, float] | None = None
    choice = min(candidates)
    for a, b in sorted(candidates):
        aligned = (a in open_starts) + (b in open_ends)
        score = prefix[b] - prefix[a]
        if aligned < 2:
            score *= weights.half_aligned_weight
        key = (score, -a, rng.random())
        if best is None or key > best:
            best, choice = key, (a, b)
    return choice


__all__ = [
    "PlacementWeights",
    "DEFAULT_WEIGHTS",
    "SpanMemory",
    "layer_coverage",
    "provide_spans",
    "recommend_span",
]
