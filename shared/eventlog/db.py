"""Database engine and migrations for one namespace (one Postgres schema)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from shared.settings import Settings

if TYPE_CHECKING:
    from alembic.config import Config

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def create_engine(settings: Settings, *, schema: str | None = None, pool_size: int = 10) -> AsyncEngine:
    """An async engine whose connections see only the namespace's schema.

    Setting `search_path` per connection keeps every query unqualified, so the
    same code runs against the live schema, a scratch replay schema or a test schema.
    """
    return create_async_engine(
        settings.sqlalchemy_url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        connect_args={
            # A server that does not answer (stopped, cut off) fails a connection in seconds, not asyncpg's 60.
            "timeout": 10,
            **settings.database_connect_args,
            "server_settings": {
                "search_path": schema or settings.namespace,
                # asyncpg prepares every statement; after a few runs Postgres may switch
                # to a generic plan, and for `id = ANY($1)` that can be a full scan of
                # the log. Plan each run for its actual arguments instead.
                "plan_cache_mode": "force_custom_plan",
            }
        },
    )


def alembic_config(settings: Settings, schema: str | None = None) -> "Config":
    from alembic.config import Config  # imported here: it is slow, and only migrations need it

    config = Config(str(PROJECT_ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(PROJECT_ROOT / "migrations"))
    config.attributes["database_url"] = settings.database_url
    config.attributes["database_password_file"] = settings.database_password_file
    config.attributes["namespace"] = schema or settings.namespace
    config.attributes["service_role"] = settings.database_service_role
    return config


def migrate(settings: Settings, schema: str | None = None, revision: str = "head") -> None:
    """Bring the schema to `revision`. Schema changes happen only here, through Alembic."""
    from alembic import command

    command.upgrade(alembic_config(settings, schema), revision)


async def migrate_async(settings: Settings, schema: str | None = None) -> None:
    # Alembic's env.py runs its own event loop; give it a thread of its own.
    await asyncio.to_thread(migrate, settings, schema)
