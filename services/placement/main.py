"""`modelpool placement`: choose a worker for every new instance."""

from __future__ import annotations

import logging
from collections import Counter

from services.placement.service import Placement
from services.runtime import ServiceContext, run_service
from shared.bus.jetstream import Consumer
from shared.contracts.commands import PlaceInstance
from shared.contracts.messages import Contract, Envelope
from shared.faults import retry_until_done
from shared.projections.readmodels import WORKERS

log = logging.getLogger(__name__)


async def serve(ctx: ServiceContext) -> None:
    placement = Placement(ctx.store, ctx.js, ctx.subjects, ctx.telemetry)
    await retry_until_done(placement.view.catch_up, "reading the workers and placements", log, ctx.stop)
    ctx.metrics.add("modelpool_placements_total", "Placements recorded by this process, by outcome",
                    lambda: {(("outcome", o),): n for o, n in placement.outcomes.items()}, kind="counter")
    ctx.metrics.add("modelpool_placement_workers", "Workers as placement sees them, by status",
                    lambda: dict(Counter((("status", w.status.value),) for w in placement.view[WORKERS].values())))

    async def on_request(envelope: Envelope, command: Contract) -> None:
        assert isinstance(command, PlaceInstance)
        await placement.handle(envelope, command)

    await ctx.consume(Consumer(
        ctx.js,
        ctx.subjects,
        stream=ctx.subjects.commands_stream,
        durable="placement",
        filter_subject=ctx.subjects.placement_commands,
        registry=ctx.commands,
        handler=on_request,
        telemetry=ctx.telemetry,
        batch=1,  # one decision at a time, each on the view the previous one left
    ))


def main(argv: list[str]) -> int:
    return run_service("placement", serve)
