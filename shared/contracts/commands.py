"""Commands: requests for an effect, each addressed to exactly one handler.

Instance commands go to one worker (seed 000 §3.1's unified interface
`start / wake / sleep / drain / delete / status`); placement requests go to the
placement service. Every command carries `backend_type` explicitly (§12.2: never
inferred). A command's outcome is recorded as an event whose id is derived from
the command id, so handling a redelivered command stores nothing twice.
"""

from __future__ import annotations

import re
import uuid
from typing import ClassVar

from pydantic import Field, field_validator

from shared.contracts.backends import Action, BackendType, EngineKind, Role
from shared.contracts.messages import Command, Registry

# Worker ids appear in bus subjects, where `.`, `*`, `>` and spaces are not allowed.
WORKER_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_worker_id(value: str) -> str:
    if not WORKER_ID.match(value):
        raise ValueError("worker_id must be 1-64 characters of letters, digits, '_' or '-'")
    return value


class InstanceCommand(Command):
    ACTION: ClassVar[Action]

    instance_id: str = Field(min_length=1)
    alias: str = Field(min_length=1)
    backend_type: BackendType
    worker_id: str
    reason: str = ""

    @field_validator("worker_id")
    @classmethod
    def _subject_safe(cls, worker_id: str) -> str:
        return check_worker_id(worker_id)


class EngineSpec(Command):
    """What to run for a new instance: the engine and the model, from the alias's backend config."""

    engine: EngineKind
    model_name: str
    model_path: str
    gpu_memory_gb: float = Field(ge=0)
    max_model_len: int | None = Field(default=None, ge=1)
    tensor_parallel_size: int = Field(default=1, ge=1)
    engine_args: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """v2: the backend's extra engine flags (`BackendConfig.engine_args`)."""
    role: Role | None = None
    """v3: prefill or decode, for an instance of a disaggregated alias (HeteroScale)."""


class StartInstance(InstanceCommand, EngineSpec):
    TYPE = "StartInstance"
    VERSION = 3
    ACTION = Action.START


class WakeInstance(InstanceCommand):
    TYPE = "WakeInstance"
    ACTION = Action.WAKE


class SleepInstance(InstanceCommand):
    TYPE = "SleepInstance"
    ACTION = Action.SLEEP
    level: int = Field(ge=1, le=2)


class DrainInstance(InstanceCommand):
    TYPE = "DrainInstance"
    ACTION = Action.DRAIN
    timeout_s: float = Field(default=120.0, gt=0)


class DeleteInstance(InstanceCommand):
    TYPE = "DeleteInstance"
    ACTION = Action.DELETE


class ProbeInstance(InstanceCommand):
    TYPE = "ProbeInstance"
    ACTION = Action.STATUS


class PlaceInstance(EngineSpec):
    """Ask placement for a worker for a new instance, then have it started there."""

    TYPE = "PlaceInstance"
    VERSION = 3
    request_id: uuid.UUID
    instance_id: str = Field(min_length=1)
    alias: str = Field(min_length=1)
    backend_type: BackendType
    reason: str = ""


INSTANCE_COMMANDS: tuple[type[InstanceCommand], ...] = (
    StartInstance,
    WakeInstance,
    SleepInstance,
    DrainInstance,
    DeleteInstance,
    ProbeInstance,
)
COMMANDS: tuple[type[Command], ...] = (*INSTANCE_COMMANDS, PlaceInstance)


def command_registry() -> Registry:
    registry = Registry(COMMANDS)
    for contract in (StartInstance, PlaceInstance):
        registry.fields_added(contract.TYPE, 1, "engine_args")
        registry.fields_added(contract.TYPE, 2, "role")
    return registry
