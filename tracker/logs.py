"""Structured logging: one JSON object per line, one line per event that matters.

``event(log, "node_expired", node_id=...)`` logs ``{"ts": ..., "level": "info",
"logger": "swarm.tracker", "event": "node_expired", "node_id": ...}``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

log = logging.getLogger("swarm.tracker")


def event(logger: logging.Logger, name: str, *, level: int = logging.INFO, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"swarm_fields": fields})


class JsonLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        out.update(getattr(record, "swarm_fields", {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def configure(level: str = "info") -> None:
    """Install the JSON-lines handler on the root logger (called once by the CLI)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # hypercorn's access log would add a second, unstructured line per request.
    logging.getLogger("hypercorn.access").setLevel(logging.WARNING)
    # alembic narrates every step; the tracker logs one db_ready event with the revisions instead.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.Formatter.converter = time.gmtime
