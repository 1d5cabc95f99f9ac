"""Prefix heads per shard, from heartbeats: heads of the KV block chains the node keeps
(common/prefix_chain.py), space-separated, that gateways match a prompt's heads against.

Revision ID: 0010_prefix_heads
Revises: 0009_kv_pressure
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_prefix_heads"
down_revision = "0009_kv_pressure"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("prefix_heads", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("prefix_heads")
