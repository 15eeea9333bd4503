"""What operators asked of the controller per alias (OperatorCommanded): a pause, pinned minimum replicas.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade(schema: str) -> None:
    op.execute(f'ALTER TABLE "{schema}".proj_control ADD COLUMN operator JSONB')


def downgrade(schema: str) -> None:
    op.execute(f'ALTER TABLE "{schema}".proj_control DROP COLUMN IF EXISTS operator')
