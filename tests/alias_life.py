"""An alias's life as the services record it, for the timeline's and history's tests: configured, decided,
its instances moved, over one 1000 s cycle."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

from services.autoscaler.record import decision_events
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.config import AliasConfig, ControllerConfig
from shared.contracts.control import (
    AliasSnapshot,
    Decision,
    MetricWindow,
    MixChange,
    PlannedAction,
    PolicyState,
    RoutingChange,
)
from shared.contracts.events import AliasConfigured, InstanceStateChanged
from shared.contracts.messages import Envelope
from shared.contracts.states import InstanceState as I, RoutingState as R

ALIAS = "qwen3-vl-2b"
F, V = BackendType.LLAMA_CPP, BackendType.VLLM
CONFIG = AliasConfig.model_validate({
    "alias": ALIAS,
    "backends": {
        "llama.cpp": {"model_name": "q", "model_path": "/m/q.gguf", "gpu_memory_gb": 6, "max_replicas": 4},
        "vllm": {"model_name": "q", "model_path": "/m/q", "gpu_memory_gb": 12, "max_replicas": 2, "engine": "simulator"},
    },
})
# Recent, so the windows published now fall in the range the bus is asked for.
T0 = (datetime.now(timezone.utc) - timedelta(minutes=20)).replace(microsecond=0)
WARMING_REASON = ("2 consecutive windows with inflight_fast 3.5 >= C_up 3; inflight_total 3.5 >= C_prepare 3 "
                  "(C_vllm 40, C_eff 28, C_up 28, C_down 12, C_prepare 3)")


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def window(end_s: float, **values) -> MetricWindow:
    return MetricWindow(window_start=at(end_s - 2), window_end=at(end_s), gateways=1, **values)


class AliasLife:
    """Records an alias's life as the services would: the controller's decisions and the workers' transitions."""

    def __init__(self, store) -> None:
        self.store = store
        self.state, self.weight, self.targets = R.COLD, 0.0, {}

    async def configure(self, seconds: float) -> None:
        await self.store.append(f"alias:{ALIAS}", [Envelope.wrap(AliasConfigured(alias=ALIAS, config=CONFIG),
                                                                 occurred_at=at(seconds))])

    async def decide(self, seconds: float, *, to: R | None = None, reason: str = "", weight: float | None = None,
                     targets: dict | None = None, metrics: MetricWindow | None = None,
                     actions: tuple[PlannedAction, ...] = ()) -> None:
        snapshot = AliasSnapshot(alias=ALIAS, version=0, config=CONFIG, controller=ControllerConfig(),
                                 routing_state=self.state, routing_since=None, mix_weight=self.weight,
                                 targets=dict(self.targets), state=PolicyState(), metrics=metrics)
        weight = self.weight if weight is None else weight
        decision = Decision(
            policy="hybrid", policy_version=1, decision_id=uuid.uuid4(), targets=targets or dict(self.targets),
            targets_reason="as load asks", state=PolicyState(), mix_weight=weight,
            routing=RoutingChange(self.state, to, reason) if to else None,
            mix=MixChange(self.weight, weight, reason) if to is None and weight != self.weight else None,
            actions=actions)
        await self.store.append(f"alias:{ALIAS}", decision_events(snapshot, decision, at(seconds)))
        self.state, self.weight, self.targets = to or self.state, weight, dict(decision.targets)

    async def instance(self, iid: str, backend: BackendType, moves: list[tuple[float, I, I]]) -> None:
        engine = EngineKind.SIMULATOR if backend is V else EngineKind.LLAMA_CPP
        await self.store.append(f"instance:{iid}", [Envelope.wrap(InstanceStateChanged(
            instance_id=iid, alias=ALIAS, backend_type=backend, engine=engine, worker_id="w1", from_state=a, to_state=b,
            reason="autoscaler", sleep_level={I.SLEEP_1: 1, I.SLEEP_2: 2}.get(b, 0)), occurred_at=at(seconds))
            for seconds, a, b in moves])


async def record_a_cycle(store) -> None:
    """COLD -> FAST_ONLY -> WARMING_VLLM -> MIXED (20/50/80/100 %) -> VLLM_PRIMARY -> FAST_ONLY -> COLD in 1000 s."""
    life = AliasLife(store)
    await life.configure(0)
    await life.decide(10, to=R.FAST_ONLY, reason="first demand (2 request(s) waiting): llama.cpp takes it",
                      targets={F: 1}, metrics=window(10, held=2, arrivals=2))
    await life.instance("f1", F, [(11, I.ABSENT, I.STARTING), (15, I.STARTING, I.RUNNING)])
    await life.decide(60, to=R.WARMING_VLLM, reason=WARMING_REASON, targets={F: 1, V: 1},
                      metrics=window(60, inflight_fast=3.5, arrivals=6, requests=5, e2e_p95_s=4.0, ttft_p95_s=0.3))
    await life.instance("v1", V, [(61, I.ABSENT, I.STARTING), (90, I.STARTING, I.RUNNING)])
    await life.decide(100, to=R.MIXED, reason="vLLM v1 healthy in 2 consecutive probes; 20 % of traffic to vLLM",
                      weight=0.2, metrics=window(100, inflight_fast=3.0, inflight_slow=0.5))
    for seconds, weight in ((110, 0.5), (120, 0.8), (130, 1.0)):
        # The decisions at 110 and 120 saw the same newest window: it counts once.
        await life.decide(seconds, weight=weight, reason="held for 10 s, vLLM healthy",
                          metrics=window(min(seconds, 118), inflight_slow=2.0))
    await life.decide(140, to=R.VLLM_PRIMARY, reason="ramp complete at 100 % and held 10 s",
                      metrics=window(140, inflight_slow=3.0))
    await life.decide(400, to=R.FAST_ONLY, reason="inflight_total 0.4 < 3 (min(C_down, C_prepare)) for 180 s and vLLM idle",
                      weight=0.0, targets={F: 1, V: 0}, metrics=window(400, inflight_fast=0.4))
    await life.instance("v1", V, [(500, I.RUNNING, I.SLEEP_1), (600, I.SLEEP_1, I.SLEEP_2),
                                  (800, I.SLEEP_2, I.DELETING), (805, I.DELETING, I.ABSENT)])
    await life.decide(900, to=R.COLD, reason="no request for 300 s and min_replicas 0", targets={F: 0, V: 0})
    await life.instance("f1", F, [(901, I.RUNNING, I.DRAINING), (905, I.DRAINING, I.DELETING),
                                  (906, I.DELETING, I.ABSENT)])
