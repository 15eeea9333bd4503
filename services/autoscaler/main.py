"""`modelpool autoscaler`: the only decision maker of the pool.

Run one or several: the one holding the lease decides (and records each alias's
configuration when it changes, so the log says what every later decision was
made under); the others stand by. A configuration error stops it with a
message naming the field and the file.
"""

from __future__ import annotations

from services.autoscaler.controller import Controller
from services.runtime import ServiceContext, run_service
from shared.configuration import load_pool_config
from shared.contracts.config import PoolConfig
from shared.eventlog.lease import AdvisoryLease


async def serve(ctx: ServiceContext, config: PoolConfig) -> None:
    settings = ctx.settings
    controller = Controller(
        store=ctx.store, engine=ctx.engine, js=ctx.js, subjects=ctx.subjects, telemetry=ctx.telemetry,
        telemetry_bus=ctx.telemetry_bus,
        lease=AdvisoryLease(settings.asyncpg_dsn, settings.namespace, "autoscaler",
                            connect_args=settings.database_connect_args),
        pool=config, tick_s=config.controller.tick_s, worker_timeout_s=config.controller.worker_timeout_s,
        bus_up_for_s=ctx.links.nats.up_for_s,
    )
    metrics = ctx.metrics
    metrics.add("modelpool_autoscaler_leading", "Whether this autoscaler holds the lease and decides (1) or stands by",
                lambda: int(controller.leading_since is not None))
    metrics.add("modelpool_autoscaler_ticks_total", "Ticks this autoscaler made while leading",
                lambda: controller.ticks, kind="counter")
    metrics.add("modelpool_autoscaler_decisions_total", "Decisions this autoscaler recorded (each changed something)",
                lambda: controller.recorded, kind="counter")
    metrics.add("modelpool_autoscaler_workers_lost_total", "Workers this autoscaler recorded lost",
                lambda: controller.workers_lost, kind="counter")
    await controller.run(ctx.stop)


def main(argv: list[str]) -> int:
    from shared.settings import Settings

    settings = Settings.load()
    # Read the configuration before connecting to anything: a bad file fails fast.
    config = load_pool_config(settings.config_path)
    return run_service("autoscaler", lambda ctx: serve(ctx, config), settings)
