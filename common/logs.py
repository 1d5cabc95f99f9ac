"""Structured logs for every service: one JSON object per line on stderr, one line per event that matters.

``event(log, "session_opened", session_id=..., budget=...)`` writes
``{"ts": 1795945132.913, "level": "info", "logger": "swarm.node.session",
"event": "session_opened", "session_id": "...", "budget": 512}``. Plain
``log.info("text")`` calls (llama.cpp's routed output, libraries) become
``{"event": "text"}``. Standard library only, so pure modules may use it.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

_FIELDS = "swarm_fields"

# Libraries that narrate: keep their warnings and errors only (each service logs one event instead).
_CHATTY = ("llama.cpp", "httpx", "httpcore", "gguf", "hypercorn.access", "alembic")


def event(logger: logging.Logger, name: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """Log one structured event (``fields`` become keys of the JSON line)."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={_FIELDS: fields})


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, at every depth; an exception alone is its own leaf."""
    inner = getattr(exc, "exceptions", None)
    if not isinstance(inner, tuple):
        return [exc]
    return [leaf for sub in inner for leaf in _leaves(sub)]


class SocketTeardownRace(logging.Filter):
    """hypercorn's one known teardown race, as one warning line instead of a traceback.

    When a client (or a relay node) goes away while the app is sending its last message, hypercorn's
    connection task shuts the socket's write side (``send_eof``) as the app's final send (quart's
    WebSocket close frame) reaches the same stream: trio refuses the second sender with
    ``BusyResourceError``, and hypercorn logs "Error in ASGI Framework" with a traceback. Nothing is
    lost (the peer is gone; the connection was closing anyway), so the record becomes the warning
    event ``socket_closed_while_sending``. Any other exception keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or record.getMessage() != "Error in ASGI Framework":
            return True
        leaves = _leaves(exc)
        if not all(
            type(e).__name__ == "BusyResourceError" and type(e).__module__.startswith("trio") for e in leaves
        ):
            return True
        record.msg, record.args = "socket_closed_while_sending", ()
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        setattr(record, _FIELDS, {"error": str(leaves[0]) or type(leaves[0]).__name__})
        return True


_TEARDOWN_RACE = SocketTeardownRace()


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        line.update(getattr(record, _FIELDS, {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, separators=(",", ":"))


def configure(level: str = "info") -> None:
    """Install the JSON-lines handler on the root logger (each service's CLI calls it once)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in _CHATTY:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    logging.getLogger("hypercorn.error").addFilter(_TEARDOWN_RACE)  # once: the same filter object
