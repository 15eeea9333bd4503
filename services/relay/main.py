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
        listen_args=ctx.settings.database_connect_args,
        schema=ctx.settings.namespace,
    )
    ctx.metrics.add("modelpool_relay_position", "The log position up to which events are published on the bus",
                    lambda: relay.position)
    ctx.metrics.add("modelpool_relay_published_total", "Events this relay process published on the bus",
                    lambda: relay.published, kind="counter")
    await relay.run(ctx.stop)


def main(argv: list[str]) -> int:
    return run_service("relay", serve)
