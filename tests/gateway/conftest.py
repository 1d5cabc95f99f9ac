"""Make the repository root and this directory importable (helpers live next to the tests)."""

from __future__ import annotations

import sys
from pathlib import Path

for _path in (str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
