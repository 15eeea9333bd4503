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

from shared.contracts.backends import BackendType, Role
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
DELETE_AT_ONCE = Ladder(delete_after_s=0.0)
"""Drain and delete a surplus instance now, whatever its backend."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How fast the shared rules let a tier's wish take effect.

    A scale-up waits `up_cooldown_s` after the tier's last one. Unless
    `by_ladder` (surplus goes only as its ladder's idle times allow), a
    scale-down waits for `down_windows` consecutive windows asking for fewer,
    then `down_cooldown_s` after the last scale-down (after the last scaling
    of either kind with `down_after_any`), and lets at most `down_step`
    instances go per decision (None: all the surplus).
    """

    up_cooldown_s: float = 0.0
    down_cooldown_s: float = 0.0
    down_windows: int = 1
    down_step: int | None = None
    down_after_any: bool = False
    by_ladder: bool = False


@dataclass(slots=True)
class Wish:
    """What a policy wants of one tier."""

    replicas: int
    """Awake replicas (running or starting)."""
    reason: str
    ladder: Ladder = RELEASE_AT_ONCE
    pacing: Pacing = Pacing(by_ladder=True)
    urgent: bool = False
    """Surplus goes now, past hysteresis and cooldowns (the tier failed, or the alias is going cold)."""
    roles: dict[Role, int] | None = None
    """In a disaggregated alias: the replicas by role (summing to `replicas`)."""


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
