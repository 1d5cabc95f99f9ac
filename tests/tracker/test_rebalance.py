"""Rebalancing decisions: worked examples and properties over random swarms."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from swarm_strategies import FP, OTHER_FP, shard, snapshot, swarms

from tracker.rebalance import Move, RebalanceParams, advise, single_holders, throughput


def test_throughput_is_the_weakest_layer_and_zero_with_a_gap() -> None:
    snap = snapshot(10, [shard("a", 0, 5, ms=10.0), shard("b", 5, 10, ms=20.0), shard("c", 5, 10, ms=20.0)])
    assert throughput(snap, FP) == 100.0  # layers 5..9: 50 + 50; layers 0..4: 100
    assert throughput(snapshot(10, [shard("a", 0, 5)]), FP) == 0.0
    assert single_holders(snap, FP) == [0, 1, 2, 3, 4]


def test_a_node_that_alone_holds_a_layer_stays() -> None:
    snap = snapshot(10, [shard("a", 0, 5), shard("b", 5, 10), shard("c", 5, 10)])
    assert advise(snap, "a", {FP: 5}, {FP: 1.0}, rng=random.Random(0)) is None
    assert advise(snap, "b", {FP: 5}, {FP: 1.0}, rng=random.Random(0)) is None  # would leave one holder


def test_a_redundant_node_moves_to_the_weakest_layers() -> None:
    # Layers 5..9 are served at 10 tokens/s by one slow node; three fast nodes crowd 0..4.
    snap = snapshot(
        10,
        [
            shard("a", 0, 5, ms=10.0),
            shard("b", 0, 5, ms=10.0),
            shard("c", 0, 5, ms=10.0),
            shard("d", 5, 10, ms=100.0),
        ],
    )
    move = advise(snap, "c", {FP: 5}, {FP: 1.0}, rng=random.Random(0))
    assert move == Move(FP, 5, 10, "throughput", move.gain if move else 0.0)
    assert move is not None and move.gain >= 0.25


def test_pinned_nodes_and_small_gains_stay() -> None:
    slow = [shard("d", 5, 10, ms=100.0), shard("e", 5, 10, ms=100.0)]  # two holders: no single point
    snap = snapshot(
        10, [shard("a", 0, 5, ms=10.0), shard("b", 0, 5, ms=10.0), shard("c", 0, 5, ms=10.0), *slow]
    )
    assert advise(snap, "c", {FP: 5}, {FP: 1.0}, rng=random.Random(0)) is not None
    assert advise(snap, "c", {FP: 5}, {FP: 1.0}, rng=random.Random(0), pinned=True) is None
    # With a hysteresis larger than what the move gains (120 against 20 tokens/s), c stays.
    strict = RebalanceParams(min_gain=100.0)
    assert advise(snap, "c", {FP: 5}, {FP: 1.0}, rng=random.Random(0), params=strict) is None


def test_demand_moves_a_node_to_the_model_that_needs_it() -> None:
    # Three whole copies of FP, nobody on OTHER; the demand is all on OTHER.
    snap = snapshot(10, [shard(n, 0, 10, ms=10.0) for n in ("a", "b", "c")])
    move = advise(snap, "b", {FP: 10, OTHER_FP: 10}, {OTHER_FP: 5.0}, rng=random.Random(0))
    assert move is not None and move.model_fingerprint == OTHER_FP and (move.start, move.end) == (0, 10)
    # With the demand on FP, an OTHER nobody serves still gets one node (its demand floor: a model
    # with a layer nobody holds) ...
    floor = advise(snap, "b", {FP: 10, OTHER_FP: 10}, {FP: 5.0}, rng=random.Random(0))
    assert floor is not None and floor.model_fingerprint == OTHER_FP
    # ... but once it has a copy, b stays; and with two copies left, nobody leaves (min_holders).
    served = snapshot(10, [*snap.shards, shard("o", 0, 10, ms=10.0, fp=OTHER_FP)])
    assert advise(served, "b", {FP: 10, OTHER_FP: 10}, {FP: 5.0}, rng=random.Random(0)) is None
    two = snapshot(10, [shard(n, 0, 10, ms=10.0) for n in ("a", "b")])
    assert advise(two, "b", {FP: 10, OTHER_FP: 10}, {OTHER_FP: 5.0}, rng=random.Random(0)) is None


def test_a_served_model_without_demand_draws_no_node_from_one_with_demand() -> None:
    # The live swarm's start (sim/bench_wan_rebalance.py): five fast copies of FP, one slower copy
    # of OTHER; all demand on FP. OTHER is served, so its floor does not draw: nobody moves
    # (before, OTHER's floor -- a quarter of FP's demand -- drew two of the five to it).
    five = [shard(n, 0, 10, ms=10.0) for n in ("a", "b", "c", "d", "e")]
    snap = snapshot(10, [*five, shard("o", 0, 10, ms=20.0, fp=OTHER_FP)])
    caps = {FP: 10, OTHER_FP: 10}
    for node in "abcde":
        assert advise(snap, node, caps, {FP: 5.0}, rng=random.Random(0)) is None
        assert advise(snap, node, caps, {FP: 5.0, OTHER_FP: 0.0}, rng=random.Random(0)) is None
    # Some demand on OTHER, far below FP's: weighed as it is (100 tokens/s for 0.1 against 400
    # for 5 left on FP: OTHER is richer per unit of demand), still nobody moves.
    assert advise(snap, "a", caps, {FP: 5.0, OTHER_FP: 0.1}, rng=random.Random(0)) is None
    # Once the demand is on OTHER, a node of FP moves there.
    move = advise(snap, "a", caps, {FP: 0.5, OTHER_FP: 5.0}, rng=random.Random(0))
    assert move is not None and move.model_fingerprint == OTHER_FP and move.reason == "throughput"
    # A node of an idle model leaves it for a model with demand that nobody serves; not below
    # min_holders copies.
    idle = snapshot(10, [shard(n, 0, 10, ms=10.0, fp=OTHER_FP) for n in ("x", "y", "z")])
    move = advise(idle, "x", caps, {FP: 0.0, OTHER_FP: 0.0}, rng=random.Random(0))
    assert move is None  # nothing asked for anywhere: nobody moves
    move = advise(idle, "x", caps, {FP: 5.0}, rng=random.Random(0))  # FP asked for, nobody on it
    assert move is not None and move.model_fingerprint == FP and (move.start, move.end) == (0, 10)
    two = snapshot(10, [*idle.shards[:2], shard("a", 0, 10, ms=10.0)])
    assert advise(two, "x", caps, {FP: 5.0}, rng=random.Random(0)) is None  # two left: min_holders


def test_a_move_that_removes_a_single_point_of_failure() -> None:
    # b and c both hold 0..5 and are equally fast; 5..10 is held by d alone (at the same speed
    # as the first half in sum): moving c there costs no throughput below the hysteresis but
    # leaves no layer with one holder... except the one c leaves behind -- so no move. Add a
    # third holder of 0..5 and c's move removes the single point of failure.
    base = [shard("b", 0, 5, ms=10.0), shard("c", 0, 5, ms=10.0), shard("d", 5, 10, ms=5.0)]
    assert advise(snapshot(10, base), "c", {FP: 5}, {FP: 1.0}, rng=random.Random(0)) is None
    snap = snapshot(10, [*base, shard("e", 0, 5, ms=10.0)])
    move = advise(snap, "c", {FP: 5}, {FP: 1.0}, rng=random.Random(0), params=RebalanceParams(min_gain=10.0))
    assert move is not None and move.reason == "single_point_of_failure" and (move.start, move.end) == (5, 10)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(swarms(), st.integers(1, 12), st.integers(0, 2**32))
def test_a_move_never_cuts_a_model_and_always_gains(snap, cap: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    demand = {FP: 1.0, OTHER_FP: 0.5}
    for s in snap.shards:
        caps = {FP: cap, OTHER_FP: cap}
        move = advise(snap, s.node_id, caps, demand, rng=random.Random(seed))
        if move is None:
            continue
        assert 0 <= move.start < move.end <= snap.model(move.model_fingerprint).n_layers  # type: ignore[union-attr]
        assert move.end - move.start <= cap
        # The node's own model stays covered wherever it was covered before the move.
        after = tuple(x for x in snap.shards if x.node_id != s.node_id) + (
            shard(s.node_id, move.start, move.end, fp=move.model_fingerprint),
        )
        moved = snapshot(snap.model(FP).n_layers, list(after))  # type: ignore[union-attr]
        if throughput(snap, s.model_fingerprint) > 0:
            assert throughput(moved, s.model_fingerprint) > 0
        assert move.gain >= 0.25 or move.reason == "single_point_of_failure"


def test_pending_moves_are_applied_and_forgotten() -> None:
    from tracker.rebalance import PendingMoves, apply_moves

    snap = snapshot(10, [shard("a", 0, 5, ms=10.0), shard("b", 0, 5, ms=10.0), shard("c", 5, 10, ms=10.0)])
    pending = PendingMoves(keep_s=30.0)
    pending.record("b", Move(FP, 5, 10, "throughput", 1.0), 0.0)
    view = apply_moves(snap, pending.active(1.0))
    spans = sorted((s.node_id, s.start, s.end) for s in view.shards)
    assert spans == [("a", 0, 5), ("b", 5, 10), ("c", 5, 10)]
    moved = next(s for s in view.shards if s.node_id == "b")
    assert moved.decode_ms_per_token == 10.0 and moved.active_sessions == 0
    # A node asking is judged where it really is; after keep_s the move is forgotten.
    assert pending.active(1.0, besides="b") == {}
    assert pending.active(31.0) == {} and len(pending) == 0
    # A move already made (the node announced its new span) leaves the snapshot as it is.
    done = snapshot(10, [shard("a", 0, 5), shard("b", 5, 10)])
    assert apply_moves(done, {"b": Move(FP, 5, 10, "throughput", 1.0)}).shards == done.shards


def test_a_node_stays_while_the_holders_advised_to_join_it_do_not_serve_yet() -> None:
    from tracker.rebalance import apply_moves

    # o alone serves OTHER; a and b are advised to join it (pending: they drain, fetch, load for
    # minutes). Demand moves back to FP. In the view with the moves applied OTHER has three holders,
    # so o could leave -- but o is the only node serving OTHER now: it stays.
    snap = snapshot(10, [shard(n, 0, 10, ms=10.0) for n in "abc"] + [shard("o", 0, 10, ms=10.0, fp=OTHER_FP)])
    moves = {n: Move(OTHER_FP, 0, 10, "throughput", 1.0) for n in "ab"}
    view = apply_moves(snap, moves)
    caps = {FP: 10, OTHER_FP: 10}
    demand = {FP: 5.0, OTHER_FP: 0.1}
    assert advise(view, "o", caps, demand, rng=random.Random(0)) is not None  # the view alone: o goes
    assert advise(view, "o", caps, demand, rng=random.Random(0), present=snap) is None
    # Once they serve it (announced there), o may go.
    served = snapshot(10, [shard("c", 0, 10)] + [shard(n, 0, 10, fp=OTHER_FP) for n in "abo"])
    assert advise(served, "o", caps, demand, rng=random.Random(0), present=served) is not None


def test_pending_moves_name_trades_and_price_other_models_at_their_speed() -> None:
    from tracker.rebalance import PendingMoves, apply_moves

    pending = PendingMoves(keep_s=30.0)
    pending.record("b", Move(OTHER_FP, 0, 10, "throughput", 1.0), 0.0, origin=FP)
    assert pending.reverses(OTHER_FP, FP, 1.0)  # a node of OTHER told to go to FP would trade places
    assert not pending.reverses(FP, OTHER_FP, 1.0) and not pending.reverses(FP, FP, 1.0)
    assert not pending.reverses(OTHER_FP, FP, 31.0)  # forgotten after keep_s
    # b (FP, 10 ms per layer) moving to OTHER, whose shards take 2 ms per layer: priced at 2.
    snap = snapshot(10, [shard("b", 0, 10, ms=100.0), shard("o", 0, 10, ms=20.0, fp=OTHER_FP)])
    view = apply_moves(snap, {"b": Move(OTHER_FP, 0, 10, "throughput", 1.0)})
    moved = next(s for s in view.shards if s.node_id == "b")
    assert moved.model_fingerprint == OTHER_FP and moved.decode_ms_per_token == 20.0
