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
