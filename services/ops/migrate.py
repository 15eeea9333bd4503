"""`modelpool migrate`: bring the namespace's schema to the latest migration, and declare its streams on a bus with
users.

On a bus with users (NATS credentials configured: `shared/bus/auth.py`) only the
autoscaler and the operator may declare streams (`shared/bus/permissions.py`), and
the other services wait for theirs: migrating, as the operator, declares them all
before any service starts. Without credentials every service declares what it
uses, as ever, and this touches only Postgres.
"""

from __future__ import annotations

import argparse
import asyncio

from shared.bus.jetstream import connect_once, ensure_streams
from shared.bus.subjects import Subjects
from shared.bus.telemetry import TelemetryBus
from shared.eventlog.db import migrate
from shared.settings import Settings

BUS_TIMEOUT_S = 30.0


async def declare_bus(settings: Settings) -> None:
    """Every stream and bucket of the namespace, on `settings.stream_replicas` servers."""
    nc = await connect_once(settings.nats_url, name="modelpool-migrate", timeout_s=BUS_TIMEOUT_S,
                            credentials=settings.nats_credentials)
    try:
        js, subjects = nc.jetstream(), Subjects(settings.namespace)
        await ensure_streams(js, subjects, settings.stream_replicas)
        await TelemetryBus(nc, js, subjects).ensure(settings.stream_replicas)
    finally:
        await nc.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool migrate", description=__doc__)
    parser.add_argument("--database-url", help="default: DATABASE_URL")
    parser.add_argument("--namespace", help="schema to migrate (default: MODELPOOL_NAMESPACE or 'modelpool')")
    parser.add_argument("--revision", default="head")
    args = parser.parse_args(argv)
    settings = Settings.load(database_url=args.database_url, namespace=args.namespace)
    migrate(settings, revision=args.revision)
    print(f"schema {settings.namespace!r} is at {args.revision}")
    if settings.nats_credentials is not None:
        asyncio.run(declare_bus(settings))
        print(f"streams of {settings.namespace!r} declared on the bus")
    return 0
