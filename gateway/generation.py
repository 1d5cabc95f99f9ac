"""One choice's generation, reduced (pure): sampled tokens in, the events the client sees out.

A choice's state (:class:`Choice`) survives a move to another route: the tokens sampled so far,
the text stream (stop strings held back until they cannot match, logprob entries aligned with the
text they produced) and the tool-call stream (text that may be a tool call held back until it is
one or is not). :meth:`Choice.take` folds one sampled token in and says what goes to the client,
in order, and whether the choice is over:

* **End of generation** (the node's flag, or an end-of-generation token): the held-back tail, the
  tool stream's rest, :class:`ChoiceEnd`; over, ``stop`` (``tool_calls`` where it made calls).
* **A piece that completes a stop string**: the text before the stop, the tool stream's rest,
  ``ChoiceEnd``; over, ``stop`` (or ``tool_calls``).
* **The ``max_new``-th token**: its text, the held-back tail, the rest, ``ChoiceEnd``; over,
  ``length`` (or ``tool_calls``).
* **Any other**: its text where it is not held back (:class:`Delta`, with its logprob entry); it
  goes on.

The end-of-generation token itself is never text. Logprob entries ride on the delta whose text
their token released (a held-back token's entry goes out with its text, later).

The events (:class:`Delta`, :class:`ChoiceEnd`, then the request's :class:`Finished` or
:class:`Failed`) are what the HTTP side renders (``gateway/openai_http.py``, ``client_apis.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.errors import GatewayError
from gateway.protocol import TokenLogprob, ToolCall
from gateway.textstream import TextStream
from gateway.tools import ToolStream
from proto.codec import Sampled


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...]
    index: int = 0  # the choice


@dataclass(frozen=True)
class ChoiceEnd:
    """One choice is complete (before ``Finished``): why, and the tool calls it made."""

    index: int
    finish_reason: str  # "stop", "length" or "tool_calls"
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # choice 0's: "stop", "length" or "tool_calls"
    prompt_tokens: int
    completion_tokens: int  # all choices


@dataclass(frozen=True)
class Failed:
    error: GatewayError
    prompt_tokens: int
    completion_tokens: int


Event = Delta | ChoiceEnd | Finished | Failed


class Pieces(Protocol):
    """What the reducer reads of a model's vocabulary (``gateway.vocab_store.LoadedVocab``)."""

    @property
    def eog(self) -> frozenset[int]: ...

    @property
    def token_bytes(self) -> Sequence[bytes]: ...

    @property
    def n_vocab(self) -> int: ...


def piece(vocab: Pieces, token: int) -> bytes:
    """A token's bytes (nothing for an id outside the vocabulary)."""
    return vocab.token_bytes[token] if 0 <= token < vocab.n_vocab else b""


def logprob_entry(vocab: Pieces, sampled: Sampled, n_top: int) -> TokenLogprob:
    """The client's logprob entry of a sampled token, with its ``n_top`` alternatives."""
    raw = piece(vocab, sampled.token_id)
    top = tuple(
        (piece(vocab, t).decode("utf-8", "replace"), piece(vocab, t), lp)
        for t, lp in sampled.top_logprobs[:n_top]
    )
    return TokenLogprob(raw.decode("utf-8", "replace"), raw, sampled.logprob, top)


@dataclass
class Choice:
    """What one choice of a request has produced so far (see the module docstring)."""

    text: TextStream[TokenLogprob | None]
    index: int = 0
    tool_stream: ToolStream | None = None
    generated: list[int] = field(default_factory=list)  # every sampled token, streamed or end-of-generation

    def take(
        self, sampled: Sampled, vocab: Pieces, *, max_new: int, n_top: int | None = None
    ) -> tuple[list[Delta | ChoiceEnd], str | None]:
        """Fold in one sampled token: the events it causes, in order, and the finish reason when the
        choice is over (None: it goes on). ``n_top``: logprob entries with that many alternatives
        (None: no logprobs asked for)."""
        token = sampled.token_id
        self.generated.append(token)
        out: list[Delta | ChoiceEnd] = []
        if sampled.end_of_generation or token in vocab.eog:
            tail = self.text.finish()
            return out, self._end(out, tail.text, tail.tokens, "stop")
        entry = logprob_entry(vocab, sampled, n_top) if n_top is not None else None
        pushed = self.text.push(piece(vocab, token), entry)
        self._emit(out, pushed.text, pushed.tokens)
        if pushed.stopped:
            return out, self._end(out, "", (), "stop")
        if len(self.generated) >= max_new:
            tail = self.text.finish()
            return out, self._end(out, tail.text, tail.tokens, "length")
        return out, None

    def _end(
        self, out: list[Delta | ChoiceEnd], text: str, entries: tuple[TokenLogprob | None, ...], reason: str
    ) -> str:
        """The choice's last text, then its end (with the tool calls it made)."""
        self._emit(out, text, entries)
        calls: tuple[ToolCall, ...] = ()
        if self.tool_stream is not None:
            rest, calls = self.tool_stream.finish()
            self._emit(out, rest, (), raw=True)
        if calls:
            reason = "tool_calls"
        out.append(ChoiceEnd(self.index, reason, calls))
        return reason

    def _emit(
        self,
        out: list[Delta | ChoiceEnd],
        text: str,
        entries: tuple[TokenLogprob | None, ...],
        *,
        raw: bool = False,
    ) -> None:
        logprobs = tuple(e for e in entries if e is not None)
        if self.tool_stream is not None and not raw:
            text = self.tool_stream.push(text)
        if text or logprobs:
            out.append(Delta(text, logprobs, self.index))
