"""The rules every policy's wishes pass through, once, whatever the policy (as Ray Serve wraps its policies).

- bounds: a tier's target stays within its backend's min_replicas..max_replicas;
- scale-up cooldown: SCALE_UP_COOLDOWN_S between two scale-ups of a tier;
- a rebound halts scale-down: when the policy wants more of a tier than it did at
  the last tick, nothing of that tier is let go now and the hysteresis restarts;
- hysteresis and pacing for the fast tier: it shrinks only after
  SCALE_DOWN_CONSECUTIVE windows asking for fewer, by at most one replica per
  cycle and one per LLAMA_SCALE_DOWN_COOLDOWN_S (seed 000 §5.4);
- the slow tier shrinks by its ladder: an instance goes only when idle long enough;
- an urgent wish (a failed tier) skips the hysteresis and the pacing.

A tier never scales up and down in the same tick: release is only planned when
the target is below what the tier has.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from policy.base import Ladder, Proposal, Wish
from policy.census import TierCensus
from shared.contracts.backends import BackendType
from shared.contracts.control import AliasSnapshot, NextStep, TierState


@dataclass(slots=True)
class TierPlan:
    target: int
    reason: str
    release: int
    """How many surplus awake instances may be let go this tick."""
    ladder: Ladder
    halted: bool
    """A rebound halted scale-down: nothing of the tier is let go, asleep ones keep their level."""
    state: TierState
    outlook: tuple[NextStep, ...] = ()


def plan_tier(s: AliasSnapshot, backend: BackendType, wish: Wish, c: TierCensus, now: datetime, counted: bool) -> TierPlan:
    cfg = s.settings
    bounds = s.config.backends[backend]
    tier = s.state.tier(backend)
    target = min(max(wish.replicas, bounds.min_replicas), bounds.max_replicas)
    reason = wish.reason
    if target != wish.replicas:
        reason += f"; bounded to {bounds.min_replicas}..{bounds.max_replicas} replicas -> {target}"
    rebound = wish.replicas > tier.last_wanted
    wanted = wish.replicas

    def tier_after(windows: int) -> TierState:
        """The tier's state after this tick (its scale-up and scale-down times are set by `decide`)."""
        if windows == tier.down_windows and wanted == tier.last_wanted:
            return tier  # most ticks: as it was
        return TierState(tier.last_scale_up_at, tier.last_scale_down_at, windows, wanted)
    outlook: list[NextStep] = []
    if target > c.supply and tier.last_scale_up_at is not None:
        ready_at = tier.last_scale_up_at + timedelta(seconds=cfg.SCALE_UP_COOLDOWN_S)
        if now < ready_at:
            outlook.append(NextStep(f"scale {backend.value} up to {target}", ready_at))
            return TierPlan(c.supply, reason + f"; scale-up cooldown until {ready_at.isoformat()}", 0, wish.ladder,
                            False, tier_after(0), tuple(outlook))
    if target >= c.supply:
        return TierPlan(target, reason, 0, wish.ladder, False, tier_after(0))

    surplus = c.supply - target
    windows = tier.down_windows + 1 if counted else tier.down_windows
    if wish.urgent:
        return TierPlan(target, reason, surplus, wish.ladder, False, tier_after(windows))
    if rebound:
        return TierPlan(target, reason + "; load rebounded: scale-down halted", 0, wish.ladder, True, tier_after(0))
    plan_state = tier_after(windows)
    if backend is not BackendType.LLAMA_CPP:
        return TierPlan(target, reason, surplus, wish.ladder, False, plan_state)
    # The fast tier: hysteresis, then one replica per cycle and per cooldown.
    if windows < cfg.SCALE_DOWN_CONSECUTIVE:
        outlook.append(NextStep(f"let one {backend.value} replica go after "
                                f"{cfg.SCALE_DOWN_CONSECUTIVE - windows} more window(s) asking for {target}"))
        return TierPlan(target, reason, 0, wish.ladder, False, plan_state, tuple(outlook))
    if tier.last_scale_down_at is not None:
        ready_at = tier.last_scale_down_at + timedelta(seconds=cfg.LLAMA_SCALE_DOWN_COOLDOWN_S)
        if now < ready_at:
            outlook.append(NextStep(f"let one {backend.value} replica go (LLAMA_SCALE_DOWN_COOLDOWN_S)", ready_at))
            return TierPlan(target, reason, 0, wish.ladder, False, plan_state, tuple(outlook))
    return TierPlan(target, reason, 1, wish.ladder, False, plan_state)


def plan_tiers(s: AliasSnapshot, proposal: Proposal, censuses: dict[BackendType, TierCensus], now: datetime,
               counted: bool) -> dict[BackendType, TierPlan]:
    return {
        backend: plan_tier(s, backend, proposal.wishes.get(backend) or Wish(0, "not wanted"), censuses[backend], now, counted)
        for backend in sorted(s.config.backends)  # a str enum: by value
    }
