"""Speculative decoding in the node's session machine: the last stage drafts, verifies and truncates;
a stage before it drops the previous window's rejected drafts when the next window starts (bounded)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.speculation import NgramProposer
from node.session_machine import Compute, FrameServer, Push, StepOutcome, TruncateKv
from proto import codec
from proto.codec import Sampled
from proto.swarm.v1 import frame_pb2, status_pb2
from tests.node.fakes import N_EMBD, RECIPE_FP
from tests.node.test_session_machine import Harness, sends, status_of

RING = codec.push_target("first", "10.0.0.1:1", b"ring-token", (0, 4), RECIPE_FP)
PROMPT = [1, 2, 3, 1, 2, 3]


def last_stage(max_drafts: int = 4, grammar: str = "") -> Harness:
    h = Harness(is_last=True, shard_start=4, shard_end=8)
    sampling = codec.SamplingSettings(temperature=0.0, grammar=grammar)
    frame = codec.open_frame(
        h.header(),
        step_id=1,
        route_ticket=b"good",
        kv_budget_tokens=40,
        sampling=sampling,
        ring=RING,
        max_drafts=max_drafts,
    )
    assert codec.body_kind(sends(h.feed(frame))[0]) == "open_ack"
    return h


def feed_step(h: Harness, start: int, tokens: list[int], *, drafts: int = 0, phase: int = 0) -> list:
    phase = phase or (frame_pb2.PHASE_DECODE if drafts or len(tokens) == 1 else frame_pb2.PHASE_PREFILL)
    frames = codec.step_frames(
        h.header(),
        phase,  # type: ignore[arg-type]
        step_id=1 + start + 1,
        start=start,
        token_ids=tokens,
        hidden=np.ones((len(tokens), N_EMBD), np.float32),
        sample=True,
        drafts=drafts,
    )
    out: list = []
    for f in frames:
        out += h.feed(f)
    return out


def pushed(actions: list) -> frame_pb2.Frame:
    (push,) = [a for a in actions if isinstance(a, Push)]
    (frame,) = push.frames
    return frame


def test_the_last_stage_sends_a_window_verifies_it_and_drops_the_rejected_drafts() -> None:
    h = last_stage(max_drafts=4)
    (c,) = [a for a in feed_step(h, 0, PROMPT) if isinstance(a, Compute)]
    out = h.m.complete(StepOutcome(c.job.job_id, kv_len=6, sampled=Sampled(1, -0.1)), 0)
    window = pushed(out)
    # "2 3 1" occurred before, followed by 2 3 (1, the token itself): the token and 3 drafts.
    assert list(window.activation.token_ids) == [1, 2, 3, 1]
    assert window.activation.drafts == 3 and window.positions.start == 6 and window.positions.end == 10
    assert window.step_id == 1 + 6 + 1 and window.activation.sample
    # The window comes back through the route: the target agrees with 2 drafts, then says 9.
    (c,) = [a for a in feed_step(h, 6, [1, 2, 3, 1], drafts=3) if isinstance(a, Compute)]
    assert c.job.drafts == 3
    draws = tuple(Sampled(t, -0.2) for t in (2, 3, 9, 9))
    out = h.m.complete(StepOutcome(c.job.job_id, kv_len=10, window=draws), 0)
    assert TruncateKv("s1", 9) in out
    (result,) = [f for f in sends(out) if codec.body_kind(f) == "result"]
    assert [t.token_id for t in result.result.sampled] == [2, 3, 9]
    assert result.kv_len == 9 and result.result.drafts == 3 and result.positions.end == 10
    nxt = pushed(out)
    assert nxt.positions.start == 9 and nxt.activation.token_ids[0] == 9 and nxt.step_id == 1 + 9 + 1
    assert h.m.kv_len("s1") == 9


def test_an_end_of_generation_draw_ends_the_window_and_the_ring() -> None:
    h = last_stage(max_drafts=2)
    (c,) = [a for a in feed_step(h, 0, PROMPT) if isinstance(a, Compute)]
    h.m.complete(StepOutcome(c.job.job_id, kv_len=6, sampled=Sampled(1, -0.1)), 0)
    (c,) = [a for a in feed_step(h, 6, [1, 2, 3], drafts=2) if isinstance(a, Compute)]
    draws = (Sampled(2, -0.1), Sampled(7, -0.1, end_of_generation=True), Sampled(5, -0.1))
    out = h.m.complete(StepOutcome(c.job.job_id, kv_len=9, window=draws), 0)
    (result,) = sends(out)
    assert [t.token_id for t in result.result.sampled] == [2, 7] and result.kv_len == 8
    assert not [a for a in out if isinstance(a, Push)]


def test_without_a_match_or_for_a_grammar_the_ring_step_is_plain() -> None:
    h = last_stage(max_drafts=4)
    (c,) = [a for a in feed_step(h, 0, [10, 11, 12, 13]) if isinstance(a, Compute)]
    plain = pushed(h.m.complete(StepOutcome(c.job.job_id, kv_len=4, sampled=Sampled(14, -0.1)), 0))
    assert list(plain.activation.token_ids) == [14] and plain.activation.drafts == 0
    g = last_stage(max_drafts=4, grammar='start: "a"')
    (c,) = [a for a in feed_step(g, 0, PROMPT) if isinstance(a, Compute)]
    plain = pushed(g.m.complete(StepOutcome(c.job.job_id, kv_len=6, sampled=Sampled(1, -0.1)), 0))
    assert plain.activation.drafts == 0
    # A window sent to a grammar session anyway is refused and changes nothing.
    assert status_of(feed_step(g, 6, [1, 2], drafts=1)) == status_pb2.STATUS_BAD_FRAME
    assert g.m.kv_len("s1") == 6


def first_stage() -> Harness:
    h = Harness(is_first=True, shard_start=0, shard_end=4)
    h.open(budget=40)
    (c,) = [a for a in feed_first(h, 0, [5, 6, 7, 8], prefill=True) if isinstance(a, Compute)]
    h.m.complete(StepOutcome(c.job.job_id, kv_len=4, hidden=np.ones((4, N_EMBD), np.float32)), 0)
    return h


def feed_first(h: Harness, start: int, tokens: list[int], *, drafts: int = 0, prefill: bool = False) -> list:
    frames = codec.step_frames(
        h.header(),
        frame_pb2.PHASE_PREFILL if prefill else frame_pb2.PHASE_DECODE,
        step_id=1 + start + 1,
        start=start,
        token_ids=tokens,
        sample=not prefill,
        drafts=drafts,
    )
    out: list = []
    for f in frames:
        out += h.feed(f)
    return out


def run_first(h: Harness, start: int, tokens: list[int], drafts: int) -> list:
    out = feed_first(h, start, tokens, drafts=drafts)
    (c,) = [a for a in out if isinstance(a, Compute)]
    end = start + len(tokens)
    h.m.complete(StepOutcome(c.job.job_id, kv_len=end, hidden=np.ones((len(tokens), N_EMBD), np.float32)), 0)
    return out


def test_a_stage_drops_the_rejected_drafts_when_the_next_window_starts_inside_the_last() -> None:
    h = first_stage()
    run_first(h, 4, [9, 1, 2, 3], drafts=3)  # positions 4..7; the stage holds 8
    assert h.m.kv_len("s1") == 8
    out = run_first(h, 6, [4, 5], drafts=1)  # the last stage accepted one draft: the window restarts at 6
    (trunc,) = [a for a in out if isinstance(a, TruncateKv)]
    assert trunc == TruncateKv("s1", 6)
    assert out.index(trunc) < next(i for i, a in enumerate(out) if isinstance(a, Compute))
    assert h.m.kv_len("s1") == 8


def test_a_rollback_past_the_previous_window_or_while_busy_is_a_position_mismatch() -> None:
    h = first_stage()
    run_first(h, 4, [9, 1, 2], drafts=2)  # holds 7; at most 2 may go
    run_first(h, 7, [3], drafts=0)  # all accepted: a plain step follows, and nothing may go any more
    assert h.m.kv_len("s1") == 8
    assert status_of(feed_first(h, 6, [3, 4], drafts=1)) in (
        status_pb2.STATUS_POSITION_MISMATCH,
        status_pb2.STATUS_STEP_CONFLICT,
    )
    assert h.m.kv_len("s1") == 8
    h = first_stage()
    run_first(h, 4, [9, 1, 2], drafts=2)
    # A plain prefill step never rolls back.
    assert status_of(feed_first(h, 6, [3, 4], prefill=True)) == status_pb2.STATUS_POSITION_MISMATCH
    # While a step computes, nothing is dropped: the window is refused until the stage is idle.
    busy = feed_first(h, 7, [3], drafts=0)
    assert [a for a in busy if isinstance(a, Compute)]
    assert status_of(feed_first(h, 6, [3, 4], drafts=1)) in (
        status_pb2.STATUS_POSITION_MISMATCH,
        status_pb2.STATUS_RESOURCE_EXHAUSTED,
    )


def test_window_frames_are_validated() -> None:
    h = first_stage()
    bad = codec.step_frames(
        h.header(), frame_pb2.PHASE_DECODE, step_id=6, start=4, token_ids=[1, 2], sample=True
    )
    bad[0].activation.drafts = 2  # 2 positions cannot hold a token and 2 drafts
    assert status_of(h.feed(bad[0])) == status_pb2.STATUS_BAD_FRAME
    bad[0].activation.drafts = codec.MAX_DRAFT_TOKENS + 1
    assert status_of(h.feed(bad[0])) == status_pb2.STATUS_BAD_FRAME
    unsampled = codec.step_frames(
        h.header(), frame_pb2.PHASE_DECODE, step_id=6, start=4, token_ids=[1, 2], drafts=1
    )
    assert status_of(h.feed(unsampled[0])) == status_pb2.STATUS_BAD_FRAME
    numbered = codec.step_frames(
        h.header(), frame_pb2.PHASE_PREFILL, step_id=6, start=4, token_ids=[1, 2], sample=True, window_gen=1
    )
    assert status_of(h.feed(numbered[0])) == status_pb2.STATUS_BAD_FRAME  # window numbers: DECODE only
    assert h.m.kv_len("s1") == 4
    assert isinstance(sends(run_first(h, 4, [1, 2], drafts=1)), list)


def test_no_drafts_while_more_sessions_than_speculate_max_sessions_are_open() -> None:
    h = Harness(is_last=True, shard_start=4, shard_end=8, max_sessions=4, speculate_max_sessions=1)
    for sid in ("s1", "s2"):
        frame = codec.open_frame(
            h.header(sid),
            step_id=1,
            route_ticket=b"good",
            kv_budget_tokens=40,
            sampling=codec.SamplingSettings(temperature=0.0),
            ring=RING,
            max_drafts=4,
        )
        h.feed(frame)
    (c,) = [a for a in feed_step(h, 0, PROMPT) if isinstance(a, Compute)]
    plain = pushed(h.m.complete(StepOutcome(c.job.job_id, kv_len=6, sampled=Sampled(1, -0.1)), 0))
    assert plain.activation.drafts == 0  # two sessions open, speculation only up to one
    h.feed(codec.release_frame(h.header("s2"), step_id=42, expected_kv_len=0))
    (c,) = [a for a in feed_step(h, 6, [1]) if isinstance(a, Compute)]
    window = pushed(h.m.complete(StepOutcome(c.job.job_id, kv_len=7, sampled=Sampled(2, -0.1)), 0))
    assert window.activation.drafts > 0


class ListProposer:
    """A proposer that records the history it is given and always proposes the same drafts."""

    def __init__(self, drafts: tuple[int, ...]) -> None:
        self.tokens: list[int] = []
        self.drafts = drafts

    @property
    def length(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def truncate(self, length: int) -> None:
        del self.tokens[length:]

    def propose(self, k: int) -> tuple[int, ...]:
        return self.drafts[:k]


def test_a_proposer_factory_drafts_instead_of_ngram_lookup_and_follows_the_accepted_history() -> None:
    """The node's draft model plugs in here (FrameServer(..., proposers)): the machine hands each
    speculating session's proposer exactly the accepted tokens, whatever the windows rejected."""
    made: list[ListProposer] = []

    def factory(ngram: object) -> ListProposer:
        made.append(ListProposer((7, 8)))
        return made[-1]

    h = Harness(is_last=True, shard_start=4, shard_end=8)
    h.m = FrameServer(h.spec, lambda ticket, sid, claim: None, factory)
    h.conn = h.m.connect()
    frame = codec.open_frame(
        h.header(),
        step_id=1,
        route_ticket=b"good",
        kv_budget_tokens=40,
        sampling=codec.SamplingSettings(temperature=0.0),
        ring=RING,
        max_drafts=4,
    )
    assert codec.body_kind(sends(h.feed(frame))[0]) == "open_ack"
    (c,) = [a for a in feed_step(h, 0, [10, 11, 12]) if isinstance(a, Compute)]
    window = pushed(h.m.complete(StepOutcome(c.job.job_id, kv_len=3, sampled=Sampled(13, -0.1)), 0))
    assert list(window.activation.token_ids) == [13, 7, 8]  # no n-gram matches: these are the proposer's
    (proposer,) = made
    assert proposer.tokens == [10, 11, 12, 13]
    (c,) = [a for a in feed_step(h, 3, [13, 7, 8], drafts=2) if isinstance(a, Compute)]
    draws = (Sampled(7, -0.1), Sampled(5, -0.1), Sampled(6, -0.1))  # 7 accepted, 5 corrects 8
    out = h.m.complete(StepOutcome(c.job.job_id, kv_len=6, window=draws), 0)
    assert TruncateKv("s1", 5) in out
    assert list(pushed(out).activation.token_ids) == [5, 7, 8]
    assert proposer.tokens == [10, 11, 12, 13, 7, 5]


# --------------------------------------------------------------------------- windows in flight


def computes(actions: list) -> list[Compute]:
    return [a for a in actions if isinstance(a, Compute)]


def all_pushed(actions: list) -> list[frame_pb2.Frame]:
    return [f for a in actions if isinstance(a, Push) for f in a.frames]


def feed_window(h: Harness, window: frame_pb2.Frame, *, first: bool = False) -> list:
    """A pushed window as it reaches this stage (the same positions, tokens, drafts and number)."""
    tokens = list(window.activation.token_ids)
    start = int(window.positions.start)
    frames = codec.step_frames(
        h.header(),
        frame_pb2.PHASE_DECODE,
        step_id=1 + start + 1,
        start=start,
        token_ids=tokens,
        hidden=None if first else np.ones((len(tokens), N_EMBD), np.float32),
        sample=True,
        drafts=int(window.activation.drafts),
        window_gen=int(window.activation.window_gen),
    )
    return h.feed(frames[0])


def last_stage_in_flight(windows: int) -> Harness:
    h = Harness(is_last=True, shard_start=4, shard_end=8, windows_in_flight=windows)
    frame = codec.open_frame(
        h.header(),
        step_id=1,
        route_ticket=b"good",
        kv_budget_tokens=40,
        sampling=codec.SamplingSettings(temperature=0.0),
        ring=RING,
        max_drafts=4,
    )
    assert codec.body_kind(sends(h.feed(frame))[0]) == "open_ack"
    return h


def test_the_last_stage_keeps_windows_in_flight_and_discards_them_on_a_rejection() -> None:
    h = last_stage_in_flight(2)
    (c,) = computes(feed_step(h, 0, PROMPT))
    # The first window leaves alone: windows follow a head only after a window accepted all its drafts.
    (first,) = all_pushed(h.m.complete(StepOutcome(c.job.job_id, kv_len=6, sampled=Sampled(1, -0.1)), 0))
    (c,) = computes(feed_window(h, first))
    toks = list(first.activation.token_ids)
    draws = tuple(Sampled(t, -0.1) for t in [*toks[1:], 2])
    out = h.m.complete(StepOutcome(c.job.job_id, kv_len=first.positions.end, window=draws), 0)
    head, nxt = all_pushed(out)
    # Now two windows leave at once: the second continues the first's drafts as if all were accepted.
    gen = head.activation.window_gen
    assert gen > first.activation.window_gen and head.activation.token_ids[0] == 2
    assert gen >= 1 and nxt.activation.window_gen == gen
    assert head.positions.start == first.positions.end and nxt.positions.start == head.positions.end
    assert nxt.activation.drafts == len(nxt.activation.token_ids) - 1
    # The head comes back; the next window arrives while it computes and waits behind it.
    (c,) = computes(feed_window(h, head))
    assert computes(feed_window(h, nxt)) == []
    # Every draft accepted and the draw after the last one is the next window's first token: it goes on
    # (no new head), it starts computing, and a third window follows it.
    toks = list(head.activation.token_ids)
    draws = tuple(Sampled(t, -0.1) for t in [*toks[1:], nxt.activation.token_ids[0]])
    out = h.m.complete(StepOutcome(c.job.job_id, kv_len=head.positions.end, window=draws), 0)
    assert not [a for a in out if isinstance(a, TruncateKv)]
    (result,) = [f for f in sends(out) if codec.body_kind(f) == "result"]
    assert [t.token_id for t in result.result.sampled] == [*toks[1:], nxt.activation.token_ids[0]]
    (third,) = all_pushed(out)
    assert third.activation.window_gen == gen and third.positions.start == nxt.positions.end
    (c,) = computes(out)
    assert c.job.start == nxt.positions.start
    # The next window's first draft is wrong: the KV keeps its first position and the correction
    # leaves as a new head (a higher number); the third window, still on the way, is discarded.
    ntoks = list(nxt.activation.token_ids)
    wrong = 1000 + ntoks[1] if len(ntoks) > 1 else 1000
    draws = tuple(Sampled(wrong if i == 0 else 7, -0.1) for i in range(len(ntoks)))
    out = h.m.complete(StepOutcome(c.job.job_id, kv_len=nxt.positions.end, window=draws), 0)
    keep = nxt.positions.start + 1
    assert (TruncateKv("s1", keep) in out) == (nxt.positions.end > keep)
    heads = all_pushed(out)
    assert heads[0].activation.window_gen > gen and heads[0].positions.start == keep
    assert heads[0].activation.token_ids[0] == wrong
    assert feed_window(h, third) == []  # a discarded window: dropped unanswered, the KV untouched
    assert h.m.kv_len("s1") == keep
    (c,) = computes(feed_window(h, heads[0]))  # the new head computes on the accepted tokens
    assert c.job.start == keep


def test_a_stage_drops_discarded_windows_and_rolls_back_to_a_new_head_after_the_running_step() -> None:
    h = first_stage()  # holds 4
    window = codec.step_frames(
        h.header(), frame_pb2.PHASE_DECODE, step_id=6, start=4, token_ids=[9, 1, 2], sample=True, drafts=2
    )[0]
    window.activation.window_gen = 1
    (c,) = computes(feed_window(h, window, first=True))
    h.m.complete(StepOutcome(c.job.job_id, kv_len=7, hidden=np.ones((3, N_EMBD), np.float32)), 0)
    # Two windows in flight after it: one computing, one waiting.
    cont = codec.step_frames(
        h.header(), frame_pb2.PHASE_DECODE, step_id=8, start=7, token_ids=[3, 4], sample=True, drafts=1
    )[0]
    cont.activation.window_gen = 1
    (busy,) = computes(feed_window(h, cont, first=True))
    later = codec.step_frames(
        h.header(), frame_pb2.PHASE_DECODE, step_id=10, start=9, token_ids=[5], sample=True
    )[0]
    later.activation.window_gen = 1
    assert computes(feed_window(h, later, first=True)) == []
    # The last stage rejected the first window at 5: a new head (number 2) from there. It waits for
    # the running step; the waiting window is discarded.
    head = codec.step_frames(
        h.header(), frame_pb2.PHASE_DECODE, step_id=6, start=5, token_ids=[7, 8], sample=True, drafts=1
    )[0]
    head.activation.window_gen = 2
    out = feed_window(h, head, first=True)
    assert computes(out) == [] and sends(out) == []
    # A head that would drop a position below the last head's start + 1 is refused; nothing changes.
    below = codec.step_frames(
        h.header(), frame_pb2.PHASE_DECODE, step_id=5, start=4, token_ids=[7], sample=True
    )[0]
    below.activation.window_gen = 3
    assert status_of(feed_window(h, below, first=True)) == status_pb2.STATUS_POSITION_MISMATCH
    # The running (discarded) step finishes: the KV goes back to 5 before the head computes.
    out = h.m.complete(StepOutcome(busy.job.job_id, kv_len=9, hidden=np.ones((2, N_EMBD), np.float32)), 0)
    (trunc,) = [a for a in out if isinstance(a, TruncateKv)]
    (c,) = computes(out)
    assert trunc == TruncateKv("s1", 5) and out.index(trunc) < out.index(c)
    assert c.job.start == 5 and h.m.kv_len("s1") == 5
    h.m.complete(StepOutcome(c.job.job_id, kv_len=7, hidden=np.ones((2, N_EMBD), np.float32)), 0)
    # The same head again (a duplicate) is answered from the cache; a discarded window is dropped.
    again = feed_window(h, head, first=True)
    assert computes(again) == [] and h.m.kv_len("s1") == 7
    assert feed_window(h, later, first=True) == []
    assert h.m.kv_len("s1") == 7


class SevensProposer:
    """A stand-in for the draft model in the machine's harness: it follows the history (feeding the
    n-gram proposer it wraps, as the real one does) and always proposes 7s."""

    def __init__(self, ngram: NgramProposer) -> None:
        self.ngram = ngram

    @property
    def length(self) -> int:
        return self.ngram.length

    def extend(self, tokens: Sequence[int]) -> None:
        self.ngram.extend(tokens)

    def truncate(self, length: int) -> None:
        self.ngram.truncate(length)

    def propose(self, k: int) -> tuple[int, ...]:
        return (7,) * k


def first_window(proposer: int, with_model: bool) -> tuple[Harness, frame_pb2.Frame]:
    """The first window of a session whose request chose ``proposer``, on a last stage with or without
    a draft model."""
    h = Harness(is_last=True, shard_start=4, shard_end=8)
    h.m = FrameServer(h.spec, lambda *_: None, proposers=SevensProposer if with_model else None)
    h.conn = h.m.connect()
    frame = codec.open_frame(
        h.header(),
        step_id=1,
        route_ticket=b"good",
        kv_budget_tokens=40,
        sampling=codec.SamplingSettings(temperature=0.0, proposer=proposer),
        ring=RING,
        max_drafts=3,
    )
    assert codec.body_kind(sends(h.feed(frame))[0]) == "open_ack"
    (c,) = [a for a in feed_step(h, 0, PROMPT) if isinstance(a, Compute)]
    return h, pushed(h.m.complete(StepOutcome(c.job.job_id, kv_len=6, sampled=Sampled(1, -0.1)), 0))


def test_the_request_chooses_the_proposer_and_without_a_draft_model_ngram_drafts() -> None:
    ngram, model = [1, 2, 3, 1], [1, 7, 7, 7]  # "2 3 1" occurred before, after 1; the model's 7s
    want = {
        (frame_pb2.PROPOSER_NGRAM, True): (ngram, "ngram"),
        (frame_pb2.PROPOSER_DRAFT, True): (model, "draft"),
        (frame_pb2.PROPOSER_UNSPECIFIED, True): (model, "draft"),  # the node's own: its model
        (9, True): (model, "draft"),  # a value this node does not know: as unspecified
        (frame_pb2.PROPOSER_NGRAM, False): (ngram, "ngram"),
        (frame_pb2.PROPOSER_DRAFT, False): (ngram, "draft_unavailable"),  # no model here: said so
        (frame_pb2.PROPOSER_UNSPECIFIED, False): (ngram, "ngram"),
    }
    for (proposer, with_model), (tokens, kind) in want.items():
        h, window = first_window(proposer, with_model)
        assert list(window.activation.token_ids) == tokens, (proposer, with_model)
        assert h.m.statistics().spec_proposers == {kind: 1}, (proposer, with_model)
