"""Every migration walks up and down; the SQLAlchemy models match the migrated schema."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from click.testing import CliRunner
from sqlalchemy import inspect

from tracker import migrate
from tracker.cli import main
from tracker.models import Base
from tracker.store import make_engine


def _revisions() -> list[str]:
    script = ScriptDirectory.from_config(migrate.alembic_config("sqlite://"))
    return [r.revision for r in reversed(list(script.walk_revisions()))]  # oldest first


def _diff(engine) -> list[object]:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return list(compare_metadata(ctx, Base.metadata))


def test_walk_every_migration_up_and_down(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        revisions = _revisions()
        assert revisions and revisions[-1] == migrate.head_revision()
        for rev in revisions:
            migrate.upgrade(engine, rev)
            assert migrate.current_revision(engine) == rev
        assert _diff(engine) == []
        assert {"models", "gateways", "nodes", "shards", "usage"} <= set(inspect(engine).get_table_names())
        for rev in reversed(revisions[:-1]):
            migrate.downgrade(engine, "-1")
            assert migrate.current_revision(engine) == rev
        migrate.downgrade(engine, "-1")
        assert migrate.current_revision(engine) is None
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        # and up again, all at once, as the server does on start
        assert migrate.upgrade_if_needed(engine) == (None, revisions[-1])
        assert migrate.upgrade_if_needed(engine) == (revisions[-1], revisions[-1])
        assert _diff(engine) == []
    finally:
        engine.dispose()


def test_cli_db_upgrade_and_downgrade(db_url: str) -> None:
    runner = CliRunner()
    up = runner.invoke(main, ["db", "upgrade", "--url", db_url], env={})
    assert up.exit_code == 0, up.output
    assert migrate.head_revision() in up.output
    cur = runner.invoke(main, ["db", "current", "--url", db_url], env={})
    assert f"current {migrate.head_revision()}" in cur.output
    down = runner.invoke(main, ["db", "downgrade", "--url", db_url, "--revision", "base"], env={})
    assert down.exit_code == 0, down.output
    assert "revision None" in down.output
