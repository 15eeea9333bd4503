"""Whether this process reaches its servers, Postgres and NATS: probed, logged on each change, told to health checks.

Every service keeps working through an outage of either server (each of its loops
retries on its own); this is where the outage itself is seen once: one log line
when a server is lost and one when it is back, the time it has been up for the
code that must not judge the world by a bus it has just got back (the controller
does not declare workers lost then), and, with `MODELPOOL_HEALTH_FILE`, a small
JSON file that `modelpool health` reads for a container's health check.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.faults import describe

log = logging.getLogger("modelpool.links")

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0


@dataclass
class Link:
    """One server as this process sees it: reachable since when, or unreachable since when and why."""

    server: str
    up_since: float | None = None
    down_since: float | None = None
    error: str | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    @property
    def up(self) -> bool:
        return self.up_since is not None

    def up_for_s(self) -> float:
        """Seconds it has been reachable without a break; 0 while it is not."""
        return 0.0 if self.up_since is None else self.clock() - self.up_since

    def reached(self) -> None:
        if self.up_since is not None:
            return
        now = self.clock()
        if self.down_since is not None:
            log.info("%s is back after %.1f s", self.server, now - self.down_since)
        else:
            log.info("%s reached", self.server)
        self.up_since, self.down_since, self.error = now, None, None

    def missed(self, error: BaseException | str) -> None:
        self.error = error if isinstance(error, str) else describe(error)
        if self.down_since is not None:
            return
        now = self.clock()
        if self.up_since is not None:
            log.warning("%s lost (%s); every part of this service retries until it is back", self.server, self.error)
        else:
            log.warning("%s not reachable yet (%s); waiting for it", self.server, self.error)
        self.up_since, self.down_since = None, now

    def to_json(self) -> dict[str, Any]:
        now = self.clock()
        return {"up": self.up, "for_s": round(now - (self.up_since if self.up else self.down_since or now), 1),
                "error": self.error}


class ServerLinks:
    """This process's links to Postgres and NATS, with the probe that keeps them current."""

    def __init__(self, service: str, health_file: str | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.health_file = Path(health_file) if health_file else None
        self.clock = clock
        self.postgres = Link("Postgres", clock=clock)
        self.nats = Link("NATS", clock=clock)
        self._on_reconnect: list[Callable[[], Awaitable[None]]] = []
        self._ping: tuple[asyncio.Future[None], int] | None = None
        """The PING in flight to NATS, and the connection's reconnect count when it was sent."""

    # ------------------------------------------------------------------ NATS connection callbacks

    def on_nats_reconnect(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run `hook` each time the NATS connection comes back (to declare again what a restart lost)."""
        self._on_reconnect.append(hook)

    def nats_callbacks(self) -> dict[str, Callable[..., Awaitable[None]]]:
        """The callbacks to connect with: they keep `nats` current and run the reconnect hooks."""

        async def disconnected() -> None:
            self.nats.missed("disconnected")

        async def reconnected() -> None:
            self.nats.reached()
            for hook in self._on_reconnect:
                asyncio.ensure_future(hook())

        async def failed(exc: Exception) -> None:
            # nats-py calls this for every failed (re)connection attempt: one line per outage is enough.
            self.nats.missed(exc)

        return {"disconnected_cb": disconnected, "reconnected_cb": reconnected, "error_cb": failed}

    # ------------------------------------------------------------------ probing

    async def probe(self, engine: AsyncEngine, nc: NATS) -> None:
        """Ask both servers once: a query on the pool, a ping through the connection."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                await ping_postgres(engine)
        except Exception as exc:
            self.postgres.missed(exc if str(exc) else f"no answer within {PROBE_TIMEOUT_S:g} s")
        else:
            self.postgres.reached()
        try:
            await self._ping_nats(nc)
        except Exception as exc:
            self.nats.missed(exc if str(exc) else f"no answer to a ping within {PROBE_TIMEOUT_S:g} s")
        else:
            self.nats.reached()

    async def _ping_nats(self, nc: NATS) -> None:
        """A PING answered by a PONG within `PROBE_TIMEOUT_S`: the server is there and moving.

        One PING at a time, and none given up on while its connection lives: nats-py's
        `flush(timeout)` cancels the PONG's future when it times out, and the PONG that
        comes later (a paused server resuming) then breaks the connection's read loop,
        so every service reconnected 6-9 s after a paused NATS resumed, each at its own
        moment. Its own timeout is longer than nats-py's pings take to find a silent
        connection stale (`max_outstanding_pings` + 1 intervals), so it never expires on a
        live connection; a replaced connection owes no PONG: the PING sent on the old one
        is dropped.
        """
        if not nc.is_connected:
            raise ConnectionError("reconnecting")
        reconnects = nc.stats["reconnects"]
        if self._ping is not None and self._ping[1] != reconnects:
            self._drop_ping()
        if self._ping is None:
            patience_s = nc.options["ping_interval"] * (nc.options["max_outstanding_pings"] + 2)
            self._ping = (asyncio.ensure_future(nc.flush(timeout=patience_s)), reconnects)
        ping = self._ping[0]
        await asyncio.wait({ping}, timeout=PROBE_TIMEOUT_S)
        if not ping.done():
            raise TimeoutError(f"no answer to a ping within {PROBE_TIMEOUT_S:g} s")
        self._ping = None
        ping.result()

    def _drop_ping(self) -> None:
        if self._ping is not None:
            self._ping[0].cancel()
            self._ping = None

    async def run(self, engine: AsyncEngine, nc: NATS, stop: asyncio.Event) -> None:
        """Probe every second until `stop`, writing the health file after each probe."""
        try:
            while not stop.is_set():
                await self.probe(engine, nc)
                self.write_health()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), PROBE_INTERVAL_S)
        finally:
            self._drop_ping()

    def health(self) -> dict[str, Any]:
        return {"service": self.service, "pid": os.getpid(), "at": time.time(),
                "postgres": self.postgres.to_json(), "nats": self.nats.to_json()}

    def write_health(self) -> None:
        if self.health_file is None:
            return
        try:
            self.health_file.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.health_file.parent, delete=False,
                                             prefix=f".{self.health_file.name}.") as tmp:
                json.dump(self.health(), tmp)
            os.replace(tmp.name, self.health_file)  # readers never see half a file
        except OSError as exc:
            log.warning("cannot write the health file %s: %s", self.health_file, exc)


async def ping_postgres(engine: AsyncEngine) -> None:
    """A query through the pool: raises unless Postgres answers."""
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
