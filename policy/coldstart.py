"""When a cold start ends: the first instance serving after demand reached a cold alias."""

from __future__ import annotations

from datetime import datetime

from shared.contracts.control import AliasSnapshot, ColdStart
from shared.contracts.states import InstanceState


def first_serving(s: AliasSnapshot, demand_at: datetime) -> ColdStart | None:
    """The cold start that began at `demand_at`, if an instance has come up since; None while none has."""
    serving = sorted((i for i in s.instances if i.state is InstanceState.RUNNING and i.state_since >= demand_at),
                     key=lambda i: (i.state_since, i.instance_id))
    if not serving:
        return None
    first = serving[0]
    return ColdStart(first.backend, first.instance_id, demand_at, first.state_since)
