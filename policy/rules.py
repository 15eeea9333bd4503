"""The rules every policy's wishes pass through, once, whatever the policy (as Ray Serve wraps its policies).

- bounds: a tier's target stays within its backend's min_replicas..max_replicas
  (a disaggregated tier's roles keep their proportions);
- scale-up cooldown: the wish's `Pacing.up_cooldown_s` between two scale-ups of a tier;
- a rebound halts scale-down: when the policy wants more of a tier than it did at
  the last tick, nothing of that tier is let go now and the hysteresis restarts;
- scale-down hysteresis, cooldown and step as the wish's `Pacing` says (for
  the hybrid policy's fast tier: scale_down_consecutive windows, then one
  replica per cycle and per llama_scale_down_cooldown_s, seed 000 §5.4), or by
  its ladder alone: an instance goes only when idle long enough;
- an urgent wish (a failed tier) skips the hysteresis and the pacing.

A tier never scales up and down in the same tick: release is only planned when
the target is below what the tier has.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from policy.base import Ladder, Proposal, Wish
from policy.census import TierCensus
from shared.contracts.backends import BackendType, Role
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
    roles: dict[Role, int] | None = None
    """The target by role, in a disaggregated tier."""


def bounded_roles(roles: dict[Role, int], total: int) -> dict[Role, int]:
    """`roles` scaled to sum to `total`, by largest remainder (ties to the first role)."""
    wanted = sum(roles.values())
    if wanted == total or wanted == 0:
        return dict(roles)
    shares = {r: n * total / wanted for r, n in roles.items()}
    out = {r: int(share) for r, share in shares.items()}
    for r in sorted(shares, key=lambda r: -(shares[r] - out[r]))[: total - sum(out.values())]:
        out[r] += 1
    return out


def plan_tier(s: AliasSnapshot, backend: BackendType, wish: Wish, c: TierCensus, now: datetime, counted: bool) -> TierPlan:
    bounds = s.config.backends[backend]
    tier = s.state.tier(backend)
    pacing = wish.pacing
    target = min(max(wish.replicas, bounds.min_replicas), bounds.max_replicas)
    reason = wish.reason
    roles = wish.roles
    if target != wish.replicas:
        reason += f"; bounded to {bounds.min_replicas}..{bounds.max_replicas} replicas -> {target}"
        roles = bounded_roles(roles, target) if roles else None
    rebound = wish.replicas > tier.last_wanted
    wanted = wish.replicas

    def plan(target: int, reason: str, release: int = 0, halted: bool = False, windows: int = 0,
             outlook: tuple[NextStep, ...] = (), roles: dict[Role, int] | None = roles) -> TierPlan:
        if windows == tier.down_windows and wanted == tier.last_wanted:
            state = tier  # most ticks: as it was (scale-up and scale-down times are set by `decide`)
        else:
            state = TierState(tier.last_scale_up_at, tier.last_scale_down_at, windows, wanted)
        return TierPlan(target, reason, release, wish.ladder, halted, state, outlook, roles)

    growing = target > c.supply or (roles is not None and any(n > c.by_role.get(r, 0) for r, n in roles.items()))
    if growing and tier.last_scale_up_at is not None and pacing.up_cooldown_s:
        ready_at = tier.last_scale_up_at + timedelta(seconds=pacing.up_cooldown_s)
        if now < ready_at:
            return plan(c.supply, reason + f"; scale-up cooldown until {ready_at.isoformat()}",
                        outlook=(NextStep(f"scale {backend.value} up to {target}", ready_at),),
                        roles=dict(c.by_role) if roles else None)
    if target >= c.supply:
        return plan(target, reason)

    surplus = c.supply - target
    windows = tier.down_windows + 1 if counted else tier.down_windows
    if wish.urgent:
        return plan(target, reason, surplus, windows=windows)
    if rebound:
        return plan(target, reason + "; load rebounded: scale-down halted", halted=True)
    if pacing.by_ladder:
        return plan(target, reason, surplus, windows=windows)
    if windows < pacing.down_windows:
        return plan(target, reason, windows=windows, outlook=(NextStep(
            f"let {backend.value} replicas go after {pacing.down_windows - windows} more window(s) asking for {target}"),))
    last = tier.last_scale_down_at
    if pacing.down_after_any and tier.last_scale_up_at is not None and (last is None or tier.last_scale_up_at > last):
        last = tier.last_scale_up_at
    if last is not None and pacing.down_cooldown_s:
        ready_at = last + timedelta(seconds=pacing.down_cooldown_s)
        if now < ready_at:
            return plan(target, reason + f"; scale-down cooldown until {ready_at.isoformat()}", windows=windows,
                        outlook=(NextStep(f"let {backend.value} replicas go (scale-down cooldown)", ready_at),))
    return plan(target, reason, surplus if pacing.down_step is None else min(surplus, pacing.down_step), windows=windows)


def plan_tiers(s: AliasSnapshot, proposal: Proposal, censuses: dict[BackendType, TierCensus], now: datetime,
               counted: bool) -> dict[BackendType, TierPlan]:
    return {
        backend: plan_tier(s, backend, proposal.wishes.get(backend) or Wish(0, "not wanted"), censuses[backend], now, counted)
        for backend in sorted(s.config.backends)  # a str enum: by value
    }
