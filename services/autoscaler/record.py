"""A decision as it is recorded (events) and applied (commands)."""

from __future__ import annotations

from datetime import datetime

from shared.bus.subjects import Subjects
from shared.contracts.backends import Action
from shared.contracts.commands import (
    Command,
    DeleteInstance,
    DrainInstance,
    InstanceCommand,
    PlaceInstance,
    SleepInstance,
    WakeInstance,
)
from shared.contracts.config import AliasConfig
from shared.contracts.control import AliasSnapshot, Decision, PlannedAction
from shared.contracts.events import (
    ColdStartCompleted,
    MixWeightChanged,
    PolicyDecided,
    RoutingStateChanged,
    ScalingTargetsChanged,
)
from shared.contracts.messages import Envelope, derived_id
from shared.projections.rows import PendingCommandRow


def summarize(snapshot: AliasSnapshot, decision: Decision) -> str:
    parts = []
    if decision.routing:
        parts.append(f"{decision.routing.from_state.value} -> {decision.routing.to_state.value}")
    if decision.mix:
        parts.append(f"mix {decision.mix.from_weight:.0%} -> {decision.mix.to_weight:.0%}")
    if decision.targets != snapshot.targets:
        parts.append("targets " + ", ".join(f"{b.value}={n}" for b, n in sorted(decision.targets.items())))
    for a in decision.actions:
        what = f"{a.action.value} {a.instance_id}"
        if a.action is Action.SLEEP:
            what += f" (level {a.level})"
        if a.substitute_for:
            what += f" (for {a.substitute_for.value})"
        parts.append(what)
    if decision.cold_start:
        c = decision.cold_start
        parts.append(f"cold start served by {c.instance_id} in {(c.ready_at - c.demand_at).total_seconds():.1f} s")
    return "; ".join(parts) or "no change"


def decision_events(snapshot: AliasSnapshot, decision: Decision, now: datetime) -> list[Envelope]:
    """The events one decision appends to its alias's stream, in one batch; ids derive from the decision."""
    did = decision.decision_id
    decided = Envelope.wrap(
        PolicyDecided(alias=snapshot.alias, policy=decision.policy, policy_version=decision.policy_version,
                      decided_at=now, snapshot=snapshot, decision=decision, summary=summarize(snapshot, decision)),
        id=did, occurred_at=now,
    )
    common = dict(alias=snapshot.alias, policy=decision.policy, policy_version=decision.policy_version)
    events = [decided]
    if decision.routing:
        r = decision.routing
        events.append(Envelope.wrap(
            RoutingStateChanged(**common, from_state=r.from_state, to_state=r.to_state, reason=r.reason,
                                mix_weight=decision.mix_weight, metrics=snapshot.metrics),
            id=derived_id(did, "routing"), causation=decided, occurred_at=now))
    if decision.mix:
        m = decision.mix
        events.append(Envelope.wrap(
            MixWeightChanged(**common, from_weight=m.from_weight, to_weight=m.to_weight, reason=m.reason,
                             metrics=snapshot.metrics),
            id=derived_id(did, "mix"), causation=decided, occurred_at=now))
    if decision.targets != snapshot.targets:
        events.append(Envelope.wrap(
            ScalingTargetsChanged(**common, targets=decision.targets, reason=decision.targets_reason, metrics=snapshot.metrics),
            id=derived_id(did, "targets"), causation=decided, occurred_at=now))
    if decision.cold_start:
        c = decision.cold_start
        events.append(Envelope.wrap(
            ColdStartCompleted(alias=snapshot.alias, backend_type=c.backend, instance_id=c.instance_id,
                               demand_at=c.demand_at, ready_at=c.ready_at,
                               duration_s=max(0.0, (c.ready_at - c.demand_at).total_seconds())),
            id=derived_id(did, "cold_start"), causation=decided, occurred_at=now))
    return events


def command_for(action: PlannedAction, config: AliasConfig, drain_timeout_s: float) -> Command:
    common = dict(instance_id=action.instance_id, alias=config.alias, backend_type=action.backend, reason=action.reason)
    if action.action is Action.START:
        backend = config.backends[action.backend]
        return PlaceInstance(request_id=action.command_id, engine=config.engine_for(action.backend),
                             model_name=backend.model_name, model_path=backend.model_path,
                             gpu_memory_gb=backend.gpu_memory_gb, max_model_len=backend.max_model_len,
                             tensor_parallel_size=backend.tensor_parallel_size, engine_args=backend.engine_args,
                             role=action.role, **common)
    assert action.worker_id is not None, f"{action.action.value} needs the instance's worker"
    worker = dict(common, worker_id=action.worker_id)
    if action.action is Action.WAKE:
        return WakeInstance(**worker)
    if action.action is Action.SLEEP:
        return SleepInstance(**worker, level=action.level)
    if action.action is Action.DRAIN:
        return DrainInstance(**worker, timeout_s=drain_timeout_s)
    if action.action is Action.DELETE:
        return DeleteInstance(**worker)
    raise ValueError(f"no command for {action.action.value}")


OPERATOR_DRAIN_TIMEOUT_S = 120.0
"""How long an operator's drain waits for the instance's requests."""


def operator_command(alias: str, c: PendingCommandRow) -> InstanceCommand:
    """The worker's command for an operator's instance action (`OperatorCommanded`), with who asked and why."""
    assert c.worker_id is not None and c.operator is not None
    common = dict(instance_id=c.instance_id, alias=alias, backend_type=c.backend, worker_id=c.worker_id,
                  reason=f"operator {c.operator}")
    if c.action is Action.DRAIN:
        return DrainInstance(**common, timeout_s=OPERATOR_DRAIN_TIMEOUT_S)
    if c.action is Action.SLEEP:
        return SleepInstance(**common, level=c.level)
    if c.action is Action.WAKE:
        return WakeInstance(**common)
    if c.action is Action.DELETE:
        return DeleteInstance(**common)
    raise ValueError(f"no operator command for {c.action.value}")


def subject_for(action: PlannedAction, subjects: Subjects) -> str:
    if action.action is Action.START:
        return subjects.placement_commands
    assert action.worker_id is not None
    return subjects.worker_commands(action.worker_id)
