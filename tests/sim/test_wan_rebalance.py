"""Live rebalancing on the emulated WAN (needs root; skipped with the reason otherwise).

The short version of ``sim/bench_wan_rebalance.py`` (docs/wan.md, "Rebalancing on the WAN"):
tracker, gateway and four real nodes, each in its own namespace of the ``three-regions``
profile. Three nodes serve all of SmolLM2 (eu, us, asia), one serves all of Gemma 3 270M
(asia); both models are registered with a Range-capable source in the tracker's namespace.
Client threads (official ``openai`` client, streaming, no retries) ask for SmolLM2, then
demand shifts to Gemma 3 while one thread keeps asking SmolLM2 for longer answers. A SmolLM2
node is told to move (the tracker keeps two holders of every layer, so exactly one may),
drains, fetches Gemma 3 over the WAN and rejoins. Asserted: it moved, once; not one request
failed; every answer is the whole model's greedy text.

Opt-in (``SWARM_WAN_REBALANCE=1``), like the other long tests: on an idle 2-core machine it
takes about two minutes (a move to Gemma 3 alone parses its 262 144-token GGUF header in
gguf-py, ~10 s of CPU, then fetches 247 MB and loads it), far past the suite's budget.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from sim.bench_wan_rebalance import NodePlan, Scenario, compare_texts, run_scenario, summarize
from sim.wan.support import unavailable_reason

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"emulated WAN unavailable: {REASON}"),
    pytest.mark.skipif(
        os.environ.get("SWARM_WAN_REBALANCE") != "1", reason="long (minutes): set SWARM_WAN_REBALANCE=1"
    ),
]

SHORT = dataclasses.replace(
    Scenario(),
    nodes=(
        NodePlan("eu0", "eu", "A"),
        NodePlan("us0", "us", "A"),
        NodePlan("asia0", "asia", "A"),
        NodePlan("asia1", "asia", "B"),
    ),
    phase_a_s=6.0,
    max_shift_s=120.0,
    settle_s=8.0,
    expect_moves=1,
    concurrency=3,
    trickle=1,
    max_tokens=12,
    trickle_tokens=48,
    text_sample=0,  # every answer
    after_grace_s=2.0,
    ready_s=120.0,
)


def test_demand_shift_on_the_wan_moves_a_node_and_loses_no_request(tmp_path: Path) -> None:
    run = run_scenario(SHORT, tmp_path)
    compare_texts(run, SHORT.text_sample)
    s = summarize(run)
    print(
        f"wan rebalance: moves {s['moves']}; requests {s['requests']}, failed {s['failed']}; "
        f"B during {s['b_during_moves']}, after {s['b_after_moves']}; handed back {s['handed_back_sessions']}"
    )
    # A node a gateway found slow may still be re-challenged (out of routing for seconds) where another
    # holds its layers (tracker.rebalance.removable); reported, not asserted -- the requests are.
    print(f"left live without moving: {s['left_live_without_moving']}; events {s['service_events']}")
    assert s["failures"] == []
    assert [m["to"] for m in s["moves"]] == ["B"]  # one A node moved to B, nobody else
    assert s["drains"] == 1 and s["move_failed"] == 0
    assert s["b_after_moves"]["ok"] >= 1  # B answered after the move too
    assert s["a_trickle_after_shift"]["ok"] >= 1  # A kept answering through the move
    assert s["texts_compared"] == sum(1 for r in run.requests if r.ok) > 0
    assert s["texts_same"] == s["texts_compared"]
