"""Warm KV on a node: RELEASE with keep_ms keeps a session, OPEN with a KvSource reuses it (sans-IO)."""

from __future__ import annotations

from common.prefix_chain import chain, source_id, tails
from node.session_machine import FreeKv, OpenKv, Send, TruncateKv
from proto import codec
from proto.swarm.v1 import status_pb2
from tests.node.test_session_machine import Harness, status_of

S = status_pb2


def open_from(
    h: Harness, sid: str, source: str, positions: int, budget: int = 32, step_id: int = 1, copy: bool = False
) -> list:
    return h.feed(
        codec.open_frame(
            h.header(sid),
            step_id=step_id,
            route_ticket=b"good",
            kv_budget_tokens=budget,
            kv_source=(source, positions),
            kv_copy=copy,
        )
    )


def release(h: Harness, sid: str, step_id: int, keep_ms: int, keep_positions: int) -> list:
    return h.feed(
        codec.release_frame(h.header(sid), step_id=step_id, keep_ms=keep_ms, keep_positions=keep_positions)
    )


def ack_kv(actions: list) -> int:
    (send,) = [a for a in actions if isinstance(a, Send)]
    return int(send.frames[0].kv_len)


def prefilled(h: Harness, sid: str, n: int) -> None:
    h.open(sid)
    h.run_step(sid, 2, 0, n)


def test_released_session_is_kept_and_taken_over_by_a_prefix_open() -> None:
    h = Harness(max_sessions=2)
    prefilled(h, "s1", 10)
    actions = release(h, "s1", 99, keep_ms=5000, keep_positions=8)
    assert TruncateKv("s1", 8) in actions and not any(isinstance(a, FreeKv) for a in actions)
    (send,) = [a for a in actions if isinstance(a, Send)]
    assert send.frames[0].closed.freed_kv_tokens == 2
    assert h.m.statistics().kept_sessions == 1 and h.m.statistics().sessions == 0
    # The next turn: starts from 6 of the 8 kept positions, taking the sequence over.
    actions = open_from(h, "s2", "s1", 6)
    (opened,) = [a for a in actions if isinstance(a, OpenKv)]
    assert (opened.source, opened.source_positions, opened.move) == ("s1", 6, True)
    assert ack_kv(actions) == 6 and h.m.kv_len("s2") == 6
    assert h.m.statistics().kept_sessions == 0
    # Steps continue from the reused prefix.
    assert h.run_step("s2", 8, 6, 3).kv_len == 9


def test_a_kept_prefix_shared_with_another_client_is_copied_and_stays_kept() -> None:
    h = Harness(max_sessions=3)
    prefilled(h, "owner", 10)
    release(h, "owner", 99, keep_ms=5000, keep_positions=10)
    actions = open_from(h, "other", "owner", 8, copy=True)
    (opened,) = [a for a in actions if isinstance(a, OpenKv)]
    assert (opened.source, opened.source_positions, opened.move) == ("owner", 8, False)
    assert ack_kv(actions) == 8 and h.m.kv_len("other") == 8
    assert h.m.statistics().kept_sessions == 1  # still the owner's
    # Slots run out: other kept sessions may go, never the source being copied; the owner takes it over.
    actions = open_from(h, "owner2", "owner", 10)
    (opened,) = [a for a in actions if isinstance(a, OpenKv)]
    assert opened.move and ack_kv(actions) == 10
    assert h.m.statistics().kept_sessions == 0


def test_a_live_session_is_copied_for_another_choice() -> None:
    h = Harness(max_sessions=3)
    prefilled(h, "p", 10)
    actions = open_from(h, "c1", "p", 10)
    (opened,) = [a for a in actions if isinstance(a, OpenKv)]
    assert (opened.source, opened.source_positions, opened.move) == ("p", 10, False)
    assert ack_kv(actions) == 10
    assert h.m.kv_len("p") == 10  # the source is untouched


def test_unusable_sources_start_empty() -> None:
    h = Harness(max_sessions=6)
    prefilled(h, "p", 5)
    for sid, source, positions in (("a", "nope", 3), ("b", "p", 6), ("c", "p", 0), ("d", "p", 40)):
        actions = open_from(h, sid, source, positions, budget=32)
        (opened,) = [a for a in actions if isinstance(a, OpenKv)]
        assert opened.source == "" and ack_kv(actions) == 0, (sid, source, positions)


def test_kept_sessions_go_first_when_slots_run_out_and_expire() -> None:
    h = Harness(max_sessions=2)
    prefilled(h, "s1", 4)
    release(h, "s1", 99, keep_ms=60_000, keep_positions=4)
    prefilled(h, "s2", 4)
    # Both slots taken (one live, one kept): a new session evicts the kept one instead of refusing.
    actions = h.open("s3")
    assert actions[0] == FreeKv("s1") and ack_kv(actions) == 0
    assert h.m.statistics().kept_sessions == 0
    # Nothing kept and both slots live: refused as before.
    assert status_of(h.open("s4")) == S.STATUS_RESOURCE_EXHAUSTED
    # A kept session ends at its lease.
    release(h, "s2", 99, keep_ms=1000, keep_positions=4)
    h.now += 0.5
    assert h.m.tick(h.now) == []
    h.now += 1.0
    assert h.m.tick(h.now) == [FreeKv("s2")]


def test_kept_sessions_are_bounded_in_count_and_positions() -> None:
    h = Harness(max_sessions=6, max_kept_sessions=2, max_kept_kv_tokens=12)
    for i in range(3):
        prefilled(h, f"s{i}", 5)
    release(h, "s0", 99, keep_ms=60_000, keep_positions=5)
    release(h, "s1", 99, keep_ms=60_000, keep_positions=5)
    actions = release(h, "s2", 99, keep_ms=60_000, keep_positions=5)
    assert FreeKv("s0") in actions  # three would pass both bounds: the oldest goes
    assert h.m.statistics().kept_sessions == 2 and h.m.statistics().kept_kv_tokens == 10
    # keep_ms 0 or a node that keeps nothing: freed at once, as before.
    h2 = Harness(max_kept_sessions=0)
    prefilled(h2, "s", 3)
    assert FreeKv("s") in release(h2, "s", 99, keep_ms=5000, keep_positions=3)


def test_a_cancelled_session_is_never_kept_and_drain_frees_kept_ones() -> None:
    h = Harness(max_sessions=3)
    prefilled(h, "s1", 4)
    actions = h.feed(codec.cancel_frame(h.header("s1"), step_id=99))
    assert FreeKv("s1") in actions
    prefilled(h, "s2", 4)
    release(h, "s2", 99, keep_ms=5000, keep_positions=4)
    assert FreeKv("s2") in h.m.drain()
    assert h.m.statistics().kept_sessions == 0


def test_kept_sessions_go_least_recently_used_first() -> None:
    h = Harness(max_sessions=4)
    prefilled(h, "a", 10)
    release(h, "a", 99, keep_ms=60_000, keep_positions=10)
    prefilled(h, "b", 10)
    release(h, "b", 99, keep_ms=60_000, keep_positions=10)
    # "a" was kept first, but another client's request shares its prefix now: "b" is the colder one.
    open_from(h, "c", "a", 8, copy=True)
    h.open("d")
    actions = h.open("e")  # the 4 slots: c, d, e and one kept session
    freed = [a for a in actions if isinstance(a, FreeKv)]
    assert freed == [FreeKv("b")], actions
    assert h.m.statistics().kept_sessions == 1
    h.feed(codec.release_frame(h.header("d"), step_id=2))  # a slot for the owner's next turn
    assert ack_kv(open_from(h, "a2", "a", 10)) == 10  # "a" stayed, whole


# --------------------------------------------------------------------------- prefixes named by chain hash


def _steps_with_tokens(h: Harness, sid: str, tokens: list[int], step: int) -> None:
    """Prefill ``tokens`` on a middle stage in steps of ``step``, each carrying its token ids."""
    import numpy as np

    from node.session_machine import Compute
    from tests.node.test_session_machine import N_EMBD

    start = 0
    while start < len(tokens):
        n = min(step, len(tokens) - start)
        frames = codec.step_frames(
            h.header(sid),
            codec.frame_pb2.PHASE_PREFILL,
            step_id=2 + start,
            start=start,
            token_ids=tokens[start : start + n],
            hidden=np.ones((n, N_EMBD), np.float32),
        )
        actions = [a for f in frames for a in h.feed(f)]
        (compute,) = [a for a in actions if isinstance(a, Compute)]
        h.complete(compute.job.job_id, start + n, n)
        start += n


def test_a_prefix_named_by_its_chain_hash_is_copied_from_the_kept_session_holding_it() -> None:
    from common.prefix_chain import BLOCK_TOKENS, chain, source_id

    h = Harness(max_sessions=8, session_kv_tokens=128, n_ctx_train=256)
    system = [7 + i % 50 for i in range(48)]  # 3 blocks
    a = system + [1] * 20
    h.open("a", budget=128)
    _steps_with_tokens(h, "a", a, 16)
    release(h, "a", 999, keep_ms=60_000, keep_positions=len(a))
    fp = h.m.spec.recipe_fingerprint
    hashes = chain(fp, system + [2] * 20)
    assert h.m.statistics().prefix_cached_blocks == len(a) // BLOCK_TOKENS == 4
    # Another client's prompt sharing the system prompt: its third block's hash names 48 positions.
    actions = open_from(h, "b", source_id(hashes[2]), 48, budget=128)
    (opened,) = [x for x in actions if isinstance(x, OpenKv)]
    assert (opened.source, opened.source_positions, opened.move) == ("a", 48, False)
    assert ack_kv(actions) == 48 and h.m.statistics().kept_sessions == 1  # copied: a stays kept
    stats = h.m.statistics()
    assert (stats.prefix_lookups_hit, stats.prefix_lookups_miss) == (1, 0)
    # A hash the node does not hold, or positions that do not match the block: empty.
    for sid, name, positions in (
        ("c", source_id(hashes[3]), 64),  # block 4 differs from a's
        ("d", source_id(hashes[2]), 32),  # the hash is block 3's, not block 2's
        ("e", source_id(hashes[2], 32), 48),  # exact with step 32: a was computed in steps of 16
    ):
        actions = open_from(h, sid, name, positions, budget=128)
        (opened,) = [x for x in actions if isinstance(x, OpenKv)]
        assert opened.source == "" and ack_kv(actions) == 0, sid
    # Exact with the step a was computed in (whole steps of 16 from 0 up to 64).
    actions = open_from(h, "f", source_id(hashes[2], 16), 48, budget=128)
    assert ack_kv(actions) == 48
    assert h.m.statistics().prefix_lookups_miss == 3
    # Its tokens came with it: f is indexed under the same chain once kept.
    release(h, "f", 999, keep_ms=60_000, keep_positions=48)
    assert h.m.statistics().kept_sessions == 2 and h.m.statistics().prefix_cached_blocks == 4


def test_a_shared_prefix_ending_inside_a_block_is_copied_to_its_last_agreeing_position() -> None:
    """Two clients' prompts share a system prompt and part 6 tokens into a block: the OPEN names the
    tail hashes of the tokens after the last whole block (gateway.prefix_cache.with_tails), the node
    copies the 54 agreeing positions (not 48) and its ack says so; the counters count a hit."""
    h = Harness(max_sessions=8, session_kv_tokens=128, n_ctx_train=256)
    system = [7 + i % 50 for i in range(54)]  # 3 whole blocks and 6 tokens
    a = system + [1] * 14
    h.open("a", budget=128)
    _steps_with_tokens(h, "a", a, 16)
    release(h, "a", 999, keep_ms=60_000, keep_positions=len(a))
    b = system + [2] * 14
    parent = chain(h.m.spec.recipe_fingerprint, b[:48])[-1]
    named = [*tails(parent, b[48:63])[::-1], parent]
    actions = open_from(h, "b", source_id(named[0], 0, named[1:]), 63, budget=128, copy=True)
    (opened,) = [x for x in actions if isinstance(x, OpenKv)]
    assert (opened.source, opened.source_positions, opened.move) == ("a", 54, False)
    assert ack_kv(actions) == 54 and h.m.kv_len("b") == 54
    stats = h.m.statistics()
    assert (stats.prefix_lookups_hit, stats.prefix_lookups_miss, stats.kept_sessions) == (1, 0, 1)


def test_a_kept_session_that_leaves_takes_its_blocks_out_of_the_heads() -> None:
    h = Harness(max_sessions=4, session_kv_tokens=128, n_ctx_train=256)
    h.open("a", budget=128)
    _steps_with_tokens(h, "a", list(range(40)), 16)
    release(h, "a", 999, keep_ms=1000, keep_positions=40)
    assert len(h.m.prefix_heads()) >= 1
    h.now += 2.0
    h.m.tick(h.now)
    assert h.m.prefix_heads() == [] and h.m.statistics().prefix_cached_blocks == 0
