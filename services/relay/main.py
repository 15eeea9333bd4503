"""`modelpool relay`: publish committed events from the log to the bus."""

from __future__ import annotations

from services.runtime import ServiceContext, run_service
from shared.bus.relay import Relay


async def serve(ctx: ServiceContext) -> None:
    relay = Relay(
        ctx.store,
        ctx.js,
        ctx.subjects,
        ctx.telemetry,
        listen_dsn=ctx.settings.asyncpg_dsn,
        schema=ctx.settings.namespace,
    )
    await relay.run(ctx.stop)


def main(argv: list[str]) -> int:
    return run_service("relay", serve)
