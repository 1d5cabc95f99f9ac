"""Operations: shared replay protection, replicas, periodic tasks, gateway statistics, leave,
node region and KV in use, ledger indexes for accounting queries.

Revision ID: 0002_operations
Revises: 0001_initial
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_operations"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "nonces",
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("nonce", sa.String(64), nullable=False),
        sa.Column("expires_at_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("key_id", "nonce", name="pk_nonces"),
    )
    op.create_index("ix_nonces_expires_at_s", "nonces", ["expires_at_s"])

    op.create_table(
        "tracker_replicas",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tracker_id", sa.String(64), nullable=False),
        sa.Column("url", sa.String(255), nullable=False),
        sa.Column("started_s", sa.Double(), nullable=False),
        sa.Column("last_seen_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_tracker_replicas"),
    )

    op.create_table(
        "tracker_tasks",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("last_run_s", sa.Double(), nullable=False),
        sa.Column("holder", sa.String(32), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_tracker_tasks"),
    )

    op.create_table(
        "gateway_reports",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("gateway_id", sa.String(64), nullable=False),
        sa.Column("at_s", sa.Double(), nullable=False),
        sa.Column("interval_s", sa.Double(), nullable=False),
        sa.Column("sessions_active", sa.Integer(), nullable=False),
        sa.Column("requests_queued", sa.Integer(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("ttft_p50_s", sa.Double(), nullable=True),
        sa.Column("ttft_p95_s", sa.Double(), nullable=True),
        sa.Column("routes", sa.JSON(), nullable=False),
        sa.Column("url", sa.String(255), nullable=False),
        sa.ForeignKeyConstraint(
            ["gateway_id"], ["gateways.id"], name="fk_gateway_reports_gateway_id_gateways", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_gateway_reports"),
    )
    op.create_index("ix_gateway_reports_at_s", "gateway_reports", ["at_s"])

    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("region", sa.String(64), server_default="", nullable=False))
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("kv_used_tokens", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("tokens_per_s", sa.Double(), nullable=True))

    op.create_index("ix_usage_at_s", "usage", ["at_s"])
    op.create_index("ix_usage_model_fingerprint_at_s", "usage", ["model_fingerprint", "at_s"])
    op.create_index("ix_usage_gateway_id_at_s", "usage", ["gateway_id", "at_s"])


def downgrade() -> None:
    op.drop_index("ix_usage_gateway_id_at_s", table_name="usage")
    op.drop_index("ix_usage_model_fingerprint_at_s", table_name="usage")
    op.drop_index("ix_usage_at_s", table_name="usage")
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("tokens_per_s")
        batch.drop_column("kv_used_tokens")
    # Nodes that left are simply not live; before this revision the state did not exist.
    op.execute("UPDATE nodes SET state = 'expired' WHERE state = 'left'")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("region")
    op.drop_index("ix_gateway_reports_at_s", table_name="gateway_reports")
    op.drop_table("gateway_reports")
    op.drop_table("tracker_tasks")
    op.drop_table("tracker_replicas")
    op.drop_index("ix_nonces_expires_at_s", table_name="nonces")
    op.drop_table("nonces")
