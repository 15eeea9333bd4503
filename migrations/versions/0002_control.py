"""The controller's read model: per alias, its stream version, policy state and commands in flight.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade(schema: str) -> None:
    s = f'"{schema}"'
    op.execute(
        f"""
        CREATE TABLE {s}.proj_control (
            alias           TEXT PRIMARY KEY,
            version         INTEGER NOT NULL,
            policy          TEXT,
            state           JSONB,
            decided_at      TIMESTAMPTZ,
            pending         JSONB NOT NULL,
            start_failures  JSONB NOT NULL,
            notes           JSONB NOT NULL,
            updated_at      TIMESTAMPTZ NOT NULL
        )
        """
    )


def downgrade(schema: str) -> None:
    op.execute(f'DROP TABLE IF EXISTS "{schema}".proj_control')
