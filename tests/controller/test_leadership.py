"""Exactly one decision maker: autoscaler processes, a lease, a SIGKILL, and a stopped controller."""

from __future__ import annotations

import asyncio
import signal
import time
from datetime import datetime, timedelta, timezone

from helpers import ServiceProcess, eventually

from shared.bus.telemetry import TelemetryBus
from shared.contracts.telemetry import DemandSignal, GatewayWindow, HistogramRecorder
from shared.net import free_port

POOL = """
aliases:
  - alias: tiny
    autoscaling_policy: {name: hybrid, up_consecutive: 2}
    backends:
      llama.cpp: {model_name: tiny, model_path: default, gpu_memory_gb: 0, min_replicas: 0, max_replicas: 2, engine: simulator}
      vllm: {model_name: tiny, model_path: /m, gpu_memory_gb: 12, max_replicas: 1, max_model_len: 4096, engine: simulator}
"""
LEADS = "leads the pool's decisions"


def service_env(settings, **extra: str) -> dict[str, str]:
    return {"DATABASE_URL": settings.database_url, "NATS_URL": settings.nats_url,
            "MODELPOOL_NAMESPACE": settings.namespace, **extra}


async def types_of(store, alias: str) -> list[str]:
    return [e.type for e in await store.history(alias)]


async def test_one_autoscaler_leads_and_a_standby_takes_over_within_seconds_of_a_sigkill(store, bus, settings, tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text(POOL)
    env = service_env(settings, MODELPOOL_CONFIG=str(pool), MODELPOOL_CONTROL_TICK_S="0.5")
    first, second = ServiceProcess("autoscaler", env, tmp_path), ServiceProcess("autoscaler", env, tmp_path)
    tb = TelemetryBus(bus.nc, bus.js, bus.subjects)
    await tb.ensure()
    try:
        leader = await eventually(lambda: next((p for p in (first, second) if LEADS in p.output()), None), timeout=60)
        standby = second if leader is first else first
        await asyncio.sleep(2.0)
        assert LEADS not in standby.output() and "standing by" in standby.output()
        assert (await types_of(store, "tiny")).count("AliasConfigured") == 1

        killed = time.monotonic()
        leader.kill(signal.SIGKILL)
        await eventually(lambda: LEADS in standby.output(), timeout=15, interval=0.05)
        takeover_s = time.monotonic() - killed
        print(f"takeover after SIGKILL: {takeover_s:.2f} s")
        assert takeover_s < 5.0, takeover_s

        # The new leader decides: demand on the cold alias switches it.
        async def demanded_and_switched():
            await tb.publish_demand(DemandSignal(gateway_id="g1", alias="tiny", held=1, at=datetime.now(timezone.utc)))
            return await _has(store, "RoutingStateChanged")

        await eventually(demanded_and_switched, timeout=15, interval=0.5)
        assert (await types_of(store, "tiny")).count("AliasConfigured") == 1
    finally:
        codes = [p.stop() for p in (first, second)]
    assert codes[[first, second].index(standby)] == 0, standby.output()[-2000:]


async def _has(store, type_name: str) -> bool:
    return type_name in await types_of(store, "tiny")


def load_window(alias: str, start: datetime, seconds: float, inflight_fast: float) -> GatewayWindow:
    e2e = HistogramRecorder()
    for _ in range(10):
        e2e.record(1.0)
    return GatewayWindow(gateway_id="test", alias=alias, window_start=start, window_end=start + timedelta(seconds=seconds),
                         arrivals=10, requests_fast=10, inflight_fast=inflight_fast, inflight_peak=inflight_fast,
                         e2e_fast_s=e2e.snapshot())


async def publish_load(tb: TelemetryBus, seconds: float, inflight_fast: float, window_s: float = 0.5) -> None:
    """Play a gateway: windows of heavy load (each would count toward warming vLLM)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = datetime.now(timezone.utc)
        await asyncio.sleep(window_s)
        await tb.publish_window(load_window("tiny", start, window_s, inflight_fast))


async def test_with_the_autoscaler_stopped_nothing_switches_or_scales(store, bus, settings, tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text(POOL)
    env = service_env(settings, MODELPOOL_CONFIG=str(pool), MODELPOOL_CONTROL_TICK_S="0.2",
                      MODELPOOL_WORKER_ID="w1", MODELPOOL_WORKER_GPU_MEMORY_GB="24", MODELPOOL_WORKER_SIM_SPEEDUP="50",
                      MODELPOOL_GATEWAY_PORT=str(free_port()))
    services = [ServiceProcess(name, env, tmp_path) for name in ("relay", "projector", "placement", "worker")]
    tb = TelemetryBus(bus.nc, bus.js, bus.subjects)
    await tb.ensure()
    autoscaler = ServiceProcess("autoscaler", env, tmp_path)
    try:
        await eventually(lambda: store.stream_version("worker:w1"), timeout=60)

        async def demand_until_served():  # as a gateway holding a request does: every second, until served
            await tb.publish_demand(DemandSignal(gateway_id="g1", alias="tiny", held=1, at=datetime.now(timezone.utc)))
            return await _instance_running(store)

        await eventually(demand_until_served, timeout=60, interval=0.5)
        assert autoscaler.stop() == 0

        before = len(await store.history("tiny"))
        # Load that warms vLLM within a second under a running controller, for ten seconds, with demand.
        await asyncio.gather(publish_load(tb, 10.0, inflight_fast=6.0),
                             tb.publish_demand(DemandSignal(gateway_id="g1", alias="tiny", held=5,
                                                            at=datetime.now(timezone.utc))))
        after = await store.history("tiny")
        assert len(after) == before, [e.type for e in after[before:]]

        # The same load with a controller running switches the alias at once: the pattern was enough.
        autoscaler = ServiceProcess("autoscaler", env, tmp_path)
        await asyncio.gather(publish_load(tb, 8.0, inflight_fast=6.0),
                             eventually(lambda: _switched_to(store, "WARMING_VLLM"), timeout=30))
    finally:
        for s in [autoscaler, *reversed(services)]:
            s.stop()


async def _instance_running(store) -> bool:
    return any(e.type == "InstanceStateChanged" and e.payload["to_state"] == "RUNNING" for e in await store.history("tiny"))


async def _switched_to(store, state: str) -> bool:
    return any(e.type == "RoutingStateChanged" and e.payload["to_state"] == state for e in await store.history("tiny"))
