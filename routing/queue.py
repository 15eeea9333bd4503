"""Which waiting request gets a freed slot, and how long a refused one should wait: one alias's admission queue.

Seed 003's RequestQueue: a bounded FIFO per alias. A request takes a slot at
once only when nobody waits ahead of it; otherwise it queues, and every slot
that frees or instance that comes up goes to the head first (`pump`). Where a
request may go depends on its session (sticky, affinity, EAR: `per_session`),
a waiter whose instance is full does not hold back those behind it that may go
elsewhere, and a newcomer may take a slot that no waiter can use; each
instance still serves its own waiters in arrival order. A full queue refuses,
with a retry delay worked out from how fast the queue has drained lately.
Given an `order`, a pump serves waiters in that order instead, ranked again
after every grant (the gateway's: priority classes and token-fair shares
between tenants, `routing/fairness.py`).

Pure, over a clock the caller passes: the gateway wraps it with futures and
wall time (`services/gateway/admission.py`), the lab with its virtual time
(`lab/cluster.py`). `take(request)` is the caller's scheduler: a slot on the
instance the router picks, or None when no instance may take the request now.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

R = TypeVar("R")
S = TypeVar("S")

DRAIN_SAMPLES = 64
"""Recent departures from a queue its drain rate is measured over."""
DRAIN_MEMORY_S = 30.0
"""Departures older than this say nothing about how fast the queue drains now."""


class AdmissionQueueFull(Exception):
    def __init__(self, alias: str, waiting: int, retry_after_s: float) -> None:
        super().__init__(f"{waiting} requests of `{alias}` are already waiting")
        self.waiting = waiting
        self.retry_after_s = retry_after_s


class AdmissionQueue(Generic[R, S]):
    """One alias's waiting requests, in arrival order, and when recent ones left for a slot."""

    def __init__(self, alias: str, size: int) -> None:
        self.alias = alias
        self.size = size
        self.waiting: deque[R] = deque()
        self.departures: deque[float] = deque(maxlen=DRAIN_SAMPLES)

    def __len__(self) -> int:
        return len(self.waiting)

    def may_take_now(self, per_session: bool) -> bool:
        """Whether a newcomer may try for a slot before queueing: when nobody waits ahead of it, or when those
        who do wait for their session's instance only."""
        return not self.waiting or per_session

    def enqueue(self, request: R, now: float, readmitted: bool = False) -> None:
        """A place at the end of the queue; `AdmissionQueueFull` when it is full. A `readmitted` request (one that
        was served once and needs a slot again, as a prefilled request on its way to a decode instance) goes to
        the head and is never refused."""
        if readmitted:
            self.requeue(request)
            return
        if len(self.waiting) >= self.size:
            raise AdmissionQueueFull(self.alias, len(self.waiting), self.retry_after_s(now))
        self.waiting.append(request)

    def admit(self, request: R, now: float, take: Callable[[R], S | None], per_session: bool,
              readmitted: bool = False) -> S | None:
        """A slot now, or None with the request queued (`may_take_now`, then `enqueue`)."""
        if self.may_take_now(per_session):
            slot = take(request)
            if slot is not None:
                return slot
        self.enqueue(request, now, readmitted)
        return None

    def requeue(self, request: R) -> None:
        """Back to the head, without a slot: a request whose instance went away under it."""
        self.waiting.appendleft(request)

    def pump(self, now: float, take: Callable[[R], S | None], per_session: bool,
             order: Callable[[Sequence[R]], list[R]] | None = None) -> list[tuple[R, S]]:
        """Hand free slots to waiters, head first (or in `order`, ranked again after each grant, which may change
        the ranks), for as long as there are both: who got which."""
        granted: list[tuple[R, S]] = []
        while True:
            went = False
            for request in order(self.waiting) if order is not None else list(self.waiting):
                slot = take(request)
                if slot is None:
                    if per_session:
                        continue
                    break
                self.waiting.remove(request)
                self.departures.append(now)
                granted.append((request, slot))
                went = True
                if order is not None:
                    break
            if not (went and order is not None):
                return granted

    def leave(self, request: R) -> None:
        """The request stops waiting (its client left, or its wait ran out)."""
        try:
            self.waiting.remove(request)
        except ValueError:
            pass

    def retry_after_s(self, now: float) -> float:
        """How long until the queue has room again, at the rate it has drained lately."""
        recent = [t for t in self.departures if now - t <= DRAIN_MEMORY_S]
        if recent and now > recent[0]:
            rate = len(recent) / (now - recent[0])  # measured up to now, so a queue that stalls reads slower and slower
            return max(1.0, math.ceil(len(self.waiting) / rate))
        return DRAIN_MEMORY_S  # nothing has left the queue lately: it will not have room soon

    def drained_lately(self, now: float) -> bool:
        """Whether a request left for a slot recently enough that the drain rate is worth keeping."""
        return bool(self.departures) and now - self.departures[-1] <= DRAIN_MEMORY_S
