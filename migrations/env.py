"""Alembic environment: every table lives in the pool's namespace schema.

The URL and schema come from the caller (`shared.eventlog.db.migrate`) through
`config.attributes`, else from DATABASE_URL / MODELPOOL_NAMESPACE.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from shared.settings import Settings

config = context.config
settings = Settings.load(
    database_url=config.attributes.get("database_url"),
    database_password_file=config.attributes.get("database_password_file"),
    namespace=config.attributes.get("namespace"),
)
SCHEMA = settings.namespace
# The role migrations grant the services' privileges to (0006): the caller's, else MODELPOOL_DATABASE_SERVICE_ROLE.
config.attributes.setdefault("service_role", settings.database_service_role)


def run_in(connection) -> None:
    connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"'))
    connection.execute(text(f'SET search_path TO "{SCHEMA}"'))
    context.configure(
        connection=connection,
        version_table_schema=SCHEMA,
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.get_context().opts["schema"] = SCHEMA
        context.run_migrations(schema=SCHEMA)


async def run_online() -> None:
    engine = create_async_engine(settings.sqlalchemy_url, connect_args=settings.database_connect_args)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(run_in)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline SQL generation is not supported; run `modelpool migrate`")
asyncio.run(run_online())
