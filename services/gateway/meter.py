"""The gateway's measurements per alias and per window (seed 000 §6), published as `GatewayWindow`s.

What one alias's window adds up is `shared/metering.py` (the lab adds up its
windows with the same code); this module keeps a meter per alias and publishes
them. Windows are aligned to multiples of their length in wall-clock time, so the
windows of every replica for the same period share `window_start` and the
controller merges them (`merge_windows`). Every known alias gets a window every
period, empty or not: an empty window is news too (load has stopped).

What is measured, and from when to when, is written down in docs/gateway.md.
Durations use the monotonic clock; only the window labels come from the wall clock.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timezone

from shared.contracts.telemetry import GatewayWindow
from shared.faults import Outage
from shared.metering import AliasMeter, RequestOutcome

log = logging.getLogger(__name__)


def outcome_of(status: int) -> RequestOutcome:
    if status < 400:
        return RequestOutcome.OK
    if status in (408, 429) or status >= 500:
        return RequestOutcome.ENGINE_ERROR
    return RequestOutcome.CLIENT_ERROR


class Meter:
    """Every alias's meter, and the loop that closes and publishes their windows."""

    def __init__(self, gateway_id: str, window_s: float, clock: Callable[[], float]) -> None:
        self.gateway_id = gateway_id
        self.window_s = window_s
        self._clock = clock
        self.aliases: dict[str, AliasMeter] = {}

    def of(self, alias: str) -> AliasMeter:
        meter = self.aliases.get(alias)
        if meter is None:
            meter = self.aliases[alias] = AliasMeter(self._clock)
        return meter

    def close(self, aliases: Iterable[str], end: float) -> list[GatewayWindow]:
        """Close the window ending at `end` (epoch seconds) for each alias."""
        start_at = datetime.fromtimestamp(end - self.window_s, timezone.utc)
        end_at = datetime.fromtimestamp(end, timezone.utc)
        return [self.of(alias).close(self.gateway_id, alias, start_at, end_at) for alias in aliases]

    async def run(self, aliases: Callable[[], Iterable[str]], publish: Callable[[GatewayWindow], Awaitable[None]],
                  stop: asyncio.Event) -> None:
        """At every multiple of the window length, publish a window for each alias `aliases()` names."""
        last_end = 0.0
        outage = Outage("publishing metric windows", log)
        while True:
            # Never the same end twice, even if the timer fires a hair before the wall clock gets there.
            end = max((math.floor(time.time() / self.window_s) + 1) * self.window_s, last_end + self.window_s)
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, end - time.time()))
                return
            except asyncio.TimeoutError:
                pass
            last_end = end
            windows = self.close(aliases(), end)
            results = await asyncio.gather(*(publish(w) for w in windows), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:  # lost for the controller, which decides on the next ones
                outage.failed(failed[0])
            else:
                outage.succeeded()
