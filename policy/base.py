"""What a policy is: a pure function from a snapshot to a proposal.

A policy says what it wants: the routing state and mix weight, how many awake
replicas of each tier, and how surplus instances of a tier are let go (its
ladder). It does not say which instance gets which command, nor when a wish is
allowed to take effect: the shared rules (`rules.py`) bound, delay and pace
every policy's wishes the same way, and `reconcile.py` turns what is left into
commands. So a new policy is one module with one `propose` function.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from shared.contracts.backends import BackendType
from shared.contracts.control import (
    AliasSnapshot,
    ColdStart,
    MixChange,
    NextStep,
    PolicyMemory,
    RoutingChange,
)


@dataclass(frozen=True, slots=True)
class Ladder:
    """How a surplus instance of a tier is let go, by how long it has been idle (seconds).

    `sleep_1_after_s` / `sleep_2_after_s` put it to sleep (None: no sleep at that
    level); `delete_after_s` drains and deletes it (None: never for idleness). A
    sleep asked of a backend that cannot sleep becomes its substitute, drain +
    delete, whatever the instance's load: a drain waits for its requests.
    """

    sleep_1_after_s: float | None = None
    sleep_2_after_s: float | None = None
    delete_after_s: float | None = None


RELEASE_AT_ONCE = Ladder(sleep_1_after_s=0.0)
"""Let a surplus instance go now (for llama.cpp: the drain + delete substitute)."""


@dataclass(slots=True)
class Wish:
    """What a policy wants of one tier."""

    replicas: int
    """Awake replicas (running or starting)."""
    reason: str
    ladder: Ladder = RELEASE_AT_ONCE
    urgent: bool = False
    """Surplus goes now, past hysteresis and cooldowns (the tier failed, or the alias is going cold)."""


@dataclass(slots=True)
class Proposal:
    wishes: dict[BackendType, Wish]
    memory: PolicyMemory
    mix_weight: float
    """Share of traffic to vLLM after this tick."""
    routing: RoutingChange | None = None
    mix: MixChange | None = None
    outlook: tuple[NextStep, ...] = ()
    cold_start: ColdStart | None = None


class Policy(Protocol):
    name: str
    version: int
    """Raised whenever the policy would decide differently on the same snapshot."""

    def propose(self, snapshot: AliasSnapshot, now: datetime, new_window: bool) -> Proposal:
        """`new_window`: the snapshot's metric window has not been counted before."""
        ...
