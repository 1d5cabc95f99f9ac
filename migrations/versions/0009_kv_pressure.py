"""KV pressure per shard, from heartbeats: sessions the node preempted to make room in its KV pool and
steps it refused for want of room, both counted since the node started.

Revision ID: 0009_kv_pressure
Revises: 0008_route_recipe
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_kv_pressure"
down_revision = "0008_route_recipe"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("kv_preemptions", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("kv_refusals", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("kv_refusals")
        batch.drop_column("kv_preemptions")
