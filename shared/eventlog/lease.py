"""Leadership: a Postgres advisory lock held by a session of its own.

Whoever holds the lock leads; the others stand by and try again every
`retry_s`. The lock lives exactly as long as the session: a leader that dies,
even by SIGKILL, has its socket closed by the kernel, Postgres ends the session
and a standby gets the lock at its next try. A leader checks its session before
acting (`alive`), so one that lost its connection stops deciding.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import asyncpg

from shared.faults import Outage

log = logging.getLogger(__name__)


class AdvisoryLease:
    def __init__(self, dsn: str, schema: str, name: str, *, retry_s: float = 0.5, check_timeout_s: float = 2.0,
                 connect_args: Mapping[str, Any] | None = None) -> None:
        self.dsn = dsn
        self.connect_args = dict(connect_args or {})
        """asyncpg's `connect()` arguments beyond the DSN (`Settings.database_connect_args`: the password)."""
        self.schema = schema
        self.key = f"{schema}.{name}"
        self.retry_s = retry_s
        self.check_timeout_s = check_timeout_s
        self._conn: asyncpg.Connection | None = None

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until the lock is ours (True) or `stop` is set (False)."""
        announced = False
        outage = Outage(f"taking the lease {self.key}", log)
        while not stop.is_set():
            try:
                if self._conn is None or self._conn.is_closed():
                    self._conn = await asyncpg.connect(self.dsn, timeout=5, **self.connect_args)
                if await self._conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", self.key):
                    outage.succeeded()
                    return True
                outage.succeeded()
                if not announced:
                    log.info("%s is held by another process; standing by", self.key)
                    announced = True
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncio.TimeoutError) as exc:
                outage.failed(exc)
                await self.release()
            try:
                await asyncio.wait_for(stop.wait(), self.retry_s)
            except asyncio.TimeoutError:
                pass
        return False

    async def alive(self) -> bool:
        """Whether the session holding the lock is still there."""
        if self._conn is None or self._conn.is_closed():
            return False
        try:
            await asyncio.wait_for(self._conn.fetchval("SELECT 1"), self.check_timeout_s)
            return True
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncio.TimeoutError):
            await self.release()
            return False

    async def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            try:
                await asyncio.wait_for(conn.close(), self.check_timeout_s)
            except Exception:
                conn.terminate()
