"""The console's live charts: every gateway's metric windows per alias, merged per period, for the last half hour.

Followed from the bus (each replica publishes a window per alias every
`metric_window_s`, 2 s by default), so the charts show the whole pool's load
and not only this replica's; read back from the windows stream once at start,
so a console opened after a restart still has its recent past. Bounded: a
window older than `keep_s` is dropped as new ones come.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from typing import Any

from shared.bus.telemetry import TelemetryBus
from shared.contracts.telemetry import GatewayWindow, merge_windows
from shared.faults import describe

log = logging.getLogger(__name__)

KEEP_S = 1800.0


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


class Series:
    def __init__(self, keep_s: float = KEEP_S) -> None:
        self.keep = timedelta(seconds=keep_s)
        self._windows: dict[str, dict[datetime, dict[str, GatewayWindow]]] = defaultdict(dict)
        """alias -> window end -> gateway -> its window."""

    def add(self, window: GatewayWindow) -> None:
        periods = self._windows[window.alias]
        periods.setdefault(window.window_end, {})[window.gateway_id] = window
        horizon = window.window_end - self.keep
        for end in [e for e in periods if e < horizon]:
            del periods[end]

    def points(self, alias: str, after: datetime | None = None) -> list[dict[str, Any]]:
        """One point per period that ended after `after`, oldest first, merged over the gateways."""
        periods = self._windows.get(alias, {})
        out = []
        for end in sorted(e for e in periods if after is None or e > after):
            m = merge_windows(list(periods[end].values()))
            seconds = max(1e-9, (m.window_end - m.window_start).total_seconds())
            out.append({
                "at": end.isoformat(), "gateways": m.gateways, "arrivals_per_s": round(m.arrivals / seconds, 3),
                "queue": round(m.queue_len, 2), "held": m.held, "errors": m.errors,
                "ttft_p95_ms": _ms(m.ttft_p95_s), "e2e_p95_ms": _ms(m.e2e_p95_s),
                "tokens_per_s": round(m.decode_tokens_per_s or 0.0, 1),
                "inflight_fast": round(m.inflight_fast, 2), "inflight_slow": round(m.inflight_slow, 2),
            })
        return out

    async def follow(self, bus: TelemetryBus, stop: asyncio.Event) -> None:
        """The stored recent windows, then every new one until `stop`."""
        try:
            for window in await bus.read_windows(datetime.now(timezone.utc) - self.keep):
                self.add(window)
        except Exception as exc:  # the bus is away: the charts start from now, once it is back
            log.warning("the console's charts start empty: the stored windows cannot be read (%s)", describe(exc))
        await bus.follow_windows(self.add, stop)
