"""Shared fixtures for the tracker tests."""

from __future__ import annotations

import sys
from pathlib import Path

# Let `pytest tests/tracker` work from any directory without installing the package.
_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
