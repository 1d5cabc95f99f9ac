"""Make the repository root importable so ``proto`` resolves to the project package.

The repository is not installed in the test environment; ``python -m pytest``
adds the working directory to ``sys.path`` but plain ``pytest`` does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
