"""Telemetry: mergeable histograms and windows, the telemetry bus on real NATS, the keyed consumer."""

from __future__ import annotations

import asyncio
import random
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from helpers import consuming, eventually
from shared.bus import subjects as h
from shared.bus.jetstream import Consumer, publish
from shared.bus.telemetry import TelemetryBus
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.commands import ProbeInstance, command_registry
from shared.contracts.messages import Envelope
from shared.contracts.states import InstanceState
from shared.contracts.telemetry import (
    DemandSignal,
    GatewayWindow,
    HistogramRecorder,
    InstanceStatus,
    LogHistogram,
    WorkerHeartbeat,
    merge_windows,
)

T0 = datetime(2026, 11, 23, 12, 0, tzinfo=timezone.utc)


def histogram(values) -> LogHistogram:
    recorder = HistogramRecorder()
    for v in values:
        recorder.record(v)
    return recorder.snapshot()


@pytest.mark.parametrize("q", [0.5, 0.9, 0.95, 0.99])
def test_log_histogram_quantiles_are_within_five_percent(q):
    rng = np.random.default_rng(7)
    values = rng.lognormal(mean=-1.0, sigma=1.2, size=20_000)
    estimate = histogram(values).quantile(q)
    exact = float(np.quantile(values, q))
    assert abs(estimate - exact) / exact < 0.05


def test_merged_histograms_equal_the_histogram_of_all_values():
    rng = random.Random(3)
    a = [rng.expovariate(10) for _ in range(500)]
    b = [rng.expovariate(0.5) for _ in range(300)]
    merged = LogHistogram.merge([histogram(a), histogram(b)])
    whole = histogram(a + b)
    assert merged.counts == whole.counts and merged.n == 800
    assert merged.maximum == max(a + b)
    assert merged.total == pytest.approx(sum(a + b))
    assert LogHistogram().quantile(0.95) is None


def window(gateway: str, e2e: list[float], **fields) -> GatewayWindow:
    return GatewayWindow(gateway_id=gateway, alias="a", window_start=T0, window_end=T0 + timedelta(seconds=2),
                         e2e_fast_s=histogram(e2e), requests_fast=len(e2e), **fields)


def test_windows_of_several_gateways_merge_by_adding_counts_and_histograms_not_percentiles():
    fast = [0.1] * 95 + [0.2] * 5
    slow = [5.0] * 10
    one = window("g1", fast, inflight_fast=3.0, decode_tokens=100, held=1, timeouts_slow=1, errors_slow=2)
    two = window("g2", slow, inflight_fast=1.5, decode_tokens=300, held=2)
    merged = merge_windows([one, two])
    assert merged.gateways == 2 and merged.requests == merged.requests_fast == 110
    assert merged.inflight_fast == 4.5 and merged.held == 3
    assert merged.decode_tokens_per_s == pytest.approx(200.0)
    assert merged.errors == 2 and merged.errors_slow == 2 and merged.timeouts_slow == 1
    # The 95th percentile of all 110 answers is a slow one (rank 105 > 100 fast ones);
    # averaging the two replicas' p95s would have said about 2.6 s.
    assert merged.e2e_p95_fast_s == pytest.approx(5.0, rel=0.05)
    assert merged.e2e_p95_s == merged.e2e_p95_fast_s
    assert merged.e2e_p95_slow_s is None and merged.ttft_p95_s is None


# --------------------------------------------------------------------------- on a real NATS


@pytest.fixture
async def telemetry_bus(bus):
    tb = TelemetryBus(bus.nc, bus.js, bus.subjects)
    await tb.ensure()
    await tb.ensure()  # idempotent
    return tb


def heartbeat(worker: str, at: datetime, inflight: int = 0) -> WorkerHeartbeat:
    status = InstanceStatus(instance_id=f"{worker}-i1", alias="a", backend_type=BackendType.VLLM,
                            engine=EngineKind.SIMULATOR, status=InstanceState.RUNNING, inflight_requests=inflight, capacity=38)
    return WorkerHeartbeat(worker_id=worker, at=at, interval_s=1.0, instances=[status])


async def test_heartbeats_keep_the_latest_per_worker_and_are_watched(telemetry_bus):
    seen: list[WorkerHeartbeat] = []
    stop = asyncio.Event()
    watching = asyncio.create_task(telemetry_bus.watch_heartbeats(seen.append, stop))
    await telemetry_bus.put_heartbeat(heartbeat("w1", T0, inflight=1))
    await telemetry_bus.put_heartbeat(heartbeat("w1", T0 + timedelta(seconds=1), inflight=4))
    await telemetry_bus.put_heartbeat(heartbeat("w2", T0))
    # The watch delivers the current value of each worker, then every change.
    await eventually(lambda: {hb.worker_id: hb.instances[0].inflight_requests for hb in seen} == {"w1": 4, "w2": 0})
    await telemetry_bus.put_heartbeat(heartbeat("w2", T0, inflight=7))
    await eventually(lambda: seen[-1].worker_id == "w2" and seen[-1].instances[0].inflight_requests == 7)
    stop.set()
    await watching
    latest = await telemetry_bus.heartbeats()
    assert set(latest) == {"w1", "w2"}
    assert latest["w1"].instances[0].inflight_requests == 4


async def test_a_bucket_a_restarted_server_lost_is_declared_again_by_the_next_put(telemetry_bus, bus):
    await telemetry_bus.put_heartbeat(heartbeat("w1", T0))
    await bus.js.delete_key_value(bus.subjects.heartbeats_bucket)  # as a NATS restarted without its memory
    await telemetry_bus.put_heartbeat(heartbeat("w1", T0 + timedelta(seconds=1), inflight=2))
    latest = await telemetry_bus.heartbeat_of("w1")
    assert latest is not None and latest.instances[0].inflight_requests == 2
    assert await telemetry_bus.heartbeat_of("w-unknown") is None


async def test_windows_are_followed_from_each_gateways_latest_and_read_back_by_time(telemetry_bus):
    # Windows of a few minutes ago: the stream keeps a day, and reading back filters on their end times.
    t0 = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(minutes=5)
    for n in range(3):
        start = t0 + timedelta(seconds=2 * n)
        for gw in ("g1", "g2"):
            await telemetry_bus.publish_window(GatewayWindow(gateway_id=gw, alias="a", window_start=start,
                                                             window_end=start + timedelta(seconds=2), arrivals=n))
    got: list[GatewayWindow] = []
    stop = asyncio.Event()
    follower = asyncio.create_task(telemetry_bus.follow_windows(got.append, stop))
    await eventually(lambda: len(got) == 2)
    assert {(w.gateway_id, w.arrivals) for w in got} == {("g1", 2), ("g2", 2)}
    await telemetry_bus.publish_window(GatewayWindow(gateway_id="g1", alias="b", window_start=t0, window_end=t0, arrivals=9))
    await eventually(lambda: len(got) == 3)
    stop.set()
    await follower

    since = datetime.now(timezone.utc) - timedelta(minutes=1)  # stored windows are found by their store time...
    stored = await telemetry_bus.read_windows(since - timedelta(days=1), alias="a")
    assert [w.arrivals for w in stored] == [0, 0, 1, 1, 2, 2]  # ...and filtered by alias and window end
    whole_second = (since - timedelta(days=1)).replace(microsecond=0)  # as an operator types it
    assert len(await telemetry_bus.read_windows(whole_second, alias="a")) == 6


async def test_demand_is_delivered_and_bad_telemetry_goes_to_the_dead_letters(telemetry_bus, bus):
    got: list[DemandSignal] = []
    sub = await telemetry_bus.subscribe_demand(got.append)
    await telemetry_bus.publish_demand(DemandSignal(gateway_id="g1", alias="a", held=3, at=T0))
    await bus.nc.publish(bus.subjects.demand, b"not json")
    await eventually(lambda: len(got) == 1)
    assert got[0].held == 3
    await sub.unsubscribe()
    dlq = await bus.js.pull_subscribe(bus.subjects.dead_letter("telemetry"), durable=None)
    (msg,) = await dlq.fetch(1, timeout=5)
    assert msg.data == b"not json"
    assert msg.headers[h.DLQ_REASON].startswith("invalid telemetry")


# --------------------------------------------------------------------------- keyed consumer


async def test_keyed_consumer_runs_one_key_in_order_and_keys_side_by_side(bus, telemetry):
    events: list[str] = []
    release_slow = asyncio.Event()

    async def handler(envelope, command):
        name = f"{command.instance_id}:{command.reason}"
        events.append(f"start {name}")
        if name == "i1:first":
            await release_slow.wait()  # a long command on i1 (a two-minute wake, say)
        events.append(f"end {name}")

    consumer = Consumer(bus.js, bus.subjects, stream=bus.subjects.commands_stream, durable="keyed",
                        filter_subject=bus.subjects.worker_commands("w1"), registry=command_registry(),
                        handler=handler, telemetry=telemetry, batch=1, key_of=lambda c: c.instance_id)
    for instance, reason in (("i1", "first"), ("i1", "second"), ("i2", "other")):
        probe = ProbeInstance(instance_id=instance, alias="a", backend_type=BackendType.VLLM, worker_id="w1", reason=reason)
        await publish(bus.js, bus.subjects.worker_commands("w1"), Envelope.wrap(probe), telemetry)
    async with consuming(bus.nc.connected_url.geturl(), consumer):
        # i2 is not held up by i1's long command, and i1's second waits for its first.
        await eventually(lambda: "end i2:other" in events)
        assert "start i1:second" not in events
        info = await bus.js.consumer_info(bus.subjects.commands_stream, "keyed")
        assert info.num_ack_pending == 2  # i1's two messages stay unacked until done
        release_slow.set()
        await eventually(lambda: "end i1:second" in events)
        await eventually(lambda: consumer.stats.handled == 3)
    assert events.index("end i1:first") < events.index("start i1:second")


def test_a_keyed_consumer_must_fetch_one_message_at_a_time(bus, telemetry):
    with pytest.raises(ValueError, match="one message at a time"):
        Consumer(bus.js, bus.subjects, stream="S", durable="d", filter_subject="x", registry=command_registry(),
                 handler=None, telemetry=telemetry, batch=8, key_of=lambda c: "k")
