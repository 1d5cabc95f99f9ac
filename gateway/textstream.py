"""Incremental detokenizer with stop strings (pure, sans-IO).

Tokens arrive one at a time as raw bytes (a token may hold part of a
multi-byte UTF-8 character); text must leave as soon as it is certain, and
never include a stop string or anything after it.

:class:`TextStream` state and invariants::

    bytes --(incremental UTF-8 decoder)--> text  = all decoded characters so far
    text[:sent]           already emitted; never changes, never contains a stop string
    text[sent:]           held back: an incomplete character is still in the decoder,
                          or the tail could be the beginning of a stop string
    token i covers        text[starts[i]:ends[i]] (empty while its bytes end mid-character)

* ``push(piece)`` returns the newly certain text and the logprob entries of the
  tokens whose text is now wholly emitted, or, when a stop string completes,
  the text before it and ``stopped=True``; after that, nothing more.
* ``finish()`` flushes what was held back (an incomplete trailing character
  becomes U+FFFD, as the reference detokenizer does with ``errors="replace"``).
* The concatenation of everything emitted equals ``decode(all bytes)`` cut
  before the first occurrence of any stop string (property-tested).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Emission(Generic[T]):
    text: str
    tokens: tuple[T, ...]  # payloads of the tokens this emission completes, in order
    stopped: bool = False


class TextStream(Generic[T]):
    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        self._sent = 0
        self._searched = 0  # stop strings cannot start before this index
        self._pending: list[tuple[int, int, T]] = []  # (start, end, payload) not yet released
        self.stopped = False
        self.finished = False

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text[: self._sent]

    def _hold_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        tail = self._text[-self._longest :] if self._longest else ""
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(tail)), best, -1):
                if tail.endswith(stop[:k]):
                    best = k
                    break
        return best

    def _release(self, upto: int, *, everything: bool = False) -> tuple[T, ...]:
        done: list[T] = []
        keep: list[tuple[int, int, T]] = []
        for start, end, payload in self._pending:
            if end <= upto or everything:
                done.append(payload)
            else:
                keep.append((start, end, payload))
        self._pending = keep
        return tuple(done)

    def push(self, piece: bytes, payload: T) -> Emission[T]:
        if self.stopped or self.finished:
            return Emission("", ())
        start = len(self._text)
        self._text += self._decoder.decode(piece)
        self._pending.append((start, len(self._text), payload))
        if self._stops:
            first = -1
            begin = max(0, self._searched - self._longest + 1)
            for stop in self._stops:
                at = self._text.find(stop, begin)
                if at >= 0 and (first < 0 or at < first):
                    first = at
            self._searched = len(self._text)
            if first >= 0:
                self.stopped = True
                out = self._text[self._sent : first]
                self._sent = first
                self._text = self._text[:first]
                # Tokens that contributed visible text before the stop keep their logprobs.
                done = tuple(p for s, _e, p in self._pending if s < first)
                self._pending = []
                return Emission(out, done, stopped=True)
        safe = len(self._text) - self._hold_back()
        out = self._text[self._sent : safe] if safe > self._sent else ""
        self._sent = max(self._sent, safe)
        return Emission(out, self._release(self._sent))

    def finish(self) -> Emission[T]:
        """End of generation (length or end-of-generation token): flush everything held back."""
        if self.stopped or self.finished:
            return Emission("", ())
        self.finished = True
        self._text += self._decoder.decode(b"", final=True)
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return Emission(out, self._release(self._sent, everything=True))
