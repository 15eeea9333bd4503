"""Admission on its own (no servers): capacity per instance, one FIFO queue per alias, its bound and Retry-After."""

from __future__ import annotations

import asyncio

import pytest

from routing.queue import AdmissionQueueFull
from services.gateway.admission import Waiter
from services.gateway.routing import Slot
from shared.projections.readmodels import INSTANCES
from stage_support import pool, row


async def test_an_instance_takes_its_capacity_and_waiters_get_freed_slots_in_arrival_order():
    admission, _, _, _ = pool(row("f1", 2), row("f2", 1))
    slots = [admission.admit("tiny") for _ in range(3)]
    assert all(isinstance(s, Slot) for s in slots)
    assert sorted(s.instance_id for s in slots) == ["f1", "f1", "f2"]
    assert admission.router.inflight == {"f1": 2, "f2": 1}

    first, second, third = (admission.admit("tiny") for _ in range(3))
    assert all(isinstance(w, Waiter) for w in (first, second, third)) and admission.waiting("tiny") == 3
    with pytest.raises(AdmissionQueueFull):
        admission.admit("tiny")

    on_f2 = next(s for s in slots if s.instance_id == "f2")
    admission.give_back(on_f2)  # f2 frees: the head of the queue has it at once
    assert first.granted.done() and first.granted.result().instance_id == "f2"
    assert not second.granted.done() and admission.waiting("tiny") == 2

    admission.leave(second, "left")  # the second client hangs up: its place goes, nothing else
    assert admission.waiting("tiny") == 1
    admission.give_back(next(s for s in slots if s.instance_id == "f1"))
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
    admission.give_back(running)
    assert late.granted.result().instance_id == "f1"


async def test_a_slot_granted_to_a_waiter_that_left_goes_to_the_next():
    admission, _, _, _ = pool(row("f1", 1))
    running = admission.admit("tiny")
    gone, next_in_line = admission.admit("tiny"), admission.admit("tiny")
    admission.give_back(running)  # granted to `gone`, which is cancelled before it claims it
    assert gone.granted.done()
    admission.leave(gone, "left")
    assert next_in_line.granted.result().instance_id == "f1"
    assert admission.router.inflight == {"f1": 1}


async def test_retry_after_follows_the_rate_the_queue_drains_at():
    admission, _, clock, _ = pool(row("f1", 1), queue_size=4)
    running = admission.admit("tiny")
    waiters = [admission.admit("tiny") for _ in range(4)]
    with pytest.raises(AdmissionQueueFull) as refused:
        admission.admit("tiny")
    assert refused.value.retry_after_s == 30.0  # nothing has drained yet: no rate to go by

    # One departure every 0.5 s: two a second.
    slot = running
    for waiter in waiters[:2]:
        clock.now += 0.5
        admission.give_back(slot)
        slot = waiter.granted.result()
        waiter.claimed = True
    more = [admission.admit("tiny") for _ in range(2)]
    clock.now += 0.5
    with pytest.raises(AdmissionQueueFull) as refused:
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
