"""gateway/generation.py: one choice's sampled tokens reduced to the events a client sees (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from gateway.generation import Choice, ChoiceEnd, Delta
from gateway.protocol import Tool
from gateway.textstream import TextStream
from gateway.tools import ToolStream
from proto.codec import Sampled

WORDS = [
    "Hello",
    ",",
    " world",
    "!",
    " STOP",
    " more",
    "<tool_call>",
    '{"name": "f", "arguments": {}}',
    "</tool_call>",
]
EOG = len(WORDS)  # the end-of-generation token: no text of its own


@dataclass(frozen=True)
class Vocab:
    token_bytes: tuple[bytes, ...] = tuple(w.encode() for w in WORDS) + (b"<eog>",)
    n_vocab: int = len(WORDS) + 1
    eog: frozenset[int] = frozenset({EOG})


VOCAB = Vocab()


def tok(i: int, lp: float = -0.5) -> Sampled:
    return Sampled(i, lp, ((i, lp), (0, -3.0)))


def run(
    choice: Choice, tokens: list[int], max_new: int = 100, n_top: int | None = None
) -> tuple[list, str | None]:
    events: list = []
    for t in tokens:
        out, reason = choice.take(tok(t), VOCAB, max_new=max_new, n_top=n_top)
        events += out
        if reason is not None:
            return events, reason
    return events, None


def text_of(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def test_end_of_generation_ends_with_stop_and_is_never_text() -> None:
    c = Choice(TextStream(()))
    events, reason = run(c, [0, 1, 2, EOG, 3])
    assert reason == "stop" and text_of(events) == "Hello, world"
    assert events[-1] == ChoiceEnd(0, "stop", ())
    assert c.generated == [0, 1, 2, EOG]  # the end token counts as generated, nothing after it


def test_the_nodes_end_flag_ends_it_too() -> None:
    c = Choice(TextStream(()), index=2)
    out, reason = c.take(Sampled(3, -0.1, (), end_of_generation=True), VOCAB, max_new=10)
    assert reason == "stop" and out == [ChoiceEnd(2, "stop", ())]


def test_a_stop_string_cuts_the_text_before_it() -> None:
    c = Choice(TextStream([" STOP"]))
    events, reason = run(c, [0, 2, 4, 5])
    assert reason == "stop" and text_of(events) == "Hello world"


def test_max_new_ends_with_length_after_its_text() -> None:
    c = Choice(TextStream(()))
    events, reason = run(c, [0, 1, 2, 3], max_new=3)
    assert reason == "length" and text_of(events) == "Hello, world"
    assert isinstance(events[-2], Delta) and events[-1] == ChoiceEnd(0, "length", ())


def test_logprob_entries_ride_with_their_text_and_only_when_asked() -> None:
    plain = Choice(TextStream(()))
    events, _ = run(plain, [0, 2, EOG])
    assert all(e.logprobs == () for e in events if isinstance(e, Delta))
    asked = Choice(TextStream(()))
    events, _ = run(asked, [0, 2, EOG], n_top=1)
    entries = [lp for e in events if isinstance(e, Delta) for lp in e.logprobs]
    assert [e.token for e in entries] == ["Hello", " world"]
    assert all(len(e.top) == 1 for e in entries)


def test_a_tool_call_is_held_back_and_ends_the_choice_with_tool_calls() -> None:
    c = Choice(TextStream(()), tool_stream=ToolStream([Tool("f", "", {"type": "object"})]))
    events, reason = run(c, [0, 6, 7, 8, EOG])
    assert reason == "tool_calls" and text_of(events) == "Hello"
    end = events[-1]
    assert isinstance(end, ChoiceEnd) and [call.name for call in end.tool_calls] == ["f"]


@given(st.lists(st.integers(0, EOG), max_size=30), st.integers(1, 30))
def test_the_text_streamed_is_the_pieces_up_to_the_end_and_one_choice_end_closes_it(
    tokens: list[int], max_new: int
) -> None:
    c = Choice(TextStream([" STOP"]))
    events, reason = run(c, tokens, max_new=max_new)
    ends = [e for e in events if isinstance(e, ChoiceEnd)]
    taken = c.generated
    assert taken == tokens[: len(taken)]
    whole = "".join(WORDS[t] for t in taken if t != EOG)
    if reason is None:
        assert ends == [] and whole.startswith(text_of(events))  # a tail may be held back yet
    else:
        assert len(ends) == 1 and events[-1] is ends[0]
        assert text_of(events) == whole.split(" STOP")[0]
        want = "stop" if taken[-1] == EOG or " STOP" in whole else "length"
        assert reason == want and (want == "stop" or len(taken) == max_new)
