"""`decide(snapshot, now) -> Decision`: a policy's proposal, through the shared rules, into commands."""

from __future__ import annotations

from datetime import datetime

from policy.base import Policy
from policy.baselines import LatencyPolicy, PeriodicPolicy, UtilizationPolicy
from policy.census import census
from policy.heteroscale import HeteroScalePolicy
from policy.hybrid import HybridPolicy
from policy.ids import decision_id
from policy.operator import paused_decision, pin_note, pinned
from policy.reconcile import Reconciler
from policy.rules import plan_tiers
from shared.contracts.building import evolve, new_decision, new_policy_state
from shared.contracts.control import AliasSnapshot, Decision, NextStep

POLICIES: dict[str, Policy] = {p.name: p for p in (HybridPolicy(), HeteroScalePolicy(), UtilizationPolicy(),
                                                     LatencyPolicy(), PeriodicPolicy())}

class UnknownPolicy(LookupError):
    pass


def policy_named(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


def decide(snapshot: AliasSnapshot, now: datetime) -> Decision:
    policy = policy_named(snapshot.policy)
    if snapshot.operator.paused:
        return paused_decision(snapshot, policy.name, policy.version, decision_id(snapshot.alias, snapshot.version))
    snapshot = pinned(snapshot)
    metrics = snapshot.metrics
    last_seen = snapshot.state.last_window_end
    new_window = metrics is not None and (last_seen is None or metrics.window_end > last_seen)
    proposal = policy.propose(snapshot, now, new_window)
    censuses = {b: census(snapshot, b) for b in snapshot.config.backends}
    plans = plan_tiers(snapshot, proposal, censuses, now, new_window or metrics is None)
    did = decision_id(snapshot.alias, snapshot.version)
    reconciler = Reconciler(snapshot, did, now)
    actions = reconciler.run(plans, censuses)

    tiers = {}
    for backend, plan in plans.items():
        tier = plan.state
        if backend in reconciler.scaled_up:
            tier = evolve(tier, last_scale_up_at=now)
        if backend in reconciler.released:
            tier = evolve(tier, last_scale_down_at=now)
        tiers[backend] = tier
    state = new_policy_state(policy=proposal.memory, tiers=tiers,
                        last_window_end=metrics.window_end if new_window and metrics else last_seen)
    outlook: list[NextStep] = [*proposal.outlook, *(step for p in plans.values() for step in p.outlook), *reconciler.outlook]
    return new_decision(
        policy=policy.name,
        policy_version=policy.version,
        decision_id=did,
        targets={b: p.target for b, p in plans.items()},
        targets_reason="; ".join([*(f"{b.value}={p.target}: {p.reason}" for b, p in plans.items()),
                                  *filter(None, [pin_note(snapshot)])]),
        state=state,
        mix_weight=proposal.mix_weight,
        routing=proposal.routing,
        mix=proposal.mix,
        actions=actions,
        outlook=tuple(outlook),
        cold_start=proposal.cold_start,
        roles={r: n for p in plans.values() if p.roles for r, n in p.roles.items()},
    )
