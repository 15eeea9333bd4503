"""Ids a decision makes, derived from the alias stream version it was decided at.

A decision about an alias at stream version v gets one id; its commands and new
instances get ids derived from it. The same decision recomputed (by a standby
that took over, or by `replay --verify-decisions`) names the same commands and
instances, so a command sent twice is recognised as one everywhere it lands.
"""

from __future__ import annotations

import uuid
from functools import lru_cache

from shared.contracts.backends import Action, BackendType, Role
from shared.contracts.messages import derived_id

_DECISIONS = uuid.UUID("6b0e2c58-3f1d-4f63-9a55-2d7c1e4b8a90")


@lru_cache(maxsize=8192)  # asked for every alias at every tick; the version moves only on a decision
def decision_id(alias: str, version: int) -> uuid.UUID:
    return uuid.uuid5(_DECISIONS, f"{alias}:{version}")


def command_id(decision: uuid.UUID, action: Action, instance_id: str) -> uuid.UUID:
    return derived_id(decision, f"{action.value}:{instance_id}")


def new_instance_id(alias: str, backend: BackendType, version: int, index: int, role: Role | None = None) -> str:
    """`qwen3-vl-2b-fast-12`, `qwen3-vl-2b-slow-12-2`, `qwen3-vl-2b-slow-decode-12-3`: readable, unique per alias
    stream version."""
    base = f"{alias}-{backend.tier}-{role.value + '-' if role else ''}{version}"
    return base if index == 0 else f"{base}-{index + 1}"
