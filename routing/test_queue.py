"""The admission queue on its own: FIFO order, the per-session exception, its bound and its Retry-After."""

from __future__ import annotations

import pytest

from routing.queue import DRAIN_MEMORY_S, AdmissionQueue, AdmissionQueueFull


class Instances:
    """Free slots per instance; each request names the instance it may use (None: any)."""

    def __init__(self, **free: int) -> None:
        self.free = free

    def take(self, request: tuple[str, str | None]) -> str | None:
        _, wants = request
        for instance, room in self.free.items():
            if room and wants in (None, instance):
                self.free[instance] -= 1
                return instance
        return None


def test_a_newcomer_queues_behind_waiters_and_freed_slots_go_head_first():
    queue: AdmissionQueue[tuple[str, str | None], str] = AdmissionQueue("tiny", size=3)
    pool = Instances(a=1)
    assert queue.admit(("r1", None), 0.0, pool.take, per_session=False) == "a"
    assert queue.admit(("r2", None), 0.0, pool.take, per_session=False) is None
    pool.free["a"] = 1  # room frees, but r3 must not overtake r2
    assert queue.admit(("r3", None), 0.1, pool.take, per_session=False) is None
    assert queue.pump(0.2, pool.take, per_session=False) == [(("r2", None), "a")]
    assert list(queue.waiting) == [("r3", None)]


def test_with_sessions_a_waiter_for_a_full_instance_holds_back_nobody():
    pool = Instances(a=0, b=1)
    fifo: AdmissionQueue[tuple[str, str | None], str] = AdmissionQueue("tiny", size=3)
    fifo.admit(("s1", "a"), 0.0, pool.take, per_session=False)
    assert fifo.admit(("s2", "b"), 0.0, pool.take, per_session=False) is None  # without sessions: behind s1

    queue: AdmissionQueue[tuple[str, str | None], str] = AdmissionQueue("tiny", size=3)
    assert queue.admit(("s1", "a"), 0.0, pool.take, per_session=True) is None  # its instance is full
    assert queue.admit(("s2", "b"), 0.0, pool.take, per_session=True) == "b"  # b's slot is of no use to s1
    assert queue.admit(("s3", "b"), 0.0, pool.take, per_session=True) is None
    pool.free["b"] = 1
    assert queue.pump(0.1, pool.take, per_session=True) == [(("s3", "b"), "b")]  # s1 still waits for a
    pool.free["a"] = 1
    assert queue.pump(0.2, pool.take, per_session=True) == [(("s1", "a"), "a")]


def test_a_full_queue_refuses_except_a_request_readmitted_to_its_head():
    queue: AdmissionQueue[tuple[str, str | None], str] = AdmissionQueue("tiny", size=1)
    pool = Instances(a=0)
    queue.admit(("r1", None), 0.0, pool.take, per_session=False)
    with pytest.raises(AdmissionQueueFull) as full:
        queue.admit(("r2", None), 0.0, pool.take, per_session=False)
    assert full.value.waiting == 1 and "`tiny`" in str(full.value)
    assert full.value.retry_after_s == DRAIN_MEMORY_S  # nothing has drained: no rate to go by
    queue.admit(("decode", None), 0.0, pool.take, per_session=False, readmitted=True)
    assert [r for r, _ in queue.waiting] == ["decode", "r1"]
    queue.leave(("r1", None))
    queue.leave(("gone", None))  # leaving twice, or never queued, is harmless
    assert [r for r, _ in queue.waiting] == ["decode"]


def test_retry_after_follows_the_rate_the_queue_drained_at_lately():
    queue: AdmissionQueue[tuple[str, str | None], str] = AdmissionQueue("tiny", size=8)
    pool = Instances(a=0)
    for k in range(6):
        queue.admit((f"r{k}", None), 0.0, pool.take, per_session=False)
    for t in (1.0, 1.5):  # two departures, half a second apart
        pool.free["a"] = 1
        queue.pump(t, pool.take, per_session=False)
    # 4 waiting, 2 departures in the second since the first of them: 2 a second, so 2 s.
    assert queue.retry_after_s(2.0) == 2
    assert queue.retry_after_s(5.0) == 8  # a queue that stalls reads slower and slower
    assert queue.drained_lately(5.0) and not queue.drained_lately(1.5 + DRAIN_MEMORY_S + 1)
    assert queue.retry_after_s(1.5 + DRAIN_MEMORY_S + 1) == DRAIN_MEMORY_S
