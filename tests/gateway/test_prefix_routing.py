"""Prefix-aware route choice (gateway.route_choice.reported_prefix, pure): the route whose every stage
reported the longest prefix of the prompt, weighed against load; exact cuts; what is never chosen."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from common.prefix_chain import BLOCK_TOKENS, chain, head, parse_source_id
from gateway.route_choice import reported_prefix
from gateway.routes import Hop, Route
from node.prefix_blocks import PrefixBlocks

FP = "5e" * 32
SYSTEM = [3 + i % 97 for i in range(20 * BLOCK_TOKENS)]  # a 320-token system prompt


def heads_of(*kept: list[int]) -> frozenset[str]:
    """What a node keeping these token lists reports (its real index)."""
    index = PrefixBlocks(FP)
    for i, toks in enumerate(kept):
        index.add(f"s{i}", toks)
    return frozenset(index.heads())


def route(name: str, *stages: frozenset[str]) -> Route:
    hops = tuple(
        Hop(node_id=f"{name}{i}", start=i, end=i + 1, address=f"{name}{i}:1", prefix_heads=h)
        for i, h in enumerate(stages)
    )
    return Route(name, "m" * 64, "model", len(hops), hops, b"", 1e9, 10.0)


def pick(prompt: list[int], routes: list[Route], loads: dict[str, int] | None = None, **kw: object):
    loads = loads or {}
    args = {"slack": 2, "least": 32, **kw}
    return reported_prefix(
        prompt,
        FP,
        routes,
        routes[0],
        lambda r: loads.get(r.route_id, 0),
        **args,  # type: ignore[arg-type]
    )


def test_the_route_holding_the_shared_system_prompt_on_every_stage_is_preferred() -> None:
    a = SYSTEM + [1] * 40  # client A's turn, kept on route "warm"
    b = SYSTEM + [2] * 40  # client B, another API key, same app
    kept = heads_of(a)
    cold = route("cold", frozenset(), frozenset())
    half = route("half", kept, frozenset())  # only one stage holds it: useless
    warm = route("warm", kept, kept)
    found = pick(b, [cold, half, warm])
    assert found is not None
    chosen, positions, chain_hash = found
    # A's chain is reported at its last block (22) and the ladder (2, 4, 8, 16 blocks): B shares 20
    # blocks, so the deepest reported head B's prompt reaches is 16 blocks.
    assert chosen is warm and positions == 16 * BLOCK_TOKENS
    assert chain_hash == chain(FP, b)[15]
    # Once a second client's turn is kept beside A's, the node reports where they part: all 20 blocks.
    both = heads_of(a, SYSTEM + [5] * 40)
    found = pick(b, [cold, route("warm", both, both)])
    assert found is not None and found[1] == 20 * BLOCK_TOKENS


def test_load_beyond_the_slack_sends_the_request_elsewhere() -> None:
    kept = heads_of(SYSTEM + [1] * 40)
    cold = route("cold", frozenset(), frozenset())
    warm = route("warm", kept, kept)
    prompt = SYSTEM + [9] * 40
    assert pick(prompt, [cold, warm], {"cold": 0, "warm": 2}) is not None  # within the slack
    assert pick(prompt, [cold, warm], {"cold": 0, "warm": 3}) is None  # past it: stay cold
    # Two routes hold it: the lighter one
    warm2 = route("warm2", kept, kept)
    found = pick(prompt, [cold, warm, warm2], {"warm": 2, "warm2": 1})
    assert found is not None and found[0] is warm2


def test_exact_reuse_is_cut_at_whole_prefill_steps_and_short_prefixes_are_not_worth_it() -> None:
    both = heads_of(SYSTEM + [1] * 40, SYSTEM + [2] * 40)  # 20 blocks reported
    warm = route("warm", both, both)
    found = pick(SYSTEM + [3] * 40, [warm], step=128)
    assert found is not None and found[1] == 256  # 320 cut at a multiple of 128
    assert pick(SYSTEM + [3] * 40, [warm], step=512) is None  # not one whole step
    assert pick(SYSTEM + [3] * 40, [warm], least=400) is None
    # The prompt is the prefix itself: one token is always left to prefill, so its 20th block is not
    # reusable and the deepest reported head below it is the ladder's 16th.
    found = pick(SYSTEM, [warm])
    assert found is not None and found[1] == 16 * BLOCK_TOKENS


def test_suspect_routes_and_other_recipes_are_never_chosen() -> None:
    kept = heads_of(SYSTEM + [1] * 40)
    warm = route("warm", kept, kept)
    assert pick(SYSTEM + [2] * 40, [warm], suspect=lambda r: True) is None
    other = reported_prefix(SYSTEM + [2] * 40, "77" * 32, [warm], warm, lambda r: 0, slack=2, least=32)
    assert other is None  # the heads were computed under another recipe's chain


@settings(max_examples=50)
@given(
    st.lists(st.lists(st.integers(0, 3), max_size=6 * BLOCK_TOKENS), min_size=1, max_size=3),
    st.lists(st.integers(0, 3), min_size=1, max_size=8 * BLOCK_TOKENS),
    st.sampled_from([0, 16, 32, 48]),
)
def test_a_chosen_prefix_is_held_by_every_stage_and_is_exactly_the_prompts(
    kept: list[list[int]], prompt: list[int], step: int
) -> None:
    stage_a, stage_b = PrefixBlocks(FP), PrefixBlocks(FP)
    for i, toks in enumerate(kept):
        stage_a.add(f"s{i}", toks)
        if i % 2 == 0:
            stage_b.add(f"s{i}", toks)
    r = route("r", frozenset(stage_a.heads()), frozenset(stage_b.heads()))
    found = pick(prompt, [r], least=1, step=step)
    if found is None:
        return
    _, positions, chain_hash = found
    assert 0 < positions < len(prompt) and positions % BLOCK_TOKENS == 0
    assert step == 0 or positions % step == 0
    # Every stage finds the named hash and holds exactly these positions of exactly these tokens.
    for stage in (stage_a, stage_b):
        held = stage.find(chain_hash)
        assert held is not None and held[1] * BLOCK_TOKENS == positions
        holder = kept[int(held[0][1:])]
        assert holder[:positions] == prompt[:positions]
    assert head(chain_hash) in {head(h) for h in chain(FP, prompt)}
    assert parse_source_id(f"blocks:{chain_hash.hex()}") == (chain_hash, 0)
