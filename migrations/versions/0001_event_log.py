"""Event log, tracking positions and the read-model tables.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade(schema: str) -> None:
    s = f'"{schema}"'
    op.execute(
        f"""
        CREATE TABLE {s}.events (
            position        BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
            id              UUID        NOT NULL UNIQUE,
            stream_id       TEXT        NOT NULL,
            stream_version  INTEGER     NOT NULL CHECK (stream_version >= 1),
            type            TEXT        NOT NULL,
            version         SMALLINT    NOT NULL CHECK (version >= 1),
            occurred_at     TIMESTAMPTZ NOT NULL,
            recorded_at     TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
            causation_id    UUID,
            correlation_id  UUID,
            payload         JSONB       NOT NULL,
            headers         JSONB       NOT NULL DEFAULT '{{}}'::jsonb,
            -- Optimistic concurrency for free: two writers of the same stream
            -- version cannot both commit.
            PRIMARY KEY (stream_id, stream_version)
        )
        """
    )
    # `modelpool history ALIAS` reads an alias's events across all its streams.
    op.execute(f"CREATE INDEX events_alias_position ON {s}.events ((payload->>'alias'), position)")
    # The log is append-only: updates and deletes are refused by the database itself.
    op.execute(
        f"""
        CREATE FUNCTION {s}.events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'the event log is append-only (% refused)', TG_OP
                USING ERRCODE = 'restrict_violation';
        END $$
        """
    )
    op.execute(
        f"""
        CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON {s}.events
        FOR EACH ROW EXECUTE FUNCTION {s}.events_append_only()
        """
    )
    op.execute(
        f"""
        CREATE TABLE {s}.tracking (
            name        TEXT PRIMARY KEY,
            position    BIGINT NOT NULL,
            updated_at  TIMESTAMPTZ NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        f"""
        CREATE TABLE {s}.proj_routing (
            alias           TEXT PRIMARY KEY,
            state           TEXT NOT NULL,
            mix_weight      DOUBLE PRECISION NOT NULL,
            switch_reason   TEXT,
            switched_at     TIMESTAMPTZ,
            cooldown_until  TIMESTAMPTZ,
            targets         JSONB NOT NULL,
            config          JSONB,
            updated_at      TIMESTAMPTZ NOT NULL
        )
        """
    )
    op.execute(
        f"""
        CREATE TABLE {s}.proj_instances (
            instance_id   TEXT PRIMARY KEY,
            alias         TEXT NOT NULL,
            backend_type  TEXT NOT NULL,
            engine        TEXT NOT NULL,
            worker_id     TEXT NOT NULL,
            state         TEXT NOT NULL,
            sleep_level   SMALLINT NOT NULL,
            inflight      INTEGER NOT NULL,
            capacity      INTEGER,
            endpoint      TEXT,
            reason        TEXT,
            updated_at    TIMESTAMPTZ NOT NULL
        )
        """
    )
    op.execute(f"CREATE INDEX proj_instances_alias ON {s}.proj_instances (alias)")
    op.execute(
        f"""
        CREATE TABLE {s}.proj_sessions (
            session_id        TEXT PRIMARY KEY,
            alias             TEXT NOT NULL,
            instance_id       TEXT NOT NULL,
            bound_at          TIMESTAMPTZ NOT NULL,
            last_migrated_at  TIMESTAMPTZ,
            migrations        INTEGER NOT NULL
        )
        """
    )
    op.execute(
        f"""
        CREATE TABLE {s}.proj_workers (
            worker_id      TEXT PRIMARY KEY,
            host           TEXT NOT NULL,
            gpu_memory_gb  DOUBLE PRECISION NOT NULL,
            slots          INTEGER NOT NULL,
            engines        JSONB NOT NULL,
            status         TEXT NOT NULL,
            reason         TEXT,
            registered_at  TIMESTAMPTZ NOT NULL,
            updated_at     TIMESTAMPTZ NOT NULL
        )
        """
    )


def downgrade(schema: str) -> None:
    s = f'"{schema}"'
    for table in ("proj_workers", "proj_sessions", "proj_instances", "proj_routing", "tracking", "events"):
        op.execute(f"DROP TABLE IF EXISTS {s}.{table}")
    op.execute(f"DROP FUNCTION IF EXISTS {s}.events_append_only()")
