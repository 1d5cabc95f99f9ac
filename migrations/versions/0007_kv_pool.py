"""KV pool per shard: the pool's size and the most positions one session may hold, from heartbeats.

Revision ID: 0007_kv_pool
Revises: 0006_node_tls
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_kv_pool"
down_revision = "0006_node_tls"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("kv_pool_tokens", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("kv_session_max_tokens", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("kv_session_max_tokens")
        batch.drop_column("kv_pool_tokens")
