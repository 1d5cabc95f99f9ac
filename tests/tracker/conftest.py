"""Shared fixtures for the tracker tests."""

from __future__ import annotations

import sys
from pathlib import Path

# Let `pytest tests/tracker` work from any directory without installing the package.
_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


import os  # noqa: E402

import pytest  # noqa: E402

POSTGRES_URL = os.environ.get("SWARM_TEST_POSTGRES_URL", "")


def _db_params() -> list[object]:
    return [
        pytest.param("sqlite", id="sqlite"),
        pytest.param(
            "postgres",
            id="postgres",
            marks=[
                pytest.mark.postgres,
                pytest.mark.skipif(
                    not POSTGRES_URL, reason="set SWARM_TEST_POSTGRES_URL to run against PostgreSQL"
                ),
            ],
        ),
    ]


@pytest.fixture(params=_db_params())
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database URL with an empty schema: a fresh SQLite file, or the test PostgreSQL wiped to base."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tracker.sqlite3'}"
    from sqlalchemy import text

    from tracker.store import make_engine

    engine = make_engine(POSTGRES_URL)
    try:
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA public CASCADE"))
            conn.execute(text("CREATE SCHEMA public"))
    finally:
        engine.dispose()
    return POSTGRES_URL
