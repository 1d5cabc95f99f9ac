"""gateway/open_plan.py (issue 26): the nodes this gateway avoids for having been silent when dialled
are let back in once when no route avoids them -- a node slow to answer once beats a sure 503 --
but never a node that failed in this request, one the caller named, or one caught lying.

Seen on the emulated WAN on a loaded machine (docs/wan.md): the gateway's dial deadline (1.5 s)
passed on every SmolLM2 node and on Gemma 3's only node; each was avoided for
``avoid_unreachable_s`` (60 s), and for that minute every request for those models got 503
"layers not covered" although the tracker routed to them again within seconds."""

from __future__ import annotations

from gateway.errors import StageFailed
from gateway.node_standing import NodeStanding
from gateway.open_plan import OpenPlan


def test_silent_nodes_are_let_back_in_once_when_no_route_avoids_them() -> None:
    plan = OpenPlan(frozenset({"named"}), {"slow", "liar", "named"}, silent=frozenset({"slow"}))
    assert not plan.admits(["slow"]) and not plan.admits(["liar"])  # a route without them first
    assert plan.no_route() is True and plan.admits(["slow"])  # none: the silent one is let back in
    assert not plan.admits(["liar"]) and not plan.admits(["named"])
    assert plan.no_route() is False  # only once


def test_a_silent_node_that_fails_again_in_this_request_stays_out() -> None:
    plan = OpenPlan(excluded={"slow", "other"}, silent=frozenset({"slow", "other"}))
    plan.start()
    plan.unreachable(StageFailed("no Info", node_id="slow"))
    assert plan.no_route() is True and plan.admits(["other"]) and not plan.admits(["slow"])
    # Nothing to let back in: the look-up's refusal (or the last failure) stands.
    assert OpenPlan().no_route() is False
    failed = OpenPlan(excluded={"slow"}, silent=frozenset({"slow"}))
    failed.open_failed(StageFailed("gone", node_id="slow"), fork=False)
    assert failed.no_route() is False and not failed.admits(["slow"])


def test_the_standing_names_silent_nodes_apart_from_liars() -> None:
    standing = NodeStanding()
    standing.avoid_silent("slow", 10.0)
    standing.avoid_silent("both", 10.0)
    standing.avoid_liar("both", 100.0)
    standing.avoid_liar("liar", 100.0)
    assert standing.avoided_silent(1.0) == {"slow"}
    assert standing.avoided(1.0) == {"slow", "both", "liar"}
    assert standing.avoided_silent(11.0) == frozenset()  # the avoidance ran out
