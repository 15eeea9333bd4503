"""What operators ask of the controller (`OperatorHold`), applied to a decision.

A paused alias is left as it is: no routing switch, no mix step, no new targets,
no command, its policy state kept for when it is resumed. A pinned tier decides
as if its configuration said `min_replicas` = the pin (capped at `max_replicas`),
so every policy honours it the same way and the decision's reason says so.
"""

from __future__ import annotations

import dataclasses
import uuid

from shared.contracts.building import new_decision
from shared.contracts.control import AliasSnapshot, Decision, NextStep


def paused_decision(snapshot: AliasSnapshot, policy: str, policy_version: int, decision_id: uuid.UUID) -> Decision:
    """The decision of a paused alias: everything as the snapshot has it, and the outlook saying who paused it."""
    return new_decision(
        policy=policy, policy_version=policy_version, decision_id=decision_id,
        targets=dict(snapshot.targets), targets_reason=f"paused by {snapshot.operator.paused}",
        state=snapshot.state, mix_weight=snapshot.mix_weight,
        outlook=(NextStep(f"nothing: the controller is paused for this alias by {snapshot.operator.paused}"),),
    )


def pinned(snapshot: AliasSnapshot) -> AliasSnapshot:
    """The snapshot with each pinned tier's `min_replicas` replaced by its pin (within its `max_replicas`)."""
    pins = {b: n for b, n in snapshot.operator.min_replicas.items() if b in snapshot.config.backends}
    if not pins:
        return snapshot
    backends = {b: c.model_copy(update={"min_replicas": min(pins[b], c.max_replicas)}) if b in pins else c
                for b, c in snapshot.config.backends.items()}
    return dataclasses.replace(snapshot, config=snapshot.config.model_copy(update={"backends": backends}))


def pin_note(snapshot: AliasSnapshot) -> str:
    """What the reason of a pinned alias's targets adds ("" when nothing is pinned)."""
    pins = sorted((b.value, n) for b, n in snapshot.operator.min_replicas.items() if b in snapshot.config.backends)
    return "; ".join(f"{b} min_replicas pinned to {n} by an operator" for b, n in pins)
