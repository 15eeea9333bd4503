"""Who among a saturated alias's waiting requests goes next: priority classes, then token-fair shares.

When an alias has room, every request goes at once and none of this matters.
When it is saturated, requests wait in its queue (`routing/queue.py`), and the
order they leave it in is the only say a gateway has over who gets served. A
FIFO serves whoever sends most: one tenant flooding the alias makes everyone
else wait behind its backlog. So the queue hands a freed slot to:

1. the highest **priority class** among the waiters (`low` 0, `normal` 1,
   `high` 2), where every `aging_s` a request has waited raises it one class:
   a low request waits at most two `aging_s` before it competes as a high one,
   so no class is starved forever;
2. within a class, the tenant with the least **virtual tokens**: the tokens it
   has been served (prompt and completion, charged as they are consumed:
   a request's prompt when it gets its slot, its completion when it ends),
   divided by its weight. This is the virtual token counter of Sheng et al.,
   "Fairness in Serving Large Language Models" (OSDI '24): over any stretch in
   which tenants are backlogged, each one's share of tokens served follows its
   weight, counted in tokens rather than requests, so long prompts cost what
   they cost;
3. within a tenant, arrival order.

A tenant that had nothing waiting does not bank credit while idle: when its
first request joins, its counter is lifted to the lowest counter among the
tenants waiting (or, with nobody waiting, to the last tenant served's), so it
competes from where the others stand instead of from zero.

Pure and over the caller's clock: the gateway keeps one `FairShare` per alias
(`services/gateway/admission.py`), which outlives the alias's queue.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

R = TypeVar("R")

LOW, NORMAL, HIGH = 0, 1, 2
PRIORITIES = {"low": LOW, "normal": NORMAL, "high": HIGH}
DEFAULT_AGING_S = 10.0


@dataclass(frozen=True, slots=True)
class Tenancy:
    """Whose a request is, as its API key says: the tenant, its weight and its priority class."""

    tenant: str = "default"
    weight: float = 1.0
    priority: int = NORMAL


DEFAULT_TENANCY = Tenancy()


class FairShare:
    """One alias's virtual token counters, and the order its waiters are served in."""

    def __init__(self, aging_s: float = DEFAULT_AGING_S) -> None:
        self.aging_s = aging_s
        self.counters: dict[str, float] = {}
        self._last_served = 0.0

    def joined(self, tenant: str, waiting: Iterable[str]) -> None:
        """`tenant`'s first request waits, beside those of the tenants `waiting`: it starts from the lowest of
        their counters (from the last served's when none waits), not from what it banked while idle."""
        others = [self.counters.get(t, 0.0) for t in waiting if t != tenant]
        floor = min(others) if others else self._last_served
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def charge(self, tenancy: Tenancy, tokens: float) -> None:
        """`tokens` served to the tenant (a prompt prefilled, a completion decoded), weighed by its weight."""
        if tokens <= 0:
            return
        counter = self.counters.get(tenancy.tenant, 0.0) + tokens / tenancy.weight
        self.counters[tenancy.tenant] = counter
        self._last_served = counter

    def rank(self, tenancy: Tenancy, entered: float, now: float) -> tuple[float, float, float]:
        """A waiter's place: its aged class (highest first), its tenant's counter (lowest first), its arrival."""
        aged = tenancy.priority + (math.floor(max(0.0, now - entered) / self.aging_s) if self.aging_s > 0 else 0)
        return -min(HIGH, aged), self.counters.get(tenancy.tenant, 0.0), entered

    def order(self, waiting: Sequence[R], now: float, tenancy: Callable[[R], Tenancy],
              entered: Callable[[R], float]) -> list[R]:
        """`waiting` in the order they are to be served."""
        return sorted(waiting, key=lambda r: self.rank(tenancy(r), entered(r), now))

    def first(self, waiting: Sequence[R], now: float, tenancy: Callable[[R], Tenancy],
              entered: Callable[[R], float]) -> R:
        """The first of `waiting` to be served (one pass: a long queue is not sorted for its head)."""
        return min(waiting, key=lambda r: self.rank(tenancy(r), entered(r), now))
