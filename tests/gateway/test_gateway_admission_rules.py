"""Admission on its own (no servers): capacity per instance, one FIFO queue per alias, its bound and Retry-After."""

from __future__ import annotations

import asyncio
import random
from datetime import datetime, timezone

import pytest

from services.gateway.admission import Admission, AliasQueueFull, Waiter
from services.gateway.meter import Meter
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import Router, Slot
from shared.contracts.backends import BackendType, EngineKind
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

    def __init__(self, rows: tuple[InstanceRow, ...], state: RoutingState) -> None:
        self.tables = {ROUTING.name: {"tiny": RoutingRow("tiny", state, 0.0, None, None, None, {}, None, T0)},
                       INSTANCES.name: {r.instance_id: r for r in rows}}

    def __getitem__(self, projection) -> dict:
        return self.tables[projection.name]


def pool(*rows: InstanceRow, state: RoutingState = RoutingState.FAST_ONLY, queue_size: int = 3):
    """An admission over a view holding `rows`."""
    view = View(rows, state)
    clock, signals = Clock(), []

    async def publish(signal) -> None:
        signals.append(signal)

    router = Router(view, random.Random(0))  # type: ignore[arg-type]
    admission = Admission(router, Meter("g1", 2.0, clock), GatewayMetrics(), publish, "g1", queue_size, clock)
    return admission, view, clock, signals


async def test_an_instance_takes_its_capacity_and_waiters_get_freed_slots_in_arrival_order():
    admission, _, _, _ = pool(row("f1", 2), row("f2", 1))
    slots = [admission.admit("tiny") for _ in range(3)]
    assert all(isinstance(s, Slot) for s in slots)
    assert sorted(s.instance_id for s in slots) == ["f1", "f1", "f2"]
    assert admission.router.inflight == {"f1": 2, "f2": 1}

    first, second, third = (admission.admit("tiny") for _ in range(3))
    assert all(isinstance(w, Waiter) for w in (first, second, third)) and admission.waiting("tiny") == 3
    with pytest.raises(AliasQueueFull):
        admission.admit("tiny")

    on_f2 = next(s for s in slots if s.instance_id == "f2")
    admission.release(on_f2)  # f2 frees: the head of the queue has it at once
    assert first.granted.done() and first.granted.result().instance_id == "f2"
    assert not second.granted.done() and admission.waiting("tiny") == 2

    admission.leave(second, "left")  # the second client hangs up: its place goes, nothing else
    assert admission.waiting("tiny") == 1
    admission.release(next(s for s in slots if s.instance_id == "f1"))
    assert third.granted.result().instance_id == "f1"
    assert await admission.wait(third, 0.1) is third.granted.result()
    admission.leave(first, "served")
    admission.leave(third, "served")
    assert admission.waiting("tiny") == 0


async def test_an_instance_that_comes_up_goes_to_a_waiter_before_any_new_request():
    admission, view, _, _ = pool(row("f1", 1))
    running = admission.admit("tiny")
    waiter = admission.admit("tiny")
    assert isinstance(waiter, Waiter)
    # A second instance comes up; the view's listeners pump the queue before any new request is admitted.
    view[INSTANCES]["f2"] = row("f2", 1)
    admission.router.view_advanced()
    admission.view_advanced()
    assert waiter.granted.result().instance_id == "f2"
    late = admission.admit("tiny")
    assert isinstance(late, Waiter)  # f1 is still full
    admission.release(running)
    assert late.granted.result().instance_id == "f1"


async def test_a_slot_granted_to_a_waiter_that_left_goes_to_the_next():
    admission, _, _, _ = pool(row("f1", 1))
    running = admission.admit("tiny")
    gone, next_in_line = admission.admit("tiny"), admission.admit("tiny")
    admission.release(running)  # granted to `gone`, which is cancelled before it claims it
    assert gone.granted.done()
    admission.leave(gone, "left")
    assert next_in_line.granted.result().instance_id == "f1"
    assert admission.router.inflight == {"f1": 1}


async def test_retry_after_follows_the_rate_the_queue_drains_at():
    admission, _, clock, _ = pool(row("f1", 1), queue_size=4)
    running = admission.admit("tiny")
    waiters = [admission.admit("tiny") for _ in range(4)]
    with pytest.raises(AliasQueueFull) as refused:
        admission.admit("tiny")
    assert refused.value.retry_after_s == 30.0  # nothing has drained yet: no rate to go by

    # One departure every 0.5 s: two a second.
    slot = running
    for waiter in waiters[:2]:
        clock.now += 0.5
        admission.release(slot)
        slot = waiter.granted.result()
        waiter.claimed = True
    more = [admission.admit("tiny") for _ in range(2)]
    clock.now += 0.5
    with pytest.raises(AliasQueueFull) as refused:
        admission.admit("tiny")
    # 4 waiting; 2 departures in the second since the first of them: 2 a second, so 2 s.
    assert refused.value.retry_after_s == 2
    assert len(more) == 2


async def test_demand_is_signalled_only_while_requests_wait_for_an_alias_with_nothing_routable():
    admission, view, _, signals = pool()
    cold = admission.admit("tiny")
    await asyncio.sleep(0.05)
    assert [s.held for s in signals] == [1]
    view[INSTANCES]["f1"] = row("f1", 1)
    admission.router.view_advanced()
    admission.view_advanced()
    assert (await admission.wait(cold, 0.1)).instance_id == "f1"
    admission.leave(cold, "served")
    assert admission.metrics.cold_starts == {"tiny": 1}

    full = admission.admit("tiny")  # routable, only full: a queue, not a cold start
    await asyncio.sleep(0.05)
    assert isinstance(full, Waiter) and len(signals) == 1
    admission.leave(full, "left")
