"""Model registry: operators' registered models (manifest, sources, name binding); shards' announced capacity.

Revision ID: 0005_model_registry
Revises: 0004_trust
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_model_registry"
down_revision = "0004_trust"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "registered_models",
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("architecture", sa.String(64), nullable=False),
        sa.Column("n_layers", sa.Integer(), nullable=False),
        sa.Column("n_embd", sa.Integer(), nullable=False),
        sa.Column("file_size", sa.BigInteger(), nullable=False),
        sa.Column("split_points", sa.JSON(), nullable=True),
        sa.Column("layer_bytes", sa.JSON(), nullable=False),
        sa.Column("first_extra_bytes", sa.BigInteger(), nullable=False),
        sa.Column("last_extra_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sources", sa.JSON(), nullable=False),
        sa.Column("manifest", sa.Text(), nullable=False),
        sa.Column("registration", sa.Text(), nullable=False),
        sa.Column("signer_id", sa.String(64), nullable=False),
        sa.Column("registered_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("fingerprint", name="pk_registered_models"),
        sa.UniqueConstraint("name", name="uq_registered_models_name"),
    )
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("capacity_layers", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("capacity_layers")
    op.drop_table("registered_models")
