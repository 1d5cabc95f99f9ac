"""Trust: node reputation (spot checks, bans), the evidence log, banned hosts, challenge results,
observed decode speed per shard, the address an announce came from, signed usage reports and
their receipts.

Revision ID: 0004_trust
Revises: 0003_coordinates
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_trust"
down_revision = "0003_coordinates"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_reputation",
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("checks_passed", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("checks_failed", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("banned_until_s", sa.Double(), nullable=True),
        sa.Column("ban_reason", sa.String(400), server_default="", nullable=False),
        sa.Column("updated_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("node_id", name="pk_node_reputation"),
    )
    op.create_table(
        "trust_evidence",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("gateway_id", sa.String(64), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("conclusive", sa.Boolean(), nullable=False),
        sa.Column("at_s", sa.Double(), nullable=False),
        sa.Column("envelope", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_trust_evidence"),
    )
    op.create_index("ix_trust_evidence_node_id_at_s", "trust_evidence", ["node_id", "at_s"])
    op.create_index("ix_trust_evidence_at_s", "trust_evidence", ["at_s"])
    op.create_table(
        "banned_hosts",
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("since_s", sa.Double(), nullable=False),
        sa.Column("until_s", sa.Double(), nullable=False),
        sa.Column("reason", sa.String(400), nullable=False),
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("host", name="pk_banned_hosts"),
    )
    op.create_index("ix_banned_hosts_until_s", "banned_hosts", ["until_s"])
    op.create_table(
        "challenge_results",
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("model_fingerprint", sa.String(64), nullable=False),
        sa.Column("recipe_fingerprint", sa.String(64), nullable=False),
        sa.Column("layer_start", sa.Integer(), nullable=False),
        sa.Column("layer_end", sa.Integer(), nullable=False),
        sa.Column("input_id", sa.String(32), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("outcome", sa.String(24), nullable=False),
        sa.Column("detail", sa.String(400), nullable=False),
        sa.Column("at_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("node_id", "model_fingerprint", name="pk_challenge_results"),
    )
    op.create_index(
        "ix_challenge_results_reference",
        "challenge_results",
        ["model_fingerprint", "recipe_fingerprint", "layer_start", "layer_end", "input_id"],
    )
    op.create_table(
        "usage_reports",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("gateway_id", sa.String(64), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("envelope", sa.JSON(), nullable=False),
        sa.Column("receipt", sa.JSON(), nullable=False),
        sa.Column("at_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_usage_reports"),
    )
    op.create_index("ix_usage_reports_at_s", "usage_reports", ["at_s"])
    op.create_index("ix_usage_reports_gateway_id_request_id", "usage_reports", ["gateway_id", "request_id"])
    with op.batch_alter_table("usage") as batch:
        batch.add_column(sa.Column("report_id", sa.Integer(), nullable=True))
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("announced_from", sa.String(64), server_default="", nullable=False))
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("observed_ms_per_token", sa.Double(), nullable=True))
        batch.add_column(sa.Column("observed_at_s", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("observed_at_s")
        batch.drop_column("observed_ms_per_token")
    # Before this revision a node could only be live, expired or left: the trust states map to
    # expired (out of routing; a heartbeat brings it back, as it would have then).
    op.execute(
        "UPDATE nodes SET state = 'expired' WHERE state IN ('banned', 'challenging', 'challenge_failed')"
    )
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("announced_from")
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("report_id")
    op.drop_index("ix_usage_reports_gateway_id_request_id", table_name="usage_reports")
    op.drop_index("ix_usage_reports_at_s", table_name="usage_reports")
    op.drop_table("usage_reports")
    op.drop_index("ix_challenge_results_reference", table_name="challenge_results")
    op.drop_table("challenge_results")
    op.drop_index("ix_banned_hosts_until_s", table_name="banned_hosts")
    op.drop_table("banned_hosts")
    op.drop_index("ix_trust_evidence_at_s", table_name="trust_evidence")
    op.drop_index("ix_trust_evidence_node_id_at_s", table_name="trust_evidence")
    op.drop_table("trust_evidence")
    op.drop_table("node_reputation")
