"""The event log's interface: append-only, optimistic concurrency per stream, a global order to tail.

`EventStore` is what every writer and reader of the log uses; two adapters keep
it: `PostgresEventStore` (`postgres.py`, the pool's source of truth) and
`MemoryEventStore` (`memory.py`, for tests and tools that need no server). Both
check appends the same way here, and one contract suite runs against both
(`tests/eventlog/`).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from shared.contracts.messages import FROM_THE_LOG, Envelope, Event, Registry

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine


class ConcurrencyError(Exception):
    """Another writer appended to the stream first. Nothing was written."""

    def __init__(self, stream_id: str, expected: int, actual: int) -> None:
        self.stream_id, self.expected, self.actual = stream_id, expected, actual
        super().__init__(f"stream {stream_id!r} is at version {actual}, expected {expected}")


class DuplicateEventError(ValueError):
    """A batch mixes events already in the log with new ones: not a retry, a bug."""


ANY_VERSION = -1
"""`expected_version` meaning: append at the head, whatever it is."""


@dataclass(frozen=True, slots=True)
class Append:
    """Events for one stream, appended only if the stream is at `expected_version` (0 = new)."""

    stream_id: str
    events: Sequence[Envelope]
    expected_version: int = ANY_VERSION


class StoredEvent(NamedTuple):
    """A stored event as the read models fold it: where it stands in the log, when, and the typed fact.

    A named tuple, not a frozen dataclass: a rebuild makes a million of them, and a
    frozen dataclass's __init__ costs several times more.
    """

    position: int
    occurred_at: datetime
    event: Event


Decoder = Callable[[dict[str, Any] | str], Event]
"""A stored payload (an object, or its JSON text) -> its contract at the latest version."""


@dataclass(frozen=True, slots=True)
class OutboxEvent:
    """A committed event as the relay publishes it."""

    position: int
    id: str
    stream_id: str
    type: str
    version: int
    headers: dict[str, str]
    body: bytes


class EventStore(ABC):
    """The event log: streams of versioned events, each append checked against the contracts, positions
    increasing in commit order so a reader tailing them never passes one a slower writer fills later."""

    def __init__(self, registry: Registry, *, notify_channel: str) -> None:
        self.registry = registry
        self._decoders: dict[tuple[str, int], Decoder | None] = {}
        self.notify_channel = notify_channel

    # ------------------------------------------------------------------ writing

    async def append(
        self,
        stream_id: str,
        events: Sequence[Envelope],
        expected_version: int = ANY_VERSION,
        *,
        headers: dict[str, str] | None = None,
    ) -> list[Envelope]:
        return await self.append_batch([Append(stream_id, events, expected_version)], headers=headers)

    async def append_batch(self, appends: Sequence[Append], *, headers: dict[str, str] | None = None) -> list[Envelope]:
        """Append to one or more streams atomically; return the events with their positions.

        All or nothing for this call: if any stream is not at its expected version,
        `ConcurrencyError` is raised and nothing of this call is written.

        Idempotent by event id: appending events that are all already stored returns
        the stored copies and writes nothing, whatever `expected_version` says, so a
        retried append (or a redelivered command) has one effect.
        """
        all_events = [e for a in appends for e in a.events]
        if not all_events:
            return []
        streams = [a.stream_id for a in appends]
        if len(set(streams)) != len(streams):
            raise ValueError("one append names a stream twice; put its events in one Append")
        for a in appends:
            for e in a.events:
                if e.stream_id not in (None, a.stream_id):
                    raise ValueError(f"event {e.type} belongs to stream {e.stream_id!r}, not {a.stream_id!r}")
                # Nothing enters the log that the contracts would refuse on read.
                self.registry.decode(e)
        ids = [e.id for e in all_events]
        if len(set(ids)) != len(ids):
            raise DuplicateEventError("the same event id appears twice in one append")
        return await self._commit(appends, json.dumps(headers or {}))

    @abstractmethod
    async def _commit(self, appends: Sequence[Append], headers: str) -> list[Envelope]:
        """Store checked appends atomically (or find them all stored already); see `append_batch`."""

    # ------------------------------------------------------------------ reading

    @abstractmethod
    async def get(self, event_id: uuid.UUID) -> Envelope | None:
        """The stored event with this id, upcast; None if there is none."""

    async def contains(self, event_id: uuid.UUID) -> bool:
        return await self.get(event_id) is not None

    @abstractmethod
    async def stream_version(self, stream_id: str) -> int:
        """The stream's latest version; 0 for a stream with no events."""

    @abstractmethod
    async def read_stream(self, stream_id: str) -> list[Envelope]:
        """The stream's events in version order, upcast."""

    @abstractmethod
    async def last_of(self, stream_id: str) -> Envelope | None:
        """The stream's latest event, or None for a stream with none."""

    @abstractmethod
    async def read_after(self, position: int, limit: int = 1000) -> list[Envelope]:
        """Committed events after `position`, in position order, upcast. Safe to tail."""

    @abstractmethod
    async def head_position(self) -> int:
        """The position of the latest committed event; 0 for an empty log."""

    @abstractmethod
    async def read_outbox(self, position: int, limit: int = 1000) -> list[OutboxEvent]:
        """Committed events after `position`, as the relay publishes them (the envelope's JSON, as stored)."""

    @abstractmethod
    async def history(self, alias: str, *, since: datetime | None = None, until: datetime | None = None,
                      types: Collection[str] | None = None) -> list[Envelope]:
        """Every event naming the alias in [since, until], in log order, upcast; `types` limits the read."""

    @abstractmethod
    async def of_type(self, type_name: str, *, alias: str | None = None) -> list[Envelope]:
        """Every stored event of one type (optionally of one alias), in log order, upcast."""

    @abstractmethod
    def iter_events(self, after: int, upto: int | None = None, batch: int = 20000,
                    types: Collection[str] | None = None) -> AsyncIterator[list[StoredEvent]]:
        """Events after `after` (up to `upto`) in position order, upcast and decoded into their contracts, in
        batches, for the read models; `types` limits the read to the types the caller folds. Types this code
        does not know (written by a newer release) are skipped."""

    def fact(self, envelope: Envelope | None) -> Event | None:
        """A read envelope's typed fact, decoded as the read models decode it; None for no envelope (an empty
        stream's last event) or a type this code does not know."""
        if envelope is None:
            return None
        decode = self._decoder(envelope.type, envelope.version)
        return decode(envelope.payload) if decode is not None else None

    def typed(self, envelopes: Sequence[Envelope]) -> list[tuple[Envelope, Event]]:
        """Read envelopes beside their typed facts; types this code does not know are left out."""
        return [(e, fact) for e in envelopes if (fact := self.fact(e)) is not None]

    def _decoder(self, type_name: str, version: int) -> Decoder | None:
        """How a stored payload of this type and version (an object, or its JSON text) becomes its contract at the
        latest version this code knows; None for a type this code does not know (written by a newer release).

        Made once per (type, version) and kept: a rebuild decodes a million payloads.
        """
        key = (type_name, version)
        if key not in self._decoders:
            self._decoders[key] = self._make_decoder(type_name, version) if self.registry.known(type_name) else None
        return self._decoders[key]

    def _make_decoder(self, type_name: str, version: int) -> Decoder:
        # The contract's own validator, without `model_validate`'s wrapper: a rebuild calls it a million times.
        validator = self.registry.contract(type_name).__pydantic_validator__
        if self.registry.valid_as_is(type_name, version):
            def current(payload: dict[str, Any] | str) -> Event:
                # From text, pydantic parses and validates in one pass.
                if isinstance(payload, str):
                    return validator.validate_json(payload, context=FROM_THE_LOG)
                return validator.validate_python(payload, context=FROM_THE_LOG)
            return current

        steps = self.registry.upcasters(type_name, version)

        def older(payload: dict[str, Any] | str) -> Event:
            fields = orjson.loads(payload) if isinstance(payload, str) else payload
            for step in steps:
                fields = step(fields)
            return validator.validate_python(fields, context=FROM_THE_LOG)
        return older

    def _upcast(self, envelope: Envelope) -> Envelope:
        """Readers see the latest version of every contract this code knows."""
        if not self.registry.known(envelope.type):
            return envelope
        version, payload = self.registry.upcast(envelope.type, envelope.version, envelope.payload)
        if version == envelope.version:
            return envelope
        return envelope.model_copy(update={"version": version, "payload": payload})


def notify_channel(namespace: str) -> str:
    return f"{namespace}_events"


def make_store(engine: "AsyncEngine", registry: Registry, namespace: str) -> EventStore:
    """The pool's event store: in the Postgres schema `engine` points at."""
    from shared.eventlog.postgres import PostgresEventStore

    return PostgresEventStore(engine, registry, notify_channel=notify_channel(namespace))
