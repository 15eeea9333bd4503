"""A gateway's stages over a view held in memory: no servers, a clock the test moves."""

from __future__ import annotations

import random
from datetime import datetime, timezone

from services.gateway.admission import Admission
from services.gateway.meter import Meter
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import Router
from services.gateway.sessions import Sessions
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.config import AliasConfig
from shared.contracts.states import InstanceState, RoutingState
from shared.projections.readmodels import INSTANCES, ROUTING
from shared.projections.rows import InstanceRow, RoutingRow


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def row(instance_id: str, capacity: int | None, backend: BackendType = BackendType.LLAMA_CPP) -> InstanceRow:
    return InstanceRow(instance_id, "tiny", backend, EngineKind.SIMULATOR, "w1", InstanceState.RUNNING, 0, 0, capacity,
                       f"http://{instance_id}", None, None, "started", T0)


class View:
    """The read models the router reads, by projection, as the live view gives them."""

    def __init__(self, rows: tuple[InstanceRow, ...], state: RoutingState, config: AliasConfig | None = None) -> None:
        self.tables = {ROUTING.name: {"tiny": RoutingRow("tiny", state, 0.0, None, None, None, {}, config, T0)},
                       INSTANCES.name: {r.instance_id: r for r in rows}}

    def __getitem__(self, projection) -> dict:
        return self.tables[projection.name]


def pool(*rows: InstanceRow, state: RoutingState = RoutingState.FAST_ONLY, queue_size: int = 3,
         config: AliasConfig | None = None, sessions: Sessions | None = None, clock=None, **limits: float):
    """An admission over a view holding `rows` (and `limits`: its queue timeout, start budget, keep-alive)."""
    view = View(rows, state, config)
    clock, signals = clock or Clock(), []

    async def publish(signal) -> None:
        signals.append(signal)

    router = Router(view, random.Random(0), sessions=sessions)  # type: ignore[arg-type]
    budget = limits.pop("start_budget_s", 60.0)
    admission = Admission(router, Meter("g1", 2.0, clock), GatewayMetrics(), publish, "g1", queue_size, clock,
                          limits.pop("queue_timeout_s", 60.0), lambda alias: budget, limits.pop("keepalive_s", 5.0))
    return admission, view, clock, signals


