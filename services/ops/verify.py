"""Re-running recorded decisions through the policy code: does the controller do what its code says?

Every `PolicyDecided` carries the snapshot it was computed from and the time it
was decided at. Feeding both to `policy.decide` must give the recorded decision
again, field for field; anything else is reported. A decision recorded by
another version of the policy cannot be reproduced and is reported as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policy import UnknownPolicy, decide, policy_named
from shared.contracts.control import DECISION
from shared.contracts.events import PolicyDecided
from shared.contracts.messages import InvalidMessage, Registry
from shared.eventlog.store import EventStore


@dataclass(frozen=True)
class Mismatch:
    position: int
    alias: str
    decided_at: str
    differences: tuple[str, ...]

    def describe(self) -> str:
        return f"#{self.position} {self.alias} at {self.decided_at}: " + "; ".join(self.differences)


def _diff(recorded: Any, recomputed: Any, path: str = "decision") -> list[str]:
    if isinstance(recorded, dict) and isinstance(recomputed, dict):
        out = []
        for key in sorted(set(recorded) | set(recomputed), key=str):
            out += _diff(recorded.get(key), recomputed.get(key), f"{path}.{key}")
        return out
    if isinstance(recorded, list) and isinstance(recomputed, list) and len(recorded) == len(recomputed):
        return [d for i, (a, b) in enumerate(zip(recorded, recomputed)) for d in _diff(a, b, f"{path}[{i}]")]
    if recorded != recomputed:
        return [f"{path}: recorded {recorded!r}, code says {recomputed!r}"]
    return []


async def verify_decisions(store: EventStore, registry: Registry, alias: str | None = None) -> tuple[int, list[Mismatch]]:
    """(decisions checked, the ones the code does not reproduce)."""
    events = await store.of_type(PolicyDecided.TYPE, alias=alias)
    mismatches = []
    for envelope in events:
        where = dict(position=envelope.position or 0, alias=envelope.payload.get("alias", "?"),
                     decided_at=str(envelope.payload.get("decided_at")))
        try:
            recorded = registry.decode(envelope)
            assert isinstance(recorded, PolicyDecided)
            policy = policy_named(recorded.policy)
        except (InvalidMessage, UnknownPolicy) as exc:
            mismatches.append(Mismatch(**where, differences=(str(exc),)))
            continue
        if policy.version != recorded.policy_version:
            mismatches.append(Mismatch(**where, differences=(
                f"recorded by {recorded.policy} v{recorded.policy_version}; this code is v{policy.version}",)))
            continue
        recomputed = DECISION.dump_python(decide(recorded.snapshot, recorded.decided_at), mode="json")
        differences = _diff(envelope.payload["decision"], recomputed)
        if differences:
            mismatches.append(Mismatch(**where, differences=tuple(differences)))
    return len(events), mismatches
