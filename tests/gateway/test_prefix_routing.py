"""Prefix-aware route choice (gateway.route_choice.reported_prefix, pure): the route whose every stage
reported the longest prefix of the prompt, weighed against load; exact cuts; what is never chosen; the
hashes the OPEN names reach the last whole block a kept prompt shares (the nodes' real table decides)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from common.prefix_chain import BLOCK_TOKENS, MAX_SOURCE_HASHES, chain, head, parse_source_id, source_id
from gateway.route_choice import reported_prefix
from gateway.routes import Hop, Route
from node.kept_sessions import KeptSessions
from node.prefix_blocks import PrefixBlocks

FP = "5e" * 32
SYSTEM = [3 + i % 97 for i in range(20 * BLOCK_TOKENS)]  # a 320-token system prompt


@dataclass
class Entry:
    kv_len: int
    expires_at: float = 1e9
    first_step: int = 0
    aligned_end: int = 0


def node_keeping(*kept: list[int], step: int = 0) -> KeptSessions[Entry]:
    """A node's real kept-session table holding these token lists (computed in whole steps of ``step``)."""
    table: KeptSessions[Entry] = KeptSessions(64, 1 << 20, FP)
    for i, toks in enumerate(kept):
        table.keep(
            f"s{i}", Entry(len(toks), first_step=step, aligned_end=len(toks) // max(step, 1) * step), toks
        )
    return table


def copied(table: KeptSessions[Entry], found: tuple[Route, int, tuple[bytes, ...]], step: int = 0) -> int:
    """Positions a node with ``table`` copies for the OPEN the gateway sends (0: none), through the
    source id's text as the node receives it."""
    _, positions, named = found
    parsed = parse_source_id(source_id(named[0], step, named[1:]))
    assert parsed is not None
    got = table.prefix_source(parsed[0], parsed[1], positions)
    return 0 if got is None else got[1]


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
    chosen, positions, named = found
    # A's chain is reported at its last block (22) and the ladder (2, 4, 8, 16 blocks): B shares 20
    # blocks, so every stage reported 16 of them; the OPEN names B's prefixes from its last whole
    # block (22, one token left to prefill) down to those 16, and each node copies the deepest it
    # holds: all 20 blocks B shares with A.
    assert chosen is warm and positions == 22 * BLOCK_TOKENS
    assert named == tuple(chain(FP, b)[i] for i in range(21, 14, -1))
    assert copied(node_keeping(a), found) == 20 * BLOCK_TOKENS
    # A node that kept nothing of it since copies nothing (the route is re-opened empty).
    assert copied(node_keeping(SYSTEM[:100]), found) == 0
    # Once a second client's turn is kept beside A's, the node reports where they part: all 20 blocks
    # are the floor.
    both = heads_of(a, SYSTEM + [5] * 40)
    found = pick(b, [cold, route("warm", both, both)])
    assert found is not None and found[2][-1] == chain(FP, b)[19]


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
    assert found is not None and found[1] == 256  # 359 positions cut at a multiple of 128
    assert len(found[2]) == 1
    assert pick(SYSTEM + [3] * 40, [warm], step=512) is None  # not one whole step
    assert pick(SYSTEM + [3] * 40, [warm], least=400) is None
    # The prompt is the prefix itself: one token is always left to prefill, so its 20th block is not
    # reusable; the deepest the OPEN names is the 19th.
    found = pick(SYSTEM, [warm])
    assert found is not None and found[1] == 19 * BLOCK_TOKENS
    assert copied(node_keeping(SYSTEM + [1] * 40), found) == 19 * BLOCK_TOKENS


def test_a_long_span_is_named_by_at_most_the_bound_of_hashes_evenly_spaced() -> None:
    system = [3 + i % 89 for i in range(160 * BLOCK_TOKENS)]
    kept = heads_of(system[: 3 * BLOCK_TOKENS] + [1] * 40)  # only 2 blocks reported in common
    warm = route("warm", kept, kept)
    found = pick(system + [2] * 40, [warm])
    assert found is not None
    _, positions, named = found
    prompt_chain = chain(FP, system + [2] * 40)
    assert len(named) == MAX_SOURCE_HASHES and positions == 162 * BLOCK_TOKENS
    assert named[0] == prompt_chain[161] and named[-1] == prompt_chain[1]  # the deepest and the floor
    depth = [prompt_chain.index(h) for h in named]
    assert depth == sorted(depth, reverse=True) and len(set(depth)) == len(depth)


def test_suspect_routes_and_other_recipes_are_never_chosen() -> None:
    kept = heads_of(SYSTEM + [1] * 40)
    warm = route("warm", kept, kept)
    assert pick(SYSTEM + [2] * 40, [warm], suspect=lambda r: True) is None
    other = reported_prefix(SYSTEM + [2] * 40, "77" * 32, [warm], warm, lambda r: 0, slack=2, least=32)
    assert other is None  # the heads were computed under another recipe's chain


@settings(max_examples=60)
@given(
    st.lists(st.lists(st.integers(0, 3), max_size=6 * BLOCK_TOKENS), min_size=1, max_size=3),
    st.lists(st.integers(0, 3), min_size=1, max_size=8 * BLOCK_TOKENS),
    st.sampled_from([0, 16, 32, 48]),
)
def test_what_every_stage_copies_is_the_longest_whole_step_prefix_it_shares_with_the_prompt(
    kept: list[list[int]], prompt: list[int], step: int
) -> None:
    stage_a = node_keeping(*kept, step=step)
    stage_b = node_keeping(*[k if i % 2 == 0 else [] for i, k in enumerate(kept)], step=step)
    r = route("r", frozenset(stage_a.index.heads()), frozenset(stage_b.index.heads()))
    found = pick(prompt, [r], least=1, step=step)
    if found is None:
        return
    _, positions, named = found
    unit = step or BLOCK_TOKENS  # the steps drawn are whole blocks
    assert 0 < positions < len(prompt) and positions % unit == 0
    assert all(head(h) in {head(x) for x in chain(FP, prompt)} for h in named)
    for stage, holders in ((stage_a, kept), (stage_b, kept[::2])):
        got = copied(stage, found, step)
        # The longest prefix of the prompt some kept list holds, in whole steps, at most ``positions``:
        # exactly what the node copies (the floor the heads showed is always among the names).
        best = max(
            (
                n
                for k in holders
                for n in range(0, positions + 1, unit)
                if k[:n] == prompt[:n] and n <= len(k)
            ),
            default=0,
        )
        assert got == best and got > 0


def test_a_prefix_look_up_names_the_prompts_heads_once_per_prefix_and_ttl() -> None:
    """RouteCache.routes_for_prefix against a stand-in of the tracker client (what it is asked)."""
    import secrets

    import httpx
    import nacl.signing
    import trio

    from gateway.metrics import Metrics
    from gateway.routes import MAX_ROUTE_PREFIX_HEADS, PREFIX_KEY_BLOCKS, RouteCache
    from gateway.tracker_key import TrackerKey
    from proto.signing import RouteTicket, TicketHop, public_key_hex, sign_route_ticket

    now = [1000.0]
    asked: list[tuple[str, ...]] = []
    down = [False]
    tracker_key = nacl.signing.SigningKey(bytes([7]) * 32)

    class Tracker:
        key_id = "g" * 64

        async def routes(self, model: str, *, prefix_heads: tuple[str, ...] = (), **_: object) -> dict:
            asked.append(tuple(prefix_heads))
            if down[0]:
                raise httpx.ConnectError("connection refused")
            ticket = RouteTicket(
                "",
                secrets.token_hex(16),
                "f" * 64,
                (TicketHop("a" * 64, 0, 30, "127.0.0.1:1"),),
                now[0],
                now[0] + 300,
            )
            route = {
                "hops": [{"node_id": "a" * 64, "start": 0, "end": 30, "address": "127.0.0.1:1"}],
                "ticket": sign_route_ticket(tracker_key, ticket),
                "expires_at": now[0] + 300,
                "expected_ms_per_token": 5,
            }
            return {"model": {"fingerprint": "f" * 64, "name": "m", "n_layers": 30}, "routes": [route]}

    cache = RouteCache(
        Tracker(),  # type: ignore[arg-type]
        k=1,
        ttl_s=10,
        tracker_timeout_s=5,
        metrics=Metrics(),
        tracker_key=TrackerKey(public_key_hex(tracker_key)),
        clock=lambda: now[0],
    )
    long_prompt = [3 + i % 97 for i in range((MAX_ROUTE_PREFIX_HEADS + 30) * BLOCK_TOKENS)]
    heads = [head(h) for h in chain(FP, long_prompt)]
    other = [head(h) for h in chain(FP, long_prompt[: 20 * BLOCK_TOKENS] + [1] * 64)]  # same first 320

    async def main() -> None:
        assert await cache.routes_for_prefix("m", heads[: PREFIX_KEY_BLOCKS - 1]) is None  # too short
        assert asked == []
        first = await cache.routes_for_prefix("m", heads)
        assert first is not None and asked == [tuple(heads[:MAX_ROUTE_PREFIX_HEADS])]  # bounded
        # Another prompt of the same app (the same first 256 positions): the answer is reused.
        assert await cache.routes_for_prefix("m", other) is first and len(asked) == 1
        now[0] += 11  # past ttl_s: asked again; a failure is remembered as None for ttl_s
        down[0] = True
        assert await cache.routes_for_prefix("m", other) is None and asked[-1] == tuple(other)
        down[0] = False
        now[0] += 6  # within ttl_s of the failure, and past the tracker's retry hold: not asked
        assert await cache.routes_for_prefix("m", heads) is None and len(asked) == 2

    trio.run(main)


def test_another_clients_prefix_is_named_by_blocks_and_copied_from_any_session_holding_it() -> None:
    """A shared hit of the gateway's index names the prompt's chain hashes, not the session it
    remembers: a node that evicted that session copies the same prefix from another kept one."""
    from types import SimpleNamespace

    from gateway.config import GatewayConfig
    from gateway.prefix_cache import PrefixCache
    from gateway.route_choice import Prepared, RouteChoice

    config = GatewayConfig(prefix_share_min_tokens=72, prefix_min_tokens=32)
    index = PrefixCache(ttl_s=60, exact=False, share_min_tokens=72)
    choice = RouteChoice(config, None, None, None, None, index, None, lambda: 1)  # type: ignore[arg-type]
    a, b1, b5 = SYSTEM + [1] * 30, SYSTEM + [2] * 30, SYSTEM + [2] * 5 + [9] * 30
    index.put("alice", "m", ("n0", "n1"), "sess-a", a, 0.0)
    index.put("bob", "m", ("n0", "n1"), "sess-b1", b1, 0.0)
    hit = index.lookup("carol", "m", b5, 1.0)
    assert hit is not None and hit.shared and hit.entry.session_id == "sess-b1" and hit.positions == 325
    stages = [SimpleNamespace(recipe_fingerprint=FP)] * 2
    prepared = Prepared(None, stages, None, b5, 8, 400)  # type: ignore[arg-type]
    named = choice._by_blocks(hit, prepared)
    assert named.shared and named.positions == 320 and named.entry.nodes == ("n0", "n1")
    parsed = parse_source_id(named.entry.session_id)
    assert parsed is not None and parsed[0][0] == chain(FP, b5)[19] and parsed[0][-1] == chain(FP, b5)[4]
    # The node evicted b1's session (it keeps fewer than the gateway remembers); a's still holds the
    # 320 system-prompt positions: copied from it, not an empty start and a whole prefill.
    node = node_keeping(a)
    assert node.prefix_source(parsed[0], parsed[1], named.positions) == ("s0", 320)
    # Too short to name by whole blocks at or above the sharing floor (75 -> 64 < 80): as it was.
    short = index.lookup("carol", "m", SYSTEM[:75] + [4] * 10, 1.0)
    assert short is not None and choice._by_blocks(short, prepared) is short
