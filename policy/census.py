"""Counting what a tier of an alias has, counting in-flight commands as done.

Level-triggered control compares what it wants with what is observed *plus what
is already on its way*: a start sent but not yet in the log counts as an awake
replica, an instance being put to sleep no longer does. One command at a time
per instance: an instance with a command pending gets no other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.contracts.backends import Action, BackendType, Role
from shared.contracts.control import AliasSnapshot, InstanceView
from shared.contracts.states import InstanceState

AWAKE_STATES = frozenset({InstanceState.RUNNING, InstanceState.STARTING})
ASLEEP_STATES = frozenset({InstanceState.SLEEP_1, InstanceState.SLEEP_2})
RELEASING = frozenset({Action.SLEEP, Action.DRAIN, Action.DELETE})
REMOVING = frozenset({Action.DRAIN, Action.DELETE})
PROVISIONED_STATES = AWAKE_STATES | ASLEEP_STATES


@dataclass(slots=True)
class TierCensus:
    awake: tuple[InstanceView, ...]
    """Running or starting, with no sleep, drain or delete on its way."""
    waking: tuple[InstanceView, ...]
    """Asleep with a wake on its way."""
    asleep: tuple[InstanceView, ...]
    """Asleep with nothing pending."""
    unseen_starts: int
    """Starts sent whose instance is not in the log yet."""
    busy: frozenset[str]
    """Instances with a command pending."""
    supply: int
    """Awake, waking and starting: what the tier has, counting what is on its way."""
    by_role: dict[Role, int]
    """The supply by role, in a disaggregated tier (empty otherwise)."""
    kept: tuple[InstanceView, ...]
    """Awake or asleep, with no drain or delete on its way: what the tier still has once its commands land
    (with `unseen_starts`), whether awake or not."""


def _by_role(counted: Iterable[InstanceView], unseen: Iterable[Role | None]) -> dict[Role, int]:
    out: dict[Role, int] = {}
    for role in (*(i.role for i in counted), *unseen):
        if role is not None:
            out[role] = out.get(role, 0) + 1
    return out


def census(s: AliasSnapshot, backend: BackendType) -> TierCensus:
    pending = s.pending_by_instance
    if not pending:  # most ticks of most aliases: nothing in flight
        instances = s.of(backend)
        awake = tuple(i for i in instances if i.state in AWAKE_STATES)
        asleep = tuple(i for i in instances if i.state in ASLEEP_STATES)
        return TierCensus(awake, (), asleep, 0, frozenset(), len(awake), _by_role(awake, ()), awake + asleep)
    awake, waking, asleep, busy, kept = [], [], [], [], []
    for i in s.of(backend):
        command = pending.get(i.instance_id)
        action = command.action if command else None
        if command:
            busy.append(i.instance_id)
        if i.state in PROVISIONED_STATES and action not in REMOVING:
            kept.append(i)
        if i.state in AWAKE_STATES:
            if action not in RELEASING:
                awake.append(i)
        elif i.state in ASLEEP_STATES:
            if action is Action.WAKE:
                waking.append(i)
            elif command is None:
                asleep.append(i)
    known = {i.instance_id for i in s.instances}
    unseen = tuple(p.role for p in s.pending
                   if p.action is Action.START and p.backend is backend and p.instance_id not in known)
    return TierCensus(tuple(awake), tuple(waking), tuple(asleep), len(unseen), frozenset(busy),
                      len(awake) + len(waking) + len(unseen), _by_role((*awake, *waking), unseen), tuple(kept))
