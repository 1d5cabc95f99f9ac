"""Network coordinates: RTT claims, a coordinate per node and gateway, the node's announced uplink.

Revision ID: 0003_coordinates
Revises: 0002_operations
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_coordinates"
down_revision = "0002_operations"
branch_labels = None
depends_on = None

COORD_COLUMNS = ("coord_x", "coord_y", "coord_z", "coord_height_ms", "coord_error", "coord_updated_s")


def upgrade() -> None:
    op.create_table(
        "rtt_claims",
        sa.Column("reporter_id", sa.String(64), nullable=False),
        sa.Column("peer_id", sa.String(64), nullable=False),
        sa.Column("rtt_ms", sa.Double(), nullable=False),
        sa.Column("at_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("reporter_id", "peer_id", name="pk_rtt_claims"),
    )
    op.create_index("ix_rtt_claims_peer_id_at_s", "rtt_claims", ["peer_id", "at_s"])
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("uplink_mbit_s", sa.Double(), nullable=True))
        for name in COORD_COLUMNS:
            batch.add_column(sa.Column(name, sa.Double(), nullable=True))
    with op.batch_alter_table("gateways") as batch:
        for name in COORD_COLUMNS:
            batch.add_column(sa.Column(name, sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("gateways") as batch:
        for name in reversed(COORD_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("nodes") as batch:
        for name in reversed(COORD_COLUMNS):
            batch.drop_column(name)
        batch.drop_column("uplink_mbit_s")
    op.drop_index("ix_rtt_claims_peer_id_at_s", table_name="rtt_claims")
    op.drop_table("rtt_claims")
