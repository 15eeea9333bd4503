"""Failures of the servers a service depends on, told apart from failures of its own.

A service that loses Postgres or NATS for a while must wait and try again,
forever, without filling its log: `is_transient` says whether an exception means
"a server is away" (retry) rather than "this input or this code is wrong"
(report, dead-letter). `Backoff` spaces the retries; `Outage` logs the first
failure of a run of them and the recovery, not every attempt.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg
import nats.errors
import nats.js.errors
from sqlalchemy import exc as sa_exc

T = TypeVar("T")


class StopRequested(Exception):
    """The process was asked to stop while it waited for a server."""

_TRANSIENT: tuple[type[BaseException], ...] = (
    OSError,  # refused, reset, unreachable: ConnectionError and socket errors
    TimeoutError,  # asyncio's too, and nats-py's
    asyncpg.PostgresConnectionError,  # cannot connect now (starting up, shutting down)
    asyncpg.InterfaceError,  # the connection was closed under the call
    asyncpg.exceptions.OperatorInterventionError,  # terminated by an administrator, server shutting down
    asyncpg.exceptions.InsufficientResourcesError,  # too many connections, out of memory
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError,  # JetStream not (yet) there for a subject: a restarting server
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,  # a publish no stream took: JetStream recovering after a restart
)


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) says a server is unreachable, rather than that something is wrong."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _TRANSIENT):
            return True
        if isinstance(current, sa_exc.DBAPIError) and current.connection_invalidated:
            return True
        if isinstance(current, (sa_exc.OperationalError, sa_exc.InterfaceError)):
            return True
        current = current.__cause__ or current.__context__
    return False


def describe(exc: BaseException) -> str:
    """One line for a log: the exception's type and message, without a traceback."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Backoff:
    """Waits that grow from `first_s` by `factor` up to `cap_s`, with a little jitter; `reset` after a success."""

    def __init__(self, first_s: float = 0.2, cap_s: float = 5.0, factor: float = 2.0) -> None:
        self.first_s, self.cap_s, self.factor = first_s, cap_s, factor
        self.attempts = 0

    def next_s(self) -> float:
        delay = min(self.cap_s, self.first_s * self.factor ** self.attempts)
        self.attempts += 1
        return delay * random.uniform(0.8, 1.0)

    def reset(self) -> None:
        self.attempts = 0

    async def wait(self, stop: asyncio.Event | None = None) -> None:
        """Sleep the next delay, or less if `stop` is set meanwhile."""
        delay = self.next_s()
        if stop is None:
            await asyncio.sleep(delay)
            return
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except asyncio.TimeoutError:
            pass


class Outage:
    """Logs a repeated operation's first failure and its recovery, once each, whatever happens in between.

    A failure that is not transient is logged with its traceback every time: it is
    a bug or bad data, and hiding repeats of it would hide it.
    """

    def __init__(self, what: str, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.logger = logger
        self.clock = clock
        self.since: float | None = None

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException) -> None:
        if not is_transient(exc):
            self.logger.error("%s failed; retrying", self.what, exc_info=exc)
        elif self.since is None:
            self.logger.warning("%s failed (%s); retrying until its server is back", self.what, describe(exc))
        if self.since is None:
            self.since = self.clock()

    def succeeded(self) -> None:
        if self.since is not None:
            self.logger.info("%s works again after %.1f s", self.what, self.clock() - self.since)
            self.since = None


async def retry_until_done(attempt: Callable[[], Awaitable[T]], what: str, logger: logging.Logger,
                           stop: asyncio.Event | None = None, backoff: Backoff | None = None) -> T:
    """`attempt()` until it returns, waiting between transient failures; other failures are raised.

    Raises `StopRequested` if `stop` is set before it succeeds.
    """
    outage, backoff = Outage(what, logger), backoff or Backoff()
    while True:
        try:
            result = await attempt()
        except Exception as exc:
            if not is_transient(exc):
                raise
            outage.failed(exc)
        else:
            outage.succeeded()
            return result
        await backoff.wait(stop)
        if stop is not None and stop.is_set():
            raise StopRequested(f"stopped while waiting for: {what}")
