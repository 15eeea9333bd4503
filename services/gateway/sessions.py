"""Session bindings: which instance holds each session's KV, recorded in the log, followed by every replica.

A router that binds sessions (affinity, EAR) asks for a log write only when a
session is first placed (`SessionBound`) and when it moves (`SessionMigrated`);
every other request reads the table in memory. The writes go behind the
requests, never in their way: a binding is in effect in this replica at once,
and recorded by a writer that waits out a Postgres outage. Each session is its
own stream, so two replicas binding the same new session at once cannot both
win: the stream version decides, and the loser reads the winner's binding and
follows it from its next request on.
Bindings made by other replicas arrive through the live view. A session idle for
the router's `session_idle_s` is released (`SessionReleased`), and its next
request is placed anew. The replica keeps the last request of each session it
served (within `MAX_KEPT_REQUEST_BYTES`): the KV of a session handed over at
scale-down is exported by it (`handoff.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from routing.scheduler import SessionState
from shared.contracts.events import SessionBound, SessionMigrated, SessionReleased
from shared.contracts.messages import Envelope
from shared.eventlog.store import ConcurrencyError, EventStore, StoredEvent
from shared.faults import Backoff, Outage, is_transient
from shared.projections.rows import SessionRow

log = logging.getLogger(__name__)

MAX_PENDING_WRITES = 10_000
"""Bindings and moves waiting for the log at most (Postgres away while sessions keep coming): memory stays bounded."""
MAX_KEPT_REQUEST_BYTES = 128 * 2**20
"""The sessions' last requests kept for handoffs at most; past it the least recently active sessions' go first
(handed over, they recompute)."""


@dataclass(frozen=True, slots=True)
class _Write:
    """A binding or a move to record: the session stream's expected version, None to read it when written."""

    session_id: str
    event: Envelope
    expected: int | None


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
        self.last_requests: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        """Per session this replica served, its last request (endpoint, body), least recently active first."""
        self._kept_bytes = 0
        self._writes: asyncio.Queue[_Write] = asyncio.Queue()
        self.unrecorded = 0
        """Bindings and moves never recorded because too many waited for the log."""

    # ------------------------------------------------------------------ reading

    def state(self, session_id: str) -> SessionState:
        b = self.bindings.get(session_id)
        if b is None:
            return SessionState(session_id)
        return SessionState(session_id, b.host, b.moved_at, b.context_tokens)

    def load(self, rows: dict[str, SessionRow]) -> None:
        """The bindings as the view's session rows have them at start."""
        for session_id, row in rows.items():
            moved = row.last_migrated_at
            self.bindings[session_id] = Binding(row.alias, row.instance_id, moved.timestamp() if moved else None)

    def apply(self, events: Sequence[StoredEvent]) -> None:
        """Follow bindings other replicas recorded (our own come back too, and change nothing)."""
        for stored in events:
            e = stored.event
            if not isinstance(e, (SessionBound, SessionMigrated, SessionReleased)):
                continue
            known = self.bindings.get(e.session_id)
            if known is not None and known.position >= stored.position:
                continue
            if isinstance(e, SessionReleased):
                self._drop(e.session_id)
                continue
            host = e.instance_id if isinstance(e, SessionBound) else e.to_instance_id
            moved = stored.occurred_at.timestamp() if isinstance(e, SessionMigrated) else None
            self._set(e.session_id, Binding(e.alias, host, moved, None, stored.position,
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

    def keep_request(self, session_id: str, endpoint: str, body: bytes) -> None:
        """The session's latest request: what its KV is exported by when its host is drained."""
        self._forget_request(session_id)
        self.last_requests[session_id] = (endpoint, body)
        self._kept_bytes += len(body)
        while self._kept_bytes > MAX_KEPT_REQUEST_BYTES and self.last_requests:
            self._forget_request(next(iter(self.last_requests)))

    def _forget_request(self, session_id: str) -> None:
        kept = self.last_requests.pop(session_id, None)
        if kept is not None:
            self._kept_bytes -= len(kept[1])

    def served_on(self, instance_id: str) -> list[str]:
        """The sessions bound to `instance_id` that this replica served, the most recently active first."""
        served = [(b.last_seen, session_id) for session_id, b in self.bindings.items()
                  if b.host == instance_id and b.last_seen]
        return [session_id for _, session_id in sorted(served, reverse=True)]

    def bind(self, session_id: str, alias: str, instance_id: str) -> None:
        """The session's first host: in effect at once, recorded in the log behind the request.

        If another replica bound the session first, the write finds out and this
        replica follows that binding from its next request on: the one request that
        went elsewhere only missed a cache.
        """
        self._set(session_id, Binding(alias, instance_id, last_seen=self.clock()))
        self._queue(session_id, SessionBound(session_id=session_id, alias=alias, instance_id=instance_id), 0)

    def migrate(self, session_id: str, alias: str, source: str, target: str, reason: str,
                metrics: dict[str, float]) -> None:
        """A move: in effect at once, recorded in the log behind the request (another replica's move, if it
        came first, wins and is followed from then on)."""
        b = self.bindings.get(session_id)
        self._set(session_id, Binding(alias, target, self.wall(), None, b.position if b else 0,
                                      b.context_tokens if b else 0, self.clock()))
        self._queue(session_id, SessionMigrated(session_id=session_id, alias=alias, from_instance_id=source,
                                                to_instance_id=target, reason=reason, metrics=metrics),
                    b.version if b is not None else None)

    def _queue(self, session_id: str, event: SessionBound | SessionMigrated, expected: int | None) -> None:
        if self._writes.qsize() >= MAX_PENDING_WRITES:
            # A long outage under many new sessions: the binding holds in this replica all the same; other
            # replicas, not told, place the session's requests as a new session's.
            self.unrecorded += 1
            if self.unrecorded == 1:
                log.warning("%d session bindings wait for the log; further ones are kept in memory only",
                            MAX_PENDING_WRITES)
            return
        self._writes.put_nowait(_Write(session_id, Envelope.wrap(event), expected))

    async def run_writes(self, stop: asyncio.Event) -> None:
        """Record the bindings and moves made, in order, until `stop`; through a Postgres outage they wait,
        and are recorded once it is back (requests meanwhile follow them from memory)."""
        outage, backoff = Outage("recording session bindings", log), Backoff(cap_s=2.0)
        stop_wait = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                next_write = asyncio.ensure_future(self._writes.get())
                await asyncio.wait({next_write, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                if not next_write.done():
                    next_write.cancel()
                    return
                write = next_write.result()
                while not stop.is_set():
                    try:
                        await self._write(write)
                    except Exception as exc:
                        if not is_transient(exc):
                            log.exception("session %s: %s not recorded", write.session_id, write.event.type)
                            break
                        outage.failed(exc)
                        await backoff.wait(stop)
                    else:
                        outage.succeeded()
                        backoff.reset()
                        break
        finally:
            stop_wait.cancel()

    async def _write(self, write: "_Write") -> None:
        stream = stream_of(write.session_id)
        expected = write.expected if write.expected is not None else await self.store.stream_version(stream)
        for _ in range(3):
            try:
                [stored] = await self.store.append(stream, [write.event], expected_version=expected)
            except ConcurrencyError as exc:
                winner = await self._read(write.session_id)
                if winner is not None or write.event.type != SessionBound.TYPE:
                    return  # another replica bound or moved it first: its binding is followed now
                expected = exc.actual  # the stream holds an earlier, released binding
                continue
            b = self.bindings.get(write.session_id)
            host = write.event.payload.get("instance_id") or write.event.payload.get("to_instance_id")
            if b is not None and b.host == host:
                b.version, b.position = stored.stream_version, max(b.position, stored.position or 0)
            return
        raise RuntimeError(f"session {write.session_id} could not be bound: its stream keeps changing")

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
                continue  # another replica moved or used it meanwhile (or its binding is still being written)
            self._drop(session_id)
            released += 1
        return released

    async def run_releases(self, idle_s: Callable[[str], float | None], stop: asyncio.Event, every_s: float) -> None:
        outage = Outage("releasing idle sessions", log)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass
            try:
                await self.release_idle(idle_s)
            except Exception as exc:
                outage.failed(exc)
            else:
                outage.succeeded()

    # ------------------------------------------------------------------ internals

    async def _read(self, session_id: str) -> Binding | None:
        """The session's binding as its stream has it now, or None if released."""
        events = await self.store.read_stream(stream_of(session_id))
        last = events[-1] if events else None
        match self.store.fact(last):
            case SessionBound(alias=alias, instance_id=host):
                moved = None
            case SessionMigrated(alias=alias, to_instance_id=host):
                moved = last.occurred_at.timestamp()
            case _:  # released, or never bound
                return None
        known = self.bindings.get(session_id)
        binding = Binding(alias, host, moved, last.stream_version, last.position or 0,
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
        self._forget_request(session_id)
        old = self.bindings.pop(session_id, None)
        if old is not None:
            self.resident[old.host] = self.resident.get(old.host, 0) - old.context_tokens
