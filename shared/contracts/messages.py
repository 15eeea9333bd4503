"""The message envelope shared by events and commands, and the contract registry.

Every event and command is a versioned pydantic model with a fixed `TYPE` and
`VERSION`. Stored events are never rewritten: when a contract changes, a new
version is added and an upcaster turns the old payload into the new shape on read.
"""

from __future__ import annotations

import uuid
from abc import abstractmethod
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo

# A fixed namespace so ids derived from other ids are the same in every process:
# the effect of handling a command gets an event id derived from the command id,
# which makes a redelivered command append the same event (stored once).
_DERIVED_ID_NAMESPACE = uuid.UUID("0c6f1d3e-9a4b-4c8e-8f0e-6d5b2a7c9e11")


def derived_id(parent: uuid.UUID, purpose: str) -> uuid.UUID:
    return uuid.uuid5(_DERIVED_ID_NAMESPACE, f"{parent}:{purpose}")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Contract(BaseModel):
    """Base of every event payload and command payload."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    TYPE: ClassVar[str]
    VERSION: ClassVar[int] = 1


FROM_THE_LOG = {"from_the_log": True}
"""Validation context for an event read back from the log: its types are checked, the rules it was checked
against when written (legal transitions) are not. The log says what happened; a rule changed since must
not make history unreadable."""


def from_the_log(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("from_the_log"))


class Event(Contract):
    """An event payload. `CATEGORY` + `stream_key()` name the stream it belongs to."""

    CATEGORY: ClassVar[str]

    @abstractmethod
    def stream_key(self) -> str: ...

    def stream_id(self) -> str:
        return f"{self.CATEGORY}:{self.stream_key()}"


class Command(Contract):
    """A command payload: a request for an effect, addressed to one handler."""


class Envelope(BaseModel):
    """Metadata carried with every message, on the bus and in the log."""

    model_config = ConfigDict(frozen=True)

    id: uuid.UUID = Field(default_factory=uuid.uuid4)
    type: str
    version: int
    occurred_at: datetime = Field(default_factory=utcnow)
    causation_id: uuid.UUID | None = None
    correlation_id: uuid.UUID | None = None
    payload: dict[str, Any]

    # Set on events once they are in the log.
    stream_id: str | None = None
    stream_version: int | None = None
    position: int | None = None

    @classmethod
    def wrap(
        cls,
        message: Contract,
        *,
        id: uuid.UUID | None = None,
        causation: "Envelope | None" = None,
        correlation_id: uuid.UUID | None = None,
        occurred_at: datetime | None = None,
    ) -> "Envelope":
        """Wrap a payload. A message caused by another inherits its correlation id."""
        message_id = id or uuid.uuid4()
        if correlation_id is None:
            correlation_id = (causation.correlation_id or causation.id) if causation else message_id
        return cls(
            id=message_id,
            type=message.TYPE,
            version=message.VERSION,
            occurred_at=occurred_at or utcnow(),
            causation_id=causation.id if causation else None,
            correlation_id=correlation_id,
            payload=message.model_dump(mode="json"),
            stream_id=message.stream_id() if isinstance(message, Event) else None,
        )


def describe_errors(exc: ValidationError) -> str:
    """`field.path: message` for each validation error, on one line."""
    parts = []
    for error in exc.errors():
        field = ".".join(str(p) for p in error["loc"]) or "<message>"
        parts.append(f"{field}: {error['msg']}")
    return "; ".join(parts)


class UnknownMessageType(LookupError):
    pass


class InvalidMessage(ValueError):
    pass


C = TypeVar("C", bound=type[Contract])
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


class Registry:
    """Maps (type, version) to contract classes and upcasts old payloads on read."""

    def __init__(self, contracts: Iterable[type[Contract]] = ()) -> None:
        self._latest: dict[str, type[Contract]] = {}
        self._upcasters: dict[tuple[str, int], Upcaster] = {}
        self._as_is: set[tuple[str, int]] = set()
        """(type, version) steps after which an old payload is still a valid new one."""
        for contract in contracts:
            self.register(contract)

    def register(self, contract: C) -> C:
        existing = self._latest.get(contract.TYPE)
        if existing is not None and existing is not contract:
            raise ValueError(f"two contracts claim type {contract.TYPE!r}")
        self._latest[contract.TYPE] = contract
        return contract

    def upcaster(self, type_name: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        """Register a function turning a `from_version` payload into `from_version + 1`."""

        def decorate(fn: Upcaster) -> Upcaster:
            self._upcasters[(type_name, from_version)] = fn
            return fn

        return decorate

    def fields_added(self, type_name: str, from_version: int, *fields: str) -> None:
        """Version `from_version + 1` only added `fields`, each with a default: an old payload is a valid new
        one as it is (readers decode it directly), and upcasting it fills in the defaults."""
        model_fields = self.contract(type_name).model_fields  # type: ignore[attr-defined]
        required = [f for f in fields if f not in model_fields or model_fields[f].is_required()]
        if required:
            raise ValueError(f"{type_name} v{from_version + 1}: {', '.join(required)} must be fields with defaults")

        def upcast(payload: dict[str, Any]) -> dict[str, Any]:
            return {**payload, **{f: model_fields[f].get_default(call_default_factory=True) for f in fields}}

        self._upcasters[(type_name, from_version)] = upcast
        self._as_is.add((type_name, from_version))

    def valid_as_is(self, type_name: str, version: int) -> bool:
        """Whether a `version` payload validates as the latest contract without upcasting."""
        latest = self.contract(type_name).VERSION
        return version <= latest and all((type_name, v) in self._as_is for v in range(version, latest))

    def known(self, type_name: str) -> bool:
        return type_name in self._latest

    def contract(self, type_name: str) -> type[Contract]:
        try:
            return self._latest[type_name]
        except KeyError:
            raise UnknownMessageType(f"unknown message type {type_name!r}") from None

    def upcast(self, type_name: str, version: int, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Bring a payload to the latest version of its contract."""
        for step in self.upcasters(type_name, version):
            payload = step(payload)
        return self.contract(type_name).VERSION, payload

    def upcasters(self, type_name: str, version: int) -> list[Upcaster]:
        """The steps that bring a `version` payload to the latest version of its contract, in order."""
        latest = self.contract(type_name).VERSION
        if version > latest:
            raise InvalidMessage(f"{type_name} v{version} is newer than this code (v{latest})")
        steps = []
        for v in range(version, latest):
            step = self._upcasters.get((type_name, v))
            if step is None:
                raise InvalidMessage(f"no upcaster for {type_name} v{v} -> v{v + 1}")
            steps.append(step)
        return steps

    def decode(self, envelope: Envelope) -> Contract:
        """The typed payload of an envelope, upcast to the latest version and validated."""
        contract = self.contract(envelope.type)
        _, payload = self.upcast(envelope.type, envelope.version, envelope.payload)
        try:
            return contract.model_validate(payload)
        except ValidationError as exc:
            raise InvalidMessage(f"{envelope.type} v{envelope.version}: {describe_errors(exc)}") from exc
