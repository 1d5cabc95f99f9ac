"""Alembic environment for the tracker database.

Run through ``tracker.migrate`` (``swarm-tracker db upgrade``), which passes
either an open connection (``config.attributes["connection"]``) or the URL
(``sqlalchemy.url``). SQLite gets batch mode so later ALTERs work there too.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection

from tracker.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("alembic: no sqlalchemy.url (tracker.migrate sets it, or pass a connection)")
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; pass a database URL")
run_migrations_online()
