"""The service role's privileges: append to and read the log, keep the read models; alter or delete nothing of the log.

Services log in as a role that owns nothing (shared/eventlog/roles.py): it
may SELECT and INSERT on `events`, but not UPDATE, DELETE or TRUNCATE it, and,
not owning the table, it can neither drop nor disable the append-only trigger.
Appending writers serialise on a lock of the whole table (EXCLUSIVE mode,
shared/eventlog/postgres.py says why), which Postgres grants only to holders of
UPDATE, DELETE or TRUNCATE; `events_lock_for_append()`, owned by the owner and
run with its rights, takes that lock and nothing else, so the service role gets
the lock without those privileges.

The role is named by MODELPOOL_DATABASE_SERVICE_ROLE when migrating (every
deployment names it: `modelpool up`, compose, Kubernetes). Without one (a
development server where everything logs in as one user) only the function is
made; to grant a role named later, migrate down to 0005 and up again. A named
role that does not exist fails the migration: roles are the deployment's to
create, with their passwords (`modelpool database-roles`), never a migration's.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28
"""

from alembic import context, op
from sqlalchemy import text

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

READ_MODELS = ("tracking", "proj_routing", "proj_instances", "proj_sessions", "proj_workers", "proj_control")
"""What services keep beside the log: positions (relay, projector) and the projector's read models."""


def service_role() -> str | None:
    from shared.eventlog.roles import checked_role

    role = context.config.attributes.get("service_role")
    return checked_role(role) if role else None


def upgrade(schema: str) -> None:
    s = f'"{schema}"'
    op.execute(
        f"""
        CREATE FUNCTION {s}.events_lock_for_append() RETURNS void
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
        BEGIN
            LOCK TABLE {s}.events IN EXCLUSIVE MODE;
        END $$
        """
    )
    op.execute(f"REVOKE ALL ON FUNCTION {s}.events_lock_for_append() FROM PUBLIC")
    role = service_role()
    if role is None:
        return
    if not op.get_bind().execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).scalar():
        raise RuntimeError(f"MODELPOOL_DATABASE_SERVICE_ROLE names {role!r}, which this server does not have: "
                           "create it first (`modelpool database-roles`, docs/security.md)")
    op.execute(f"GRANT USAGE ON SCHEMA {s} TO {role}")
    op.execute(f"GRANT SELECT, INSERT ON {s}.events TO {role}")
    op.execute(f"GRANT EXECUTE ON FUNCTION {s}.events_lock_for_append() TO {role}")
    op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {', '.join(f'{s}.{t}' for t in READ_MODELS)} TO {role}")
    op.execute(f"GRANT SELECT ON {s}.alembic_version TO {role}")


def downgrade(schema: str) -> None:
    s = f'"{schema}"'
    role = service_role()
    if role is not None:
        op.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA {s} FROM {role}")
        op.execute(f"REVOKE ALL ON SCHEMA {s} FROM {role}")
    op.execute(f"DROP FUNCTION IF EXISTS {s}.events_lock_for_append()")
