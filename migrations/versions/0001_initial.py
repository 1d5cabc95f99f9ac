"""Initial tracker registry: models, gateways, nodes, shards, usage ledger.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("architecture", sa.String(64), nullable=False),
        sa.Column("n_layers", sa.Integer(), nullable=False),
        sa.Column("n_embd", sa.Integer(), nullable=False),
        sa.Column("first_seen_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("fingerprint", name="pk_models"),
    )
    op.create_index("ix_models_name", "models", ["name"])

    op.create_table(
        "gateways",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("first_seen_s", sa.Double(), nullable=False),
        sa.Column("last_seen_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_gateways"),
    )

    op.create_table(
        "nodes",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("addresses", sa.JSON(), nullable=False),
        sa.Column("relay", sa.Boolean(), nullable=False),
        sa.Column("relay_via", sa.String(200), nullable=True),
        sa.Column("hardware", sa.JSON(), nullable=False),
        sa.Column("software_version", sa.String(64), nullable=False),
        sa.Column("first_seen_s", sa.Double(), nullable=False),
        sa.Column("last_seen_s", sa.Double(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_nodes"),
    )
    op.create_index("ix_nodes_state", "nodes", ["state"])

    op.create_table(
        "shards",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("model_fingerprint", sa.String(64), nullable=False),
        sa.Column("layer_start", sa.Integer(), nullable=False),
        sa.Column("layer_end", sa.Integer(), nullable=False),
        sa.Column("decode_ms_per_token", sa.Double(), nullable=False),
        sa.Column("prefill_tokens_per_s", sa.Double(), nullable=False),
        sa.Column("active_sessions", sa.Integer(), nullable=False),
        sa.Column("max_sessions", sa.Integer(), nullable=False),
        sa.Column("queue_depth", sa.Integer(), nullable=False),
        sa.Column("kv_free_tokens", sa.BigInteger(), nullable=True),
        sa.Column("tokens_served_total", sa.BigInteger(), nullable=False),
        sa.Column("updated_s", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name="fk_shards_node_id_nodes", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["model_fingerprint"], ["models.fingerprint"], name="fk_shards_model_fingerprint_models"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_shards"),
        sa.UniqueConstraint("node_id", "model_fingerprint", name="uq_shards_node_id_model_fingerprint"),
    )
    op.create_index("ix_shards_model_fingerprint", "shards", ["model_fingerprint"])

    op.create_table(
        "usage",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("gateway_id", sa.String(64), nullable=False),
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("model_fingerprint", sa.String(64), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("steps", sa.BigInteger(), nullable=False),
        sa.Column("at_s", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["gateway_id"], ["gateways.id"], name="fk_usage_gateway_id_gateways"),
        sa.PrimaryKeyConstraint("id", name="pk_usage"),
        sa.UniqueConstraint(
            "gateway_id", "request_id", "node_id", name="uq_usage_gateway_id_request_id_node_id"
        ),
    )
    op.create_index("ix_usage_node_id_at_s", "usage", ["node_id", "at_s"])


def downgrade() -> None:
    op.drop_index("ix_usage_node_id_at_s", table_name="usage")
    op.drop_table("usage")
    op.drop_index("ix_shards_model_fingerprint", table_name="shards")
    op.drop_table("shards")
    op.drop_index("ix_nodes_state", table_name="nodes")
    op.drop_table("nodes")
    op.drop_table("gateways")
    op.drop_index("ix_models_name", table_name="models")
    op.drop_table("models")
