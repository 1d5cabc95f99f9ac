"""Node TLS: the sha256 of the certificate a node serves gRPC with, as announced (pinned by diallers).

Revision ID: 0006_node_tls
Revises: 0005_model_registry
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_node_tls"
down_revision = "0005_model_registry"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("tls_fingerprint", sa.String(64), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("tls_fingerprint")
