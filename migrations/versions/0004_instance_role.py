"""Instances' role (InstanceStateChanged v4): prefill or decode in a disaggregated alias.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade(schema: str) -> None:
    op.execute(f'ALTER TABLE "{schema}".proj_instances ADD COLUMN role TEXT')


def downgrade(schema: str) -> None:
    op.execute(f'ALTER TABLE "{schema}".proj_instances DROP COLUMN IF EXISTS role')
