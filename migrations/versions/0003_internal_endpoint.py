"""Instances' internal endpoint (InstanceStateChanged v3): where other services reach an engine's KV export and import.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade(schema: str) -> None:
    op.execute(f'ALTER TABLE "{schema}".proj_instances ADD COLUMN internal_endpoint TEXT')


def downgrade(schema: str) -> None:
    op.execute(f'ALTER TABLE "{schema}".proj_instances DROP COLUMN IF EXISTS internal_endpoint')
