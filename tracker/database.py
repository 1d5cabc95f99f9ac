"""The database both halves of the SQLAlchemy adapter share: the engine, its dialect, and the
replay-protection write every signed message makes.

:class:`tracker.store.Store` (nodes, models, shards, usage, replicas) and
:class:`tracker.trust_store.TrustStore` (reputation, bans, evidence,
challenges) each hold the one :class:`Database`; neither inherits from the
other. A write that touches both halves runs in one transaction: the store
opens the session and hands it to the trust store's gate (``check_announce``,
``ban_of``, ``record_observed``), and a trust write that a signed message
authorises records the message's nonce with :meth:`Database.consume_nonce` in
its own transaction. Synchronous, like the rest of the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from proto.signing import SignatureError
from tracker.migrate import upgrade_if_needed
from tracker.models import Nonce


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            if ":memory:" not in url and url not in ("sqlite://", "sqlite:///"):
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


@dataclass(frozen=True)
class NonceRecord:
    """A signed message's nonce, to be recorded in the shared table with the write it authorises."""

    key_id: str
    nonce: str
    expires_at_s: float
    max_live_per_key: int = 1000  # refuse (503) when the key already has this many unexpired nonces


class Database:
    """The engine and what every table's code needs of it: the dialect, an insert that ignores a
    conflict on either dialect, the nonce write, the schema upgrade and disposal."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def insert_ignore(self, table: Any) -> Any:
        """An ``INSERT`` of the engine's dialect, for ``.on_conflict_do_nothing`` (SQLite and PostgreSQL)."""
        dialect = postgresql if self.dialect == "postgresql" else sqlite
        return dialect.insert(table)

    def consume_nonce(self, conn: Connection | Session, rec: NonceRecord | None, now_s: float) -> None:
        """Record the nonce in the caller's transaction; a replay (seen by any replica) or a key over
        its bound raises :class:`SignatureError` and the transaction rolls back with nothing written.
        ``rec`` None: the write is not a signed message's (nothing to record)."""
        if rec is None:
            return
        live = conn.execute(
            select(func.count())
            .select_from(Nonce)
            .where(Nonce.key_id == rec.key_id, Nonce.expires_at_s >= now_s)
        ).scalar_one()
        if live >= rec.max_live_per_key:
            raise SignatureError(
                "nonce_cache_full",
                f"more than {rec.max_live_per_key} signed messages from this key in the window; retry later",
            )
        # RETURNING, not rowcount: drivers report -1 for INSERT ... ON CONFLICT DO NOTHING.
        stmt = (
            self.insert_ignore(Nonce)
            .values(key_id=rec.key_id, nonce=rec.nonce, expires_at_s=rec.expires_at_s)
            .on_conflict_do_nothing(index_elements=["key_id", "nonce"])
            .returning(Nonce.nonce)
        )
        if conn.execute(stmt).first() is None:
            raise SignatureError("replayed_nonce", "nonce already used by this key")

    def upgrade(self) -> tuple[str | None, str | None]:
        """Bring the schema to head (alembic): the revision before and after."""
        return upgrade_if_needed(self.engine)

    def close(self) -> None:
        self.engine.dispose()


__all__ = ["Database", "NonceRecord", "make_engine"]
