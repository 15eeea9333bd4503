"""Gateway test support: simulated engines as processes, facts recorded in the test's log, in-process gateways.

The gateway runs its production `serve` on a service context of the test's
namespace, with an outbox relay beside it, so its live view learns of recorded
events the way it does in a deployment (log -> relay -> bus -> catch-up).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import httpx

from helpers import EngineProcess, start_engine, start_llama_engine, wait_healthy  # the gateway tests' engines, imported from here
from services.gateway.main import serve
from services.runtime import ServiceContext, open_context
from shared.bus.relay import Relay
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.config import AliasConfig, GatewayConfig, PoolConfig
from shared.contracts.events import AliasConfigured, InstanceStateChanged, MixWeightChanged, RoutingStateChanged
from shared.contracts.messages import Envelope
from shared.contracts.states import InstanceState, RoutingState
from shared.contracts.telemetry import DemandSignal
from shared.net import free_port
from shared.settings import Settings

FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM
ALIAS = "tiny"


# --------------------------------------------------------------------------- engines: `helpers.py`


# --------------------------------------------------------------------------- the log


class Facts:
    """Records what the controller and workers would record, straight into the test's log."""

    def __init__(self, store) -> None:
        self.store = store
        self.routing: dict[str, tuple[RoutingState, float]] = {}
        self.instances: dict[str, InstanceState] = {}

    async def alias(self, alias: str = ALIAS, router: dict | None = None) -> None:
        """Register `alias` with both backends on the simulator; `router`: its pool file `router:` section."""
        config = AliasConfig.model_validate({"alias": alias, "router": router or {}, "backends": {
            b.value: {"model_name": alias, "model_path": "default", "gpu_memory_gb": 0, "engine": "simulator"} for b in (FAST, SLOW)}})
        await self.store.append(f"alias:{alias}", [Envelope.wrap(AliasConfigured(alias=alias, config=config))])
        self.routing[alias] = (RoutingState.COLD, 0.0)

    async def route(self, *states: RoutingState, alias: str = ALIAS, mix_weight: float = 0.0) -> None:
        """Walk the alias through `states`, the last one with `mix_weight`."""
        for state in states:
            current, weight = self.routing[alias]
            weight = mix_weight if state is states[-1] else weight
            await self.store.append(f"alias:{alias}", [Envelope.wrap(RoutingStateChanged(
                alias=alias, from_state=current, to_state=state, reason="test", mix_weight=weight, policy="test"))])
            self.routing[alias] = (state, weight)

    async def mix(self, weight: float, alias: str = ALIAS) -> None:
        state, current = self.routing[alias]
        await self.store.append(f"alias:{alias}", [Envelope.wrap(MixWeightChanged(
            alias=alias, from_weight=current, to_weight=weight, reason="test", policy="test"))])
        self.routing[alias] = (state, weight)

    async def instance(self, instance_id: str, backend: BackendType, *states: InstanceState, endpoint: str | None = None,
                       alias: str = ALIAS, at=None, capacity: int | None = None, internal_endpoint: str | None = None,
                       engine: EngineKind = EngineKind.SIMULATOR) -> None:
        """Walk an instance through `states` (from ABSENT, or where it was); `at` gives each event's time;
        `capacity`: the concurrent requests its engine reported."""
        for i, state in enumerate(states):
            current = self.instances.get(instance_id, InstanceState.ABSENT)
            event = InstanceStateChanged(
                instance_id=instance_id, alias=alias, backend_type=backend, engine=engine, worker_id="w1",
                from_state=current, to_state=state, reason="test", endpoint=endpoint, capacity=capacity,
                internal_endpoint=internal_endpoint,
                sleep_level={InstanceState.SLEEP_1: 1, InstanceState.SLEEP_2: 2}.get(state, 0))
            await self.store.append(f"instance:{instance_id}", [Envelope.wrap(event, occurred_at=at[i] if at else None)])
            self.instances[instance_id] = state

    async def running(self, instance_id: str, engine: EngineProcess, backend: BackendType, alias: str = ALIAS,
                      capacity: int | None = None, kind: EngineKind = EngineKind.SIMULATOR) -> None:
        await self.instance(instance_id, backend, InstanceState.STARTING, InstanceState.RUNNING, endpoint=engine.url, alias=alias,
                            capacity=capacity, internal_endpoint=engine.internal_url, engine=kind)


# --------------------------------------------------------------------------- sessions


def chat(*turns: str, system: str | None = None, **extra) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"model": ALIAS, "messages": messages, "max_tokens": 2, **extra}


async def all_recorded(store, sessions: list[str]) -> bool:
    return all([await session_events(store, s) for s in sessions])


async def events_are(store, session_id: str, expected: list[str]) -> bool:
    return await session_events(store, session_id) == expected


async def session_events(store, session_id: str) -> list[str]:
    return [e.type for e in await store.read_stream(f"session:{ALIAS}/{session_id}")]


async def pool_of(engines, facts, gateways, router: dict, backend=SLOW, kind=EngineKind.SIMULATOR):
    """A gateway in front of `engines`, the alias routed to their backend by `router`."""
    wait_healthy(engines, timeout=120)
    await facts.alias(router=router)
    for i, engine in enumerate(engines):
        await facts.running(f"{'v' if backend is SLOW else 'f'}{i}", engine, backend, kind=kind)
    await facts.route(RoutingState.VLLM_PRIMARY if backend is SLOW else RoutingState.FAST_ONLY)
    return await gateways.start()


# --------------------------------------------------------------------------- gateways


@dataclass
class RunningGateway:
    url: str
    ctx: ServiceContext
    task: asyncio.Task
    store: object

    async def caught_up(self, timeout: float = 10.0) -> None:
        """Until the gateway's view holds everything recorded so far."""
        head = await self.store.head_position()
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            while (await client.get(f"{self.url}/health")).json()["position"] < head:
                if time.monotonic() > deadline:
                    raise AssertionError(f"gateway view not at position {head} within {timeout} s")
                await asyncio.sleep(0.02)

    async def metrics(self) -> str:
        async with httpx.AsyncClient() as client:
            return (await client.get(f"{self.url}/metrics")).text


@dataclass
class Gateways:
    """Starts gateways (and one relay) on the test's namespace; stops them all at the end."""

    settings: Settings
    store: object
    stack: AsyncExitStack
    started: list[RunningGateway] = field(default_factory=list)
    relay_task: asyncio.Task | None = None

    async def start(self, pool: PoolConfig | None = None, **overrides) -> RunningGateway:
        """A gateway serving `pool`; `overrides` of its pool file's `gateway:` section (`metric_window_s=1`) go there,
        the rest over its settings (`admin_token=...`)."""
        port = free_port()
        gateway = {k: overrides.pop(k) for k in list(overrides) if k in GatewayConfig.model_fields}
        settings = self.settings.model_copy(update={"gateway_port": port, "gateway_id": f"g{len(self.started) + 1}",
                                                    **overrides})
        if gateway:
            pool = pool or PoolConfig()
            pool = pool.model_copy(update={"gateway": pool.gateway.model_validate({**pool.gateway.model_dump(), **gateway})})
        ctx = await open_context("gateway", settings, self.stack)
        if self.relay_task is None:
            relay = Relay(ctx.store, ctx.js, ctx.subjects, ctx.telemetry, listen_dsn=settings.asyncpg_dsn, schema=settings.namespace)
            self.relay_task = asyncio.create_task(relay.run(ctx.stop))
        gateway = RunningGateway(f"http://127.0.0.1:{port}", ctx, asyncio.create_task(serve(ctx, pool)), self.store)
        self.started.append(gateway)
        deadline = time.monotonic() + 30
        async with httpx.AsyncClient() as client:
            while True:
                try:
                    if (await client.get(f"{gateway.url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if gateway.task.done() or time.monotonic() > deadline:
                    raise RuntimeError(f"gateway did not start: {gateway.task}")
                await asyncio.sleep(0.02)
        await gateway.caught_up()
        return gateway

    async def demand(self) -> list[tuple[float, DemandSignal]]:
        """Demand signals as they arrive, each with the monotonic time it was received."""
        received: list[tuple[float, DemandSignal]] = []
        ctx = self.started[0].ctx
        sub = await ctx.telemetry_bus.subscribe_demand(lambda d: received.append((time.monotonic(), d)))
        self.stack.push_async_callback(sub.unsubscribe)
        await ctx.nc.flush()
        return received
