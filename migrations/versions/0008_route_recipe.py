"""Challenge results keep the runtime recipe's fingerprint (what the stages of one route must share)
beside the check fingerprint, so routing can chain only shards of one recipe.

Revision ID: 0008_route_recipe
Revises: 0007_kv_pool
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_route_recipe"
down_revision = "0007_kv_pool"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("challenge_results") as batch:
        batch.add_column(sa.Column("route_recipe", sa.String(64), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("challenge_results") as batch:
        batch.drop_column("route_recipe")
