"""Each API key's limits at the front door: requests and tokens per minute, requests at once, new sessions per minute.

A key's use is counted in one-second buckets of wall-clock time: requests as
they are admitted, tokens as they are consumed (the prompt when the request is
admitted, the completion as it streams, both set right from the engine's usage
when the request ends), sessions as they are first bound. A limit is over a
sliding minute: a request is refused while the last 60 seconds hold the limit's
worth, and told to retry when enough of them will have aged out.

Limits hold across gateway replicas by gossip (`UsageReport` on the bus): every
second each replica sends the last minute of each key's use through it, and
counts a key's use as its own buckets plus the latest report of every other
replica. The approximation: a replica hears of the others' use up to about
`REPORT_S` late, so N replicas together admit at most about (N − 1)·`REPORT_S`
worth of a key's traffic past a limit. A replica that stops reporting keeps its
reported seconds until they age out of the minute, but its requests under way
stop counting after `STALE_S` (they ended with it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

from shared.contracts.config import TenantKey, key_id
from shared.contracts.telemetry import KeyUsage, KeyUsageSecond, UsageReport
from shared.openai_protocol import APIError

log = logging.getLogger(__name__)

WINDOW_S = 60
REPORT_S = 1.0
STALE_S = 5.0
"""A replica silent this long: its requests under way no longer count against the keys' concurrency."""
OPEN = "open"
"""The id of the open endpoint's one caller, when no key is configured."""


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """What one key may use; None: no limit."""

    key_id: str = OPEN
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    aliases: frozenset[str] = frozenset()
    sessions_per_minute: int | None = None

    @classmethod
    def of(cls, key: TenantKey, sessions_per_minute: int) -> "KeyLimits":
        return cls(key_id(key.key), key.rpm, key.tpm, key.max_concurrent, frozenset(key.aliases),
                   key.sessions_per_minute if key.sessions_per_minute is not None else sessions_per_minute)

    def allows(self, alias: str) -> bool:
        return not self.aliases or alias in self.aliases


Use = Literal["requests", "tokens", "sessions"]


@dataclass(slots=True)
class Second:
    """What a key used through this replica in one wall-clock second (the mutable twin of `KeyUsageSecond`)."""

    second: int
    requests: int = 0
    tokens: int = 0
    sessions: int = 0


class Ledger:
    """One key's use through one replica: the last minute's seconds, and its requests under way."""

    __slots__ = ("seconds", "in_flight")

    def __init__(self) -> None:
        self.seconds: deque[Second] = deque()
        """Oldest first."""
        self.in_flight = 0

    def add(self, second: int, requests: int = 0, tokens: int = 0, sessions: int = 0) -> None:
        if not self.seconds or self.seconds[-1].second < second:
            self.seconds.append(Second(second))
        bucket = self.seconds[-1]
        bucket.requests += requests
        bucket.tokens += tokens
        bucket.sessions += sessions

    def trim(self, now: int) -> None:
        while self.seconds and self.seconds[0].second <= now - WINDOW_S:
            self.seconds.popleft()

    def usage(self, now: int) -> KeyUsage:
        self.trim(now)
        return KeyUsage(in_flight=self.in_flight, seconds=[
            KeyUsageSecond(second=b.second, requests=b.requests, tokens=b.tokens, sessions=b.sessions)
            for b in self.seconds])


@dataclass(slots=True)
class Heard:
    """Another replica's latest report."""

    at: float
    keys: dict[str, KeyUsage]


@dataclass(eq=False, slots=True)
class Ticket:
    """One admitted request's hold on its key: returned when it ends."""

    limits: KeyLimits
    ledger: Ledger
    prompt_tokens: int
    consumed: Callable[[], int]
    """Completion tokens streamed so far (the request's content chunks)."""
    charged: int = 0
    """Completion tokens charged so far."""


def over_limit(limit: str, message: str, retry_after_s: float) -> APIError:
    return APIError(429, message, type="rate_limit_error", code=f"{limit}_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def not_allowed(alias: str) -> APIError:
    return APIError(403, f"this API key may not use `{alias}`; ask the pool's operator for access",
                    type="permission_error", code="model_not_allowed")


def _wait_for(seconds: list[tuple[int, int]], excess: int, now: float) -> float:
    """How long until `excess` of the minute's use, in (second, amount) order, has aged out."""
    aged = 0
    for second, amount in seconds:
        aged += amount
        if aged >= excess:
            return second + WINDOW_S - now
    return WINDOW_S


class Quotas:
    """Every key's use through this replica, and what the other replicas last said of theirs."""

    def __init__(self, gateway_id: str, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.gateway_id = gateway_id
        self.wall = wall
        self.clock = clock
        self.ledgers: dict[str, Ledger] = {}
        self.tickets: set[Ticket] = set()
        self.heard: dict[str, Heard] = {}

    # ------------------------------------------------------------------ a request's way

    def enter(self, limits: KeyLimits, alias: str, prompt_tokens: int, consumed: Callable[[], int]) -> Ticket:
        """Admit a request of the key to `alias`, charging it and its prompt; an `APIError` (403, or 429 naming
        the limit, with `Retry-After`) if the key may not use the alias or is at one of its limits."""
        if not limits.allows(alias):
            raise not_allowed(alias)
        now = self.wall()
        second = int(now)
        ledger = self.ledgers.get(limits.key_id)
        if ledger is None:
            ledger = self.ledgers[limits.key_id] = Ledger()
        if limits.max_concurrent is not None:
            in_flight = ledger.in_flight + self._heard_in_flight(limits.key_id)
            if in_flight >= limits.max_concurrent:
                raise over_limit("max_concurrent", f"this API key has {in_flight} requests under way, its limit "
                                 f"`max_concurrent` ({limits.max_concurrent}); retry when one ends", 1)
        if limits.rpm is not None:
            requests = self._minute(limits.key_id, ledger, "requests", second)
            used = sum(r for _, r in requests)
            if used >= limits.rpm:
                raise over_limit("rpm", f"this API key sent {used} requests in the last minute, its limit `rpm` "
                                 f"({limits.rpm} requests per minute)",
                                 _wait_for(requests, used - limits.rpm + 1, now))
        if limits.tpm is not None:
            tokens = self._minute(limits.key_id, ledger, "tokens", second)
            used = sum(t for _, t in tokens)
            if prompt_tokens > limits.tpm:
                raise over_limit("tpm", f"this request's prompt is about {prompt_tokens} tokens, more than this API "
                                 f"key's limit `tpm` ({limits.tpm} tokens per minute) allows at all", WINDOW_S)
            if used + prompt_tokens > limits.tpm:
                raise over_limit("tpm", f"this API key used {used} tokens in the last minute; with this request's "
                                 f"prompt of about {prompt_tokens} it would pass its limit `tpm` ({limits.tpm} tokens "
                                 "per minute)", _wait_for(tokens, used + prompt_tokens - limits.tpm, now))
        ledger.add(second, requests=1, tokens=prompt_tokens)
        ledger.in_flight += 1
        ticket = Ticket(limits, ledger, prompt_tokens, consumed)
        self.tickets.add(ticket)
        return ticket

    def may_bind(self, ticket: Ticket) -> bool:
        """Whether the request may bind a new session (a write to the log), charging it if so."""
        limit = ticket.limits.sessions_per_minute
        second = int(self.wall())
        if limit is not None:
            bound = sum(n for _, n in self._minute(ticket.limits.key_id, ticket.ledger, "sessions", second))
            if bound >= limit:
                return False
        ticket.ledger.add(second, sessions=1)
        return True

    def leave(self, ticket: Ticket, usage: tuple[int, int] | None) -> None:
        """The request ended: its place under `max_concurrent` is free, and its tokens are set right from the
        engine's count (the prompt was an estimate; the completion was charged as it streamed)."""
        if ticket not in self.tickets:
            return  # left already
        self.tickets.remove(ticket)
        ticket.ledger.in_flight -= 1
        completion = usage[1] if usage is not None else ticket.consumed()
        prompt_error = usage[0] - ticket.prompt_tokens if usage is not None else 0
        extra = completion - ticket.charged + prompt_error
        if extra > 0:  # an overestimated prompt is not refunded: the request was admitted on it
            ticket.ledger.add(int(self.wall()), tokens=extra)

    # ------------------------------------------------------------------ between replicas

    def report(self) -> UsageReport:
        """Charge what the streams under way have produced since the last report, then this replica's last minute
        of every key it served."""
        second = int(self.wall())
        for ticket in self.tickets:
            streamed = ticket.consumed() - ticket.charged
            if streamed > 0:
                ticket.charged += streamed
                ticket.ledger.add(second, tokens=streamed)
        keys = {}
        for key, ledger in list(self.ledgers.items()):
            usage = ledger.usage(second)
            if not usage.seconds and not usage.in_flight:
                del self.ledgers[key]  # idle a minute: nothing to say of it
                continue
            keys[key] = usage
        return UsageReport(gateway_id=self.gateway_id, at=datetime.fromtimestamp(self.wall(), timezone.utc), keys=keys)

    def hear(self, report: UsageReport) -> None:
        if report.gateway_id != self.gateway_id:
            self.heard[report.gateway_id] = Heard(self.clock(), report.keys)

    async def run(self, publish: Callable[[UsageReport], Awaitable[None]], stop: asyncio.Event) -> None:
        """Report every `REPORT_S` until `stop`; a report the bus does not take is skipped (the next one says the
        whole minute again)."""
        while not stop.is_set():
            try:
                await publish(self.report())
            except Exception as exc:  # the bus away: limits count this replica's use alone until it is back
                log.debug("usage report not sent: %r", exc)
            now = self.clock()
            for gateway, heard in list(self.heard.items()):
                if now - heard.at > WINDOW_S:
                    del self.heard[gateway]
            try:
                await asyncio.wait_for(stop.wait(), REPORT_S)
            except asyncio.TimeoutError:
                pass

    def _heard_in_flight(self, key: str) -> int:
        now = self.clock()
        return sum(usage.in_flight for heard in self.heard.values() if now - heard.at <= STALE_S
                   if (usage := heard.keys.get(key)) is not None)

    def _minute(self, key: str, ledger: Ledger, use: Use, now: int) -> list[tuple[int, int]]:
        """The key's `use` per second over the last minute, every replica's, oldest first."""
        ledger.trim(now)
        since = now - WINDOW_S
        per_second: dict[int, int] = {}
        heard = (usage.seconds for h in self.heard.values() if (usage := h.keys.get(key)) is not None)
        for second in itertools.chain(ledger.seconds, *heard):
            amount = getattr(second, use)
            if second.second > since and amount:
                per_second[second.second] = per_second.get(second.second, 0) + amount
        return sorted(per_second.items())
