"""The outbox relay: committed events from the log to the bus, in position order.

Postgres is the source of truth, and the events table is the outbox: an event
exists for the bus only once its transaction has committed. The relay publishes
each event with `Nats-Msg-Id` = event id, then records how far it got. If it dies
between the two, it publishes the tail again after restart and JetStream drops
the repeats inside its duplicate window; beyond that window consumers are
idempotent by event id / position anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import asyncpg
from nats.js import JetStreamContext

from shared.bus.jetstream import message_headers, publish_in_order
from shared.bus.subjects import Subjects
from shared.eventlog.store import EventStore
from shared.faults import Backoff, Outage, is_transient
from shared.telemetry import Telemetry

log = logging.getLogger(__name__)

TRACKING_NAME = "relay"


class Relay:
    def __init__(
        self,
        store: EventStore,
        js: JetStreamContext,
        subjects: Subjects,
        telemetry: Telemetry,
        *,
        listen_dsn: str,
        listen_args: Mapping[str, Any] | None = None,
        schema: str,
        batch: int = 500,
        poll_interval_s: float = 1.0,
        publish_timeout_s: float = 10.0,
    ) -> None:
        self.store = store
        self.js = js
        self.subjects = subjects
        self.telemetry = telemetry
        self.listen_dsn = listen_dsn
        self.listen_args = dict(listen_args or {})
        """asyncpg's `connect()` arguments beyond the DSN (`Settings.database_connect_args`: the password)."""
        self.schema = schema
        self.batch = batch
        self.poll_interval_s = poll_interval_s
        self.publish_timeout_s = publish_timeout_s
        self.position = 0
        self.published = 0
        self._wake = asyncio.Event()

    async def _load_position(self, conn: asyncpg.Connection) -> int:
        value = await conn.fetchval("SELECT position FROM tracking WHERE name = $1", TRACKING_NAME)
        return int(value or 0)

    async def _save_position(self, conn: asyncpg.Connection, position: int) -> None:
        await conn.execute(
            "INSERT INTO tracking (name, position, updated_at) VALUES ($1, $2, now())"
            " ON CONFLICT (name) DO UPDATE SET position = EXCLUDED.position, updated_at = now()",
            TRACKING_NAME,
            position,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until `stop`, through any outage of Postgres or NATS.

        The relay's own session (LISTEN, the advisory lock, its position) is opened
        again whenever it is lost, and the lock taken again before anything is
        published: in between another relay may have taken over, and then this one
        stands by.
        """
        backoff = Backoff()
        outage = Outage("the relay's Postgres session", log)
        while not stop.is_set():
            try:
                conn = await asyncpg.connect(self.listen_dsn, server_settings={"search_path": self.schema}, timeout=5,
                                             **self.listen_args)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                outage.failed(exc)
                await backoff.wait(stop)
                continue
            outage.succeeded()
            backoff.reset()
            try:
                await self._relay_on(conn, stop)
            except Exception as exc:
                if not conn.is_closed() and not is_transient(exc):
                    raise
                outage.failed(exc)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close(), 2)
                conn.terminate()

    async def _relay_on(self, conn: asyncpg.Connection, stop: asyncio.Event) -> None:
        """Hold the relay's lock on `conn` and publish until `stop`; raises when `conn` is lost."""
        stop_wait = asyncio.ensure_future(stop.wait())
        try:
            # Losing the last position update in a crash only means publishing a
            # tail again, which JetStream de-duplicates: no need to wait for the disk.
            await conn.execute("SET synchronous_commit = off")
            # One relay per namespace: two would move the position back and forth.
            # A second one stands by until the first one's session ends.
            announced = False
            while not await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", f"{self.schema}.relay"):
                if not announced:
                    log.info("another relay is running for %s; standing by", self.schema)
                    announced = True
                await asyncio.wait({stop_wait}, timeout=1.0)
                if stop.is_set():
                    return
            # LISTEN before reading the position, so no commit can slip between the two unseen.
            await conn.add_listener(self.store.notify_channel, lambda *_: self._wake.set())
            self.position = await self._load_position(conn)
            log.info("relay starting after position %d", self.position)
            backoff = Backoff()
            outage = Outage("relaying events to the bus", log)
            while not stop.is_set():
                # Clear before reading: a commit notified while we read sets it again.
                self._wake.clear()
                try:
                    relayed = await self.relay_once(conn)
                except Exception as exc:
                    if conn.is_closed():
                        raise  # our session is gone: open a new one, lock first
                    # The bus or the database is away: start again from what was recorded.
                    outage.failed(exc)
                    await asyncio.wait({stop_wait}, timeout=backoff.next_s())
                    self.position = await self._load_position(conn)
                    continue
                outage.succeeded()
                backoff.reset()
                if relayed:
                    continue
                wake_wait = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({wake_wait, stop_wait}, timeout=self.poll_interval_s, return_when=asyncio.FIRST_COMPLETED)
                wake_wait.cancel()
        finally:
            stop_wait.cancel()

    async def relay_once(self, conn: asyncpg.Connection) -> int:
        """Publish the next batch of committed events; return how many."""
        batch = await self.store.read_outbox(self.position, self.batch)
        if not batch:
            return 0
        # A lost acknowledgement (say, across a reconnect) must not hang the relay forever.
        await asyncio.wait_for(publish_in_order(
            self.js,
            [
                (
                    self.subjects.event(e.stream_id, e.type),
                    e.body,
                    message_headers(e.id, e.type, e.version, e.position, self.telemetry, e.headers),
                )
                for e in batch
            ],
        ), self.publish_timeout_s)
        self.position = batch[-1].position
        await self._save_position(conn, self.position)
        self.published += len(batch)
        return len(batch)
