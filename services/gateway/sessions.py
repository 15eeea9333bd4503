"""Session bindings: which instance holds each session's KV, recorded in the log, followed by every replica.

A router that binds sessions (affinity, EAR) asks for a log write only when a
session is first placed (`SessionBound`) and when it moves (`SessionMigrated`);
every other request reads the table in memory. Each session is its own stream,
so two replicas binding the same new session at once cannot both win: the
stream version decides, and the loser reads the winner's binding and follows it.
Bindings made by other replicas arrive through the live view. A session idle for
the router's `session_idle_s` is released (`SessionReleased`), and its next
request is placed anew.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from routing.scheduler import SessionState
from shared.contracts.events import SessionBound, SessionMigrated, SessionReleased
from shared.contracts.messages import Envelope
from shared.eventlog.store import ConcurrencyError, EventStore, RawEvent

log = logging.getLogger(__name__)

SESSION_EVENTS = frozenset({"SessionBound", "SessionMigrated", "SessionReleased"})


@dataclass(slots=True)
class Binding:
    alias: str
    host: str
    moved_at: float | None = None
    """Wall-clock seconds of the last migration (the log's time, the same for every replica)."""
    version: int | None = None
    """The session stream's version after the event this replica knows of; None when another replica wrote since."""
    position: int = 0
    """Log position of that event: older events arriving through the view change nothing."""
    context_tokens: int = 0
    """Tokens the session holds on its host, as far as this replica has seen."""
    last_seen: float = 0.0
    """Monotonic time of this replica's last request of the session."""


def stream_of(session_id: str) -> str:
    return f"{SessionBound.CATEGORY}:{session_id}"


class Sessions:
    """The session table of one gateway replica, written through to the log."""

    def __init__(self, store: EventStore, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self.wall = wall
        self.bindings: dict[str, Binding] = {}
        self.resident: dict[str, int] = {}
        """Per instance, the context tokens of the sessions bound to it."""

    # ------------------------------------------------------------------ reading

    def state(self, session_id: str) -> SessionState:
        b = self.bindings.get(session_id)
        if b is None:
            return SessionState(session_id)
        return SessionState(session_id, b.host, b.moved_at, b.context_tokens)

    def load(self, rows: dict[str, dict]) -> None:
        """The bindings as the view's session rows have them at start."""
        for session_id, row in rows.items():
            moved = row.get("last_migrated_at")
            self.bindings[session_id] = Binding(row["alias"], row["instance_id"], moved.timestamp() if moved else None)

    def apply(self, events: Sequence[RawEvent]) -> None:
        """Follow bindings other replicas recorded (our own come back too, and change nothing)."""
        for event in events:
            if event.type not in SESSION_EVENTS:
                continue
            p = event.payload
            session_id = p["session_id"]
            known = self.bindings.get(session_id)
            if known is not None and known.position >= event.position:
                continue
            if event.type == "SessionReleased":
                self._drop(session_id)
                continue
            host = p["instance_id"] if event.type == "SessionBound" else p["to_instance_id"]
            moved = event.occurred_at.timestamp() if event.type == "SessionMigrated" else None
            self._set(session_id, Binding(p["alias"], host, moved, None, event.position,
                                          known.context_tokens if known else 0, known.last_seen if known else 0.0))

    def kv_resident(self, instance_id: str) -> int:
        return self.resident.get(instance_id, 0)

    # ------------------------------------------------------------------ writing

    def seen(self, session_id: str, context_tokens: int) -> None:
        """A request of the session was served: its context on the host is now `context_tokens`."""
        b = self.bindings.get(session_id)
        if b is None:
            return
        self.resident[b.host] = self.resident.get(b.host, 0) + context_tokens - b.context_tokens
        b.context_tokens, b.last_seen = context_tokens, self.clock()

    async def bind(self, session_id: str, alias: str, instance_id: str) -> str:
        """Record the session's first host; the host it has once the log has spoken (another replica's, if it won)."""
        expected = 0
        for _ in range(3):
            event = Envelope.wrap(SessionBound(session_id=session_id, alias=alias, instance_id=instance_id))
            try:
                [stored] = await self.store.append(stream_of(session_id), [event], expected_version=expected)
            except ConcurrencyError as exc:
                winner = await self._read(session_id)
                if winner is not None:
                    return winner.host  # another replica bound it first: follow
                expected = exc.actual  # the stream holds an earlier, released binding
                continue
            self._set(session_id, Binding(alias, instance_id, None, stored.stream_version, stored.position,
                                          last_seen=self.clock()))
            return instance_id
        raise RuntimeError(f"session {session_id} could not be bound: its stream keeps changing")

    async def migrate(self, session_id: str, alias: str, source: str, target: str, reason: str,
                      metrics: dict[str, float]) -> str:
        """Record a move; the host the session has afterwards (another replica's move, if one came first)."""
        b = self.bindings.get(session_id)
        known = b.version if b is not None else None
        version = known if known is not None else await self.store.stream_version(stream_of(session_id))
        event = Envelope.wrap(SessionMigrated(session_id=session_id, alias=alias, from_instance_id=source,
                                              to_instance_id=target, reason=reason, metrics=metrics))
        try:
            [stored] = await self.store.append(stream_of(session_id), [event], expected_version=version)
        except ConcurrencyError:
            winner = await self._read(session_id)
            return winner.host if winner is not None else target
        context = b.context_tokens if b else 0
        self._set(session_id, Binding(alias, target, stored.occurred_at.timestamp(), stored.stream_version,
                                      stored.position, context, self.clock()))
        return target

    async def release_idle(self, idle_s: Callable[[str], float | None]) -> int:
        """Release the sessions this replica served that have been idle longer than their alias's `idle_s`."""
        now, released = self.clock(), 0
        for session_id, b in list(self.bindings.items()):
            limit = idle_s(b.alias)
            if limit is None or not b.last_seen or now - b.last_seen < limit:
                continue
            event = Envelope.wrap(SessionReleased(session_id=session_id, alias=b.alias, reason=f"idle {limit:g} s"))
            version = b.version if b.version is not None else await self.store.stream_version(stream_of(session_id))
            try:
                await self.store.append(stream_of(session_id), [event], expected_version=version)
            except ConcurrencyError:
                continue  # another replica moved or used it meanwhile
            self._drop(session_id)
            released += 1
        return released

    async def run_releases(self, idle_s: Callable[[str], float | None], stop: asyncio.Event, every_s: float) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass
            try:
                await self.release_idle(idle_s)
            except Exception:
                log.exception("releasing idle sessions failed; trying again")

    # ------------------------------------------------------------------ internals

    async def _read(self, session_id: str) -> Binding | None:
        """The session's binding as its stream has it now, or None if released."""
        events = await self.store.read_stream(stream_of(session_id))
        last = events[-1] if events else None
        if last is None or last.type == "SessionReleased":
            return None
        host = last.payload["instance_id"] if last.type == "SessionBound" else last.payload["to_instance_id"]
        moved = last.occurred_at.timestamp() if last.type == "SessionMigrated" else None
        known = self.bindings.get(session_id)
        binding = Binding(last.payload["alias"], host, moved, last.stream_version, last.position or 0,
                          known.context_tokens if known else 0, self.clock())
        self._set(session_id, binding)
        return binding

    def _set(self, session_id: str, binding: Binding) -> None:
        old = self.bindings.get(session_id)
        if old is not None:
            self.resident[old.host] = self.resident.get(old.host, 0) - old.context_tokens
        self.bindings[session_id] = binding
        self.resident[binding.host] = self.resident.get(binding.host, 0) + binding.context_tokens

    def _drop(self, session_id: str) -> None:
        old = self.bindings.pop(session_id, None)
        if old is not None:
            self.resident[old.host] = self.resident.get(old.host, 0) - old.context_tokens
