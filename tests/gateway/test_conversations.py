"""The conversation store and compaction search (gateway/conversations.py): pure, no swarm."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.conversations import (
    ConversationBusy,
    ConversationFull,
    ConversationGone,
    ConversationLimits,
    ConversationStore,
    DropSearch,
    exchange_starts,
    merge,
    prompt_of,
)
from gateway.protocol import ChatMessage

SYS = ChatMessage("system", "You are terse.")


def user(text: str) -> ChatMessage:
    return ChatMessage("user", text)


def bot(text: str) -> ChatMessage:
    return ChatMessage("assistant", text)


def test_merge_tells_new_messages_from_a_whole_history() -> None:
    kept = (SYS, user("a"), bot("A"))
    assert merge((), (SYS, user("a"))) == ((SYS, user("a")), "start")
    assert merge(kept, (user("b"),)) == ((*kept, user("b")), "new")
    assert merge(kept, (*kept, user("b"))) == ((*kept, user("b")), "whole")
    # A whole history that edited a later message is taken as sent.
    assert merge(kept, (SYS, user("x"), bot("X"), user("b")))[1] == "whole"


def test_prompt_of_keeps_system_messages_and_puts_the_summary_after_them() -> None:
    history = (SYS, user("a"), bot("A"), user("b"), bot("B"), user("c"))
    assert prompt_of(history, 0, "") == history
    assert prompt_of(history, 2, "") == (SYS, user("b"), bot("B"), user("c"))
    summarized = prompt_of(history, 4, "they said a and b")
    assert (
        summarized[0] == SYS
        and summarized[1].role == "system"
        and "they said a and b" in summarized[1].content
    )
    assert summarized[2:] == (user("c"),)
    assert exchange_starts(history) == [0, 2, 4] and exchange_starts(history, 2) == [2, 4]


def _history(turns: list[tuple[int, int]]) -> tuple[ChatMessage, ...]:
    out: list[ChatMessage] = [SYS]
    for i, (q, a) in enumerate(turns):
        out.append(user(f"q{i}" + "x" * q))
        if a:
            out.append(bot(f"a{i}" + "y" * a))
    return tuple(out)


def _size(messages: tuple[ChatMessage, ...]) -> int:
    return sum(len(m.content) for m in messages)


@settings(max_examples=300, deadline=None)
@given(
    turns=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=12),
    budget=st.integers(10, 400),
    dropped_before=st.integers(0, 3),
)
def test_drop_search_finds_the_fewest_whole_exchanges_that_fit(
    turns: list[tuple[int, int]], budget: int, dropped_before: int
) -> None:
    history = _history(turns)
    starts = exchange_starts(history)
    dropped_before = starts[min(dropped_before, len(starts) - 1)]

    def fits(dropped: int) -> bool:
        return _size(prompt_of(history, dropped, "")) <= budget

    search = DropSearch(history, dropped_before)
    measured = 0
    while (candidate := search.candidate()) is not None:
        search.answer(fits(candidate))
        measured += 1
    # The counts that leave out at least one more whole exchange; the largest still keeps the last one.
    allowed = exchange_starts(history, dropped_before)[1:]
    if not allowed or not fits(allowed[-1]):
        with pytest.raises(ConversationFull):
            search.result()
        return
    got = search.result()
    assert got == min(s for s in allowed if fits(s))
    assert fits(got) and got > dropped_before
    assert prompt_of(history, got, "")[-1] == history[-1]
    assert measured <= 2 + len(allowed).bit_length()


def test_store_bounds_order_and_isolation() -> None:
    store = ConversationStore(ConversationLimits(max_per_owner=2, max_waiting_turns=1, idle_ttl_s=100))
    a = store.enter("alice", "c1", now=0)
    turn = store.begin(a, (SYS, user("hi")))
    store.commit(turn, bot("hello"), 0, "")
    store.leave(a, now=1)
    assert store.get("bob", "c1") is None  # another owner never sees it
    again = store.enter("alice", "c1", now=2)
    assert store.begin(again, (user("more"),)).history == (SYS, user("hi"), bot("hello"), user("more"))
    # Turns queued past the bound are refused; the running one is untouched.
    store.enter("alice", "c1", now=2)
    with pytest.raises(ConversationBusy):
        store.enter("alice", "c1", now=2)
    store.leave(again, now=3)
    store.leave(again, now=3)
    # A third conversation evicts the least recently used idle one of the same owner.
    store.enter("alice", "c2", now=4)
    store.leave(store.get("alice", "c2"), now=4)  # type: ignore[arg-type]
    store.enter("alice", "c3", now=5)
    assert store.get("alice", "c1") is None and store.evicted_total == 1
    with pytest.raises(ValueError):
        store.enter("alice", "bad id with spaces", now=5)


def test_a_gone_conversation_refuses_new_messages_and_restarts_from_a_whole_history() -> None:
    store = ConversationStore(ConversationLimits(idle_ttl_s=10))
    conv = store.enter("k", "chat", now=0)
    store.commit(store.begin(conv, (SYS, user("hi"))), bot("hello"), 0, "")
    store.leave(conv, now=0)
    later = store.enter("k", "chat", now=100)  # expired, made anew
    assert store.expired_total == 1
    with pytest.raises(ConversationGone):
        store.begin(later, (user("and then?"),))
    turn = store.begin(later, (SYS, user("hi"), bot("hello"), user("and then?")))
    assert turn.mode == "start" and len(turn.history) == 4
    assert store.refused == {"conversation_gone": 1}


def test_commit_keeps_the_compaction_for_later_turns_and_whole_histories() -> None:
    store = ConversationStore()
    conv = store.enter("k", "c", now=0)
    history = (SYS, user("a"), bot("A"), user("b"))
    turn = store.begin(conv, history)
    store.commit(turn, bot("B"), 2, "a was asked")
    assert conv.compactions == 1 and store.compactions_total == 1
    nxt = store.begin(conv, (user("c"),))
    assert (nxt.dropped, nxt.summary) == (2, "a was asked")
    whole = store.begin(conv, (*history, bot("B"), user("c")))
    assert whole.mode == "whole" and whole.dropped == 2
    edited = store.begin(conv, (SYS, user("z"), bot("Z"), user("c")))
    assert (edited.dropped, edited.summary) == (0, "")
    store.commit(nxt, bot("C"), 2, "a was asked")
    assert conv.compactions == 1  # the same compaction kept, not a new one
