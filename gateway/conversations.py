"""Conversations by id: the history the gateway keeps, turns in order, compaction (pure; no I/O, no clock).

A client names a conversation (``conversation_id`` in a chat request's body, or the
``X-Conversation-Id`` header) and may then send only the new messages of each turn:
the gateway keeps the history and runs the whole of it as the prompt. It may also
send the whole history every time, as plain OpenAI clients do. Which one a turn sent
is decided by :func:`merge`:

======================================  =========================================
the incoming messages ...               the turn's history
======================================  =========================================
(the conversation is new)                the incoming messages ("start")
start with the kept history's first      the incoming messages, as sent ("whole")
message (same role, content, calls)
anything else                            the kept history + the incoming ("new")
======================================  =========================================

A conversation that expired or was evicted is remembered (bounded): a later turn
that does not start with its first message -- so it sent only new messages, and
the history they extend is gone -- is refused with ``conversation_gone`` (409); one
that does restarts it from what was sent. A client that sends only new messages
and repeats the conversation's very first message verbatim is read as sending the
whole history: documented, rare.

Compaction. The kept history is never rewritten; the prompt the model sees is
:func:`prompt_of` it: the leading system messages, then (policy ``summary``) a
system message with the model's own summary of what was left out, then the history
after the ``dropped`` messages that follow the system ones. When a turn's prompt
plus its ``max_tokens`` does not fit the largest context the swarm serves now,
:class:`DropSearch` finds the fewest further whole exchanges (a user message and
what follows it up to the next one) to leave out -- never the turn's last exchange.
Policy ``drop_oldest`` leaves them out; ``summary`` has the model summarize them
(with the earlier summary) first (the shell, :mod:`gateway.conversation_turns`). A
turn whose system messages and last exchange alone do not fit is refused:
``conversation_full`` (409). A client that sends the whole history gets the same
compaction again for the part it shares with the kept history.

Bounds: conversations per owner (the least recently used idle one is evicted
first) and in all, messages and characters per conversation, turns queued per
conversation, an idle TTL, remembered ids. Isolation: a conversation is found only
under the owner that made it (the client key: a hash of the API key, else the
client's address).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.protocol import CONVERSATION_ID, ChatMessage

POLICIES = ("drop_oldest", "summary")
SUMMARY_PREFIX = "Summary of the earlier part of this conversation: "


class ConversationError(Exception):
    """A conversation turn that cannot go on; ``code`` is the error code clients see."""

    code = "conversation_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConversationGone(ConversationError):
    code = "conversation_gone"


class ConversationFull(ConversationError):
    code = "conversation_full"


class ConversationBusy(ConversationError):
    code = "conversation_busy"


@dataclass(frozen=True)
class ConversationLimits:
    max_per_owner: int = 64
    max_total: int = 10_000
    idle_ttl_s: float = 3600.0
    max_messages: int = 2_000
    max_chars: int = 4_000_000
    max_waiting_turns: int = 4
    tombstones: int = 10_000

    def __post_init__(self) -> None:
        for name in ("max_per_owner", "max_total", "max_messages", "max_chars", "tombstones"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.idle_ttl_s <= 0 or self.max_waiting_turns < 0:
            raise ValueError("idle_ttl_s must be > 0 and max_waiting_turns >= 0")


@dataclass
class Conversation:
    owner: str
    conversation_id: str
    messages: tuple[ChatMessage, ...] = ()  # the history as the client sees it, never compacted
    dropped: int = 0  # messages after the leading system ones that the prompt leaves out
    summary: str = ""  # policy summary: the model's summary of those messages
    turns: int = 0
    compactions: int = 0
    last_used: float = 0.0
    waiting: int = 0  # turns queued or running (the shell's lock runs them in order)


@dataclass(frozen=True)
class Turn:
    """One turn: the history it extends (with its new messages) and the compaction it starts from."""

    conversation: Conversation
    history: tuple[ChatMessage, ...]
    mode: str  # "start", "whole" or "new"
    dropped: int
    summary: str


def _chars(messages: Sequence[ChatMessage]) -> int:
    return sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in messages)


def merge(
    kept: Sequence[ChatMessage], incoming: Sequence[ChatMessage]
) -> tuple[tuple[ChatMessage, ...], str]:
    """The turn's whole history from the kept history and what the request sent (the table above)."""
    if not kept:
        return tuple(incoming), "start"
    if incoming and incoming[0] == kept[0]:
        return tuple(incoming), "whole"
    return (*kept, *incoming), "new"


def leading_system(messages: Sequence[ChatMessage]) -> int:
    n = 0
    while n < len(messages) and messages[n].role in ("system", "developer"):
        n += 1
    return n


def prompt_of(history: Sequence[ChatMessage], dropped: int, summary: str) -> tuple[ChatMessage, ...]:
    """What the model sees: the leading system messages, the summary (if any), then the history after
    the ``dropped`` messages that follow the system ones."""
    head = leading_system(history)
    extra = (ChatMessage("system", SUMMARY_PREFIX + summary),) if summary else ()
    return (*history[:head], *extra, *history[head + dropped :])


def exchange_starts(history: Sequence[ChatMessage], dropped: int = 0) -> list[int]:
    """Where the exchanges still in the prompt start, as ``dropped`` counts: the first kept message,
    then every later user message."""
    head = leading_system(history)
    first = head + dropped
    return [i - head for i in range(first, len(history)) if i == first or history[i].role == "user"]


def kept_compaction(conv: Conversation, history: Sequence[ChatMessage]) -> tuple[int, str]:
    """The compaction a turn starts from: the conversation's, when the turn's history still begins
    with every message it left out (a "whole" turn may have edited them: then none)."""
    head = leading_system(conv.messages)
    if conv.dropped and tuple(history[: head + conv.dropped]) == conv.messages[: head + conv.dropped]:
        return conv.dropped, conv.summary
    return 0, ""


class DropSearch:
    """How many of the oldest messages a prompt must leave out to fit: a bisection over whole
    exchanges, driven by the shell's answers (sans-IO: the shell measures each candidate, a template
    render and a tokenization, O(log n) times).

    ``candidate()`` is the next ``dropped`` count to measure (None once decided); ``answer(fits)`` says
    whether the prompt with that many left out fits; ``result()`` is the smallest count that fits, or
    raises ConversationFull when even leaving out every exchange but the last does not."""

    def __init__(self, history: Sequence[ChatMessage], dropped: int) -> None:
        self._starts = exchange_starts(history, dropped)
        self._lo, self._hi = 1, len(self._starts) - 1  # indices into _starts: at least one more, not the last
        self._full = self._hi < self._lo
        self._checked_hi = False

    def candidate(self) -> int | None:
        if self._full:
            return None
        if not self._checked_hi:
            return self._starts[self._hi]
        if self._lo >= self._hi:
            return None
        return self._starts[(self._lo + self._hi) // 2]

    def answer(self, fits: bool) -> None:
        if self._full:
            return
        if not self._checked_hi:
            self._checked_hi = True
            self._full = not fits
            return
        mid = (self._lo + self._hi) // 2
        if fits:
            self._hi = mid
        else:
            self._lo = mid + 1

    def result(self) -> int:
        if self._full:
            raise ConversationFull(
                "the conversation's system messages and its last exchange alone do not fit the largest "
                "context the swarm serves now; start a new conversation or shorten the last message"
            )
        if self.candidate() is not None:
            raise RuntimeError("DropSearch.result() before the search ended")
        return self._starts[self._hi]


@dataclass
class ConversationStore:
    """Every conversation of this gateway, by owner and id; bounded, expired when idle."""

    limits: ConversationLimits = field(default_factory=ConversationLimits)
    _live: OrderedDict[tuple[str, str], Conversation] = field(default_factory=OrderedDict)
    _gone: OrderedDict[tuple[str, str], ChatMessage | None] = field(default_factory=OrderedDict)
    turns_total: int = 0
    compactions_total: int = 0
    evicted_total: int = 0
    expired_total: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def valid_id(conversation_id: str) -> bool:
        return CONVERSATION_ID.fullmatch(conversation_id) is not None

    def __len__(self) -> int:
        return len(self._live)

    def _refuse(self, err: ConversationError) -> ConversationError:
        self.refused[err.code] = self.refused.get(err.code, 0) + 1
        return err

    def _bury(self, key: tuple[str, str], conv: Conversation) -> None:
        self._gone[key] = conv.messages[0] if conv.messages else None
        self._gone.move_to_end(key)
        while len(self._gone) > self.limits.tombstones:
            self._gone.popitem(last=False)

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Drop conversations idle past the TTL (none with a turn queued or running); their keys."""
        out = []
        for key, conv in list(self._live.items()):
            if conv.waiting == 0 and now - conv.last_used > self.limits.idle_ttl_s:
                del self._live[key]
                self._bury(key, conv)
                self.expired_total += 1
                out.append(key)
        return out

    def _evict_one(self, owner: str | None) -> bool:
        for key, conv in self._live.items():  # least recently used first
            if conv.waiting == 0 and (owner is None or key[0] == owner):
                del self._live[key]
                self._bury(key, conv)
                self.evicted_total += 1
                return True
        return False

    def get(self, owner: str, conversation_id: str) -> Conversation | None:
        return self._live.get((owner, conversation_id))

    def enter(self, owner: str, conversation_id: str, now: float) -> Conversation:
        """The conversation a turn joins (made if new), counted as waiting until :meth:`leave`."""
        if not self.valid_id(conversation_id):
            raise ValueError("conversation_id must be 1-128 letters, digits and . _ : -")
        self.expire(now)
        key = (owner, conversation_id)
        conv = self._live.get(key)
        if conv is None:
            mine = sum(1 for k in self._live if k[0] == owner)
            if mine >= self.limits.max_per_owner and not self._evict_one(owner):
                raise self._refuse(ConversationBusy("every conversation of this client has a turn running"))
            if len(self._live) >= self.limits.max_total and not self._evict_one(None):
                raise self._refuse(ConversationBusy("the gateway holds as many conversations as it allows"))
            conv = Conversation(owner, conversation_id, last_used=now)
            self._live[key] = conv
        elif conv.waiting > self.limits.max_waiting_turns:
            raise self._refuse(
                ConversationBusy(f"{conv.waiting} turns of this conversation are already queued or running")
            )
        self._live.move_to_end(key)
        conv.waiting += 1
        conv.last_used = now
        return conv

    def leave(self, conv: Conversation, now: float) -> None:
        conv.waiting = max(0, conv.waiting - 1)
        conv.last_used = now

    def begin(self, conv: Conversation, incoming: Sequence[ChatMessage]) -> Turn:
        """The turn's history and starting compaction (call with the conversation's turn lock held)."""
        key = (conv.owner, conv.conversation_id)
        if not conv.messages and key in self._gone:
            first = self._gone[key]
            if first is None or not incoming or incoming[0] != first:
                raise self._refuse(
                    ConversationGone(
                        "this conversation expired or was evicted and its history is gone: send the whole "
                        "history to continue it, or use a new conversation_id"
                    )
                )
            del self._gone[key]
        history, mode = merge(conv.messages, incoming)
        if len(history) > self.limits.max_messages or _chars(history) > self.limits.max_chars:
            raise self._refuse(
                ConversationFull(
                    f"the conversation would hold more than {self.limits.max_messages} messages or "
                    f"{self.limits.max_chars} characters; start a new one"
                )
            )
        dropped, summary = kept_compaction(conv, history)
        return Turn(conv, history, mode, dropped, summary)

    def commit(self, turn: Turn, reply: ChatMessage, dropped: int, summary: str) -> None:
        """A turn answered: the history grows by the reply; the compaction is what the turn ran with."""
        conv = turn.conversation
        compacted = dropped > turn.dropped
        conv.messages = (*turn.history, reply)
        conv.dropped, conv.summary = dropped, summary
        conv.turns += 1
        self.turns_total += 1
        if compacted:
            conv.compactions += 1
            self.compactions_total += 1

    def statistics(self) -> dict[str, int]:
        return {
            "live": len(self._live),
            "turns_total": self.turns_total,
            "compactions_total": self.compactions_total,
            "evicted_total": self.evicted_total,
            "expired_total": self.expired_total,
        }
