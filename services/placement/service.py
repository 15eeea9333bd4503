"""The placement service: turns a PlaceInstance request into a decision and a start command.

Its view of the workers is folded from the log just before each decision, so
it decides on what has been committed, never on a guess. The decision is
recorded first, then the StartInstance command is published with an id derived
from the request: a redelivered request finds its decision and republishes the
same command, which JetStream and the worker both recognise as a repeat.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from nats.js import JetStreamContext

from policy.placement import Placed, PlacementChoice, PlacementRequest, WorkerView, place
from shared.bus.jetstream import publish
from shared.bus.subjects import Subjects
from shared.contracts.backends import BackendType
from shared.contracts.commands import EngineSpec, PlaceInstance, StartInstance
from shared.contracts.events import InstanceStateChanged, PlacementDecided, PlacementFailed, PlacementRequested
from shared.contracts.messages import Envelope, derived_id
from shared.contracts.states import InstanceState
from shared.eventlog.store import EventStore
from shared.projections.live import LiveView
from shared.projections.readmodels import WORKERS, Projection, reducers
from shared.telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PlacedInstance:
    """An instance holding a slot (and memory) on its worker."""

    instance_id: str
    alias: str
    backend_type: BackendType
    worker_id: str
    gpu_memory_gb: float


def _placement_decided(rows: dict[str, PlacedInstance], e: PlacementDecided, at: datetime) -> Iterable[str]:
    rows[e.instance_id] = PlacedInstance(e.instance_id, e.alias, e.backend_type, e.worker_id, e.gpu_memory_gb)
    return (e.instance_id,)


def _instance_changed(rows: dict[str, PlacedInstance], e: InstanceStateChanged, at: datetime) -> Iterable[str]:
    if e.to_state is InstanceState.ABSENT:
        rows.pop(e.instance_id, None)
    elif e.instance_id not in rows:  # started without placement: it still takes a slot
        rows[e.instance_id] = PlacedInstance(e.instance_id, e.alias, e.backend_type, e.worker_id, 0.0)
    return (e.instance_id,)


PLACEMENTS: Projection[PlacedInstance] = Projection(
    "placements", "", PlacedInstance, reducers((PlacementDecided, _placement_decided),
                                               (InstanceStateChanged, _instance_changed)))
"""Not a stored read model: the placement service folds it from the log itself."""


class Placement:
    def __init__(self, store: EventStore, js: JetStreamContext, subjects: Subjects, telemetry: Telemetry) -> None:
        self.store = store
        self.js = js
        self.subjects = subjects
        self.telemetry = telemetry
        # Placements are not a stored read model: the view is folded from the log itself.
        self.view = LiveView(store, store.engine, [WORKERS, PLACEMENTS])
        self._lock = asyncio.Lock()
        self.outcomes: Counter[str] = Counter()
        """Placements this process recorded, by outcome (placed, failed)."""

    def workers(self) -> list[WorkerView]:
        placed: dict[str, list[Placed]] = {}
        for row in self.view[PLACEMENTS].values():
            placed.setdefault(row.worker_id, []).append(Placed(row.instance_id, row.alias, row.backend_type,
                                                               row.gpu_memory_gb))
        return [
            WorkerView(worker_id=w.worker_id, gpu_memory_gb=w.gpu_memory_gb, slots=w.slots, engines=frozenset(w.engines),
                       up=w.up, instances=tuple(placed.get(w.worker_id, ())))
            for w in self.view[WORKERS].values()
        ]

    async def handle(self, envelope: Envelope, cmd: PlaceInstance) -> None:
        # One decision at a time: each is made on the view the previous one left,
        # so two requests can never both take the last free memory of a worker.
        async with self._lock:
            decided = await self.store.get(derived_id(envelope.id, "decided"))
            if decided is None:
                if await self.store.contains(derived_id(envelope.id, "failed")):
                    return
                await self.view.catch_up()
                request = PlacementRequest(cmd.alias, cmd.backend_type, cmd.engine, cmd.gpu_memory_gb)
                # What was stored wins: a copy of this request handled elsewhere first
                # may have chosen another worker.
                decided = await self._record(envelope, cmd, place(request, self.workers()))
            if decided is not None:
                await self._send_start(envelope, cmd, self.store.fact(decided).worker_id)

    async def _record(self, envelope: Envelope, cmd: PlaceInstance, decision: PlacementChoice) -> Envelope | None:
        """Record the decision; return the stored PlacementDecided, or None if placement failed."""
        common = dict(request_id=cmd.request_id, alias=cmd.alias, backend_type=cmd.backend_type, instance_id=cmd.instance_id)
        requested = Envelope.wrap(PlacementRequested(**common, gpu_memory_gb=cmd.gpu_memory_gb, reason=cmd.reason),
                                  causation=envelope, id=derived_id(envelope.id, "requested"))
        candidates = list(decision.candidates)
        if decision.worker_id is None:
            outcome = Envelope.wrap(PlacementFailed(**common, reason=decision.reason, candidates=candidates),
                                    causation=envelope, id=derived_id(envelope.id, "failed"))
            log.warning("placement of %s failed: %s", cmd.instance_id, decision.reason)
        else:
            outcome = Envelope.wrap(
                PlacementDecided(**common, worker_id=decision.worker_id, gpu_memory_gb=cmd.gpu_memory_gb, score=decision.score,
                                 fallback_level=decision.fallback_level or 3, candidates=candidates),
                causation=envelope, id=derived_id(envelope.id, "decided"),
            )
        stored = await self.store.append(f"placement:{cmd.request_id}", [requested, outcome], 0,
                                         headers=self.telemetry.current_headers())
        placed = stored[1].type == PlacementDecided.TYPE
        self.outcomes["placed" if placed else "failed"] += 1
        return stored[1] if placed else None

    async def _send_start(self, envelope: Envelope, cmd: PlaceInstance, worker_id: str) -> None:
        spec = {name: getattr(cmd, name) for name in EngineSpec.model_fields}
        start = StartInstance(**spec, instance_id=cmd.instance_id, alias=cmd.alias, backend_type=cmd.backend_type,
                              worker_id=worker_id, reason=cmd.reason or "placed")
        command = Envelope.wrap(start, causation=envelope, id=derived_id(envelope.id, "start"))
        await publish(self.js, self.subjects.worker_commands(worker_id), command, self.telemetry)
