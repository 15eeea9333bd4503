"""`modelpool projector`: keep the read models in Postgres up to date with the log.

The log is the authority on order: the projector always reads events from
Postgres by position, and uses the bus only to learn, without polling, that
there is something new. A bus message is acked once the projection has
committed at or past its position, so a redelivery finds nothing left to do.
"""

from __future__ import annotations

import asyncio
import logging

from services.runtime import ServiceContext, run_service
from shared.bus.jetstream import Consumer
from shared.contracts.messages import Contract, Envelope
from shared.faults import Outage, retry_until_done
from shared.projections.projector import Projector

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 1.0


async def serve(ctx: ServiceContext) -> None:
    projector = Projector(ctx.store, ctx.engine)
    caught = await retry_until_done(projector.catch_up, "loading the projections", log, ctx.stop)
    log.info("projections loaded at position %d (%d events applied on start)", projector.position, caught)
    ctx.metrics.add("modelpool_projector_position", "The log position the read models are up to",
                    lambda: projector.position)
    lock = asyncio.Lock()

    async def on_event(envelope: Envelope, _: Contract) -> None:
        if envelope.position is not None and envelope.position <= projector.position:
            return  # already applied: a redelivery, or caught up by an earlier message
        async with lock:
            await projector.catch_up()

    consumer = Consumer(
        ctx.js,
        ctx.subjects,
        stream=ctx.subjects.events_stream,
        durable="projector",
        filter_subject=ctx.subjects.all_events,
        registry=ctx.events,
        handler=on_event,
        telemetry=ctx.telemetry,
        deliver_new_only=True,
    )

    async def poll() -> None:
        # The bus can be down while the log is not: a slow poll keeps projections moving.
        outage = Outage("catching up with the log", log)
        while not ctx.stop.is_set():
            try:
                await asyncio.wait_for(ctx.stop.wait(), POLL_INTERVAL_S)
            except asyncio.TimeoutError:
                try:
                    async with lock:
                        await projector.catch_up()
                except Exception as exc:
                    outage.failed(exc)
                else:
                    outage.succeeded()

    await asyncio.gather(ctx.consume(consumer), poll())


def main(argv: list[str]) -> int:
    return run_service("projector", serve)
