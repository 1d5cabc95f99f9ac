"""JSON from clients: parsed with a clear 400 for what Python's ``json`` accepts but nothing downstream can
use.

Pure module (standard library and :mod:`tracker.errors` only). Two things get through ``json.loads``
and then fail far from the input, as a 500, if nobody looks:

- a lone UTF-16 surrogate written as an escape (``"\\ud800"``) decodes to a ``str`` that cannot be
  encoded as UTF-8: the database driver, the logs and every JSON answer then fail;
- nesting deep enough to exhaust the parser's recursion (``RecursionError``), or deep but parseable
  nesting that recursive code later walks.

:func:`check_json` walks a decoded value without recursion and refuses both, naming the path.
"""

from __future__ import annotations

import json
from typing import Any

from tracker.errors import BadRequest

MAX_JSON_DEPTH = 32  # the deepest body or signed payload any endpoint takes is under 8 levels


def _check_str(value: str, path: str) -> None:
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadRequest(
            f"{path or 'the body'} holds a lone UTF-16 surrogate (not valid Unicode text)"
        ) from err


def check_json(value: Any, *, max_depth: int = MAX_JSON_DEPTH, what: str = "request body") -> None:
    """Raise :class:`BadRequest` when ``value`` nests deeper than ``max_depth`` or holds a string
    (value or key) with a lone surrogate."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            _check_str(item, path)
        elif isinstance(item, dict | list):
            if depth >= max_depth:
                raise BadRequest(f"{what} is nested deeper than {max_depth} levels")
            if isinstance(item, dict):
                for k, v in item.items():
                    _check_str(k, path)
                    stack.append((v, depth + 1, f"{path}.{k}" if path else k))
            else:
                stack.extend((v, depth + 1, f"{path}[]") for v in item)


def parse_json(body: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode a request body; any problem is a :class:`BadRequest` that says which."""
    try:
        value = json.loads(body)
    except RecursionError as err:
        raise BadRequest(f"request body is nested deeper than {max_depth} levels") from err
    except (UnicodeDecodeError, ValueError) as err:
        raise BadRequest("request body is not valid JSON") from err
    check_json(value, max_depth=max_depth)
    return value
