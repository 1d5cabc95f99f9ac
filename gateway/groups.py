"""Unwrap trio's exception groups where exactly one exception is inside.

trio nurseries always wrap what escapes them in an ``ExceptionGroup``
(strict exception groups). Where a nursery only supports the body -- a
task next to a stream, parallel look-ups that each either succeed or raise
one ``GatewayError`` -- callers want the one exception, so that
``except StageFailed`` and the HTTP error mapping keep working. Several
exceptions stay grouped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


@contextmanager
def single_exception() -> Iterator[None]:
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if len(leaves) == 1:
            raise leaves[0] from None
        raise
