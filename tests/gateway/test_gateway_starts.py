"""Where a cold start stands, from the log: starts, placements and wakes folded into a phase and an ETA."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

from alias_life import ALIAS as LIFE_ALIAS, AliasLife

from shared.contracts.backends import Action, BackendType, EngineKind
from shared.contracts.control import PlannedAction
from shared.contracts.events import InstanceLoading, InstanceStateChanged, PlacementRequested, PolicyDecided
from shared.contracts.states import InstanceState as I
from shared.eventlog.store import StoredEvent
from shared.projections.rows import InstanceRow
from services.gateway.starts import StartTimes

FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


class Log:
    def __init__(self) -> None:
        self.events: list[StoredEvent] = []
        self.states: dict[str, I] = {}

    def at(self, seconds: float, event) -> None:
        self.events.append(StoredEvent(len(self.events) + 1, T0 + timedelta(seconds=seconds), event))

    def move(self, seconds: float, instance_id: str, backend: BackendType, to_state: I) -> None:
        self.at(seconds, InstanceStateChanged.model_construct(
            instance_id=instance_id, alias="a", backend_type=backend, engine=EngineKind.SIMULATOR, worker_id="w1",
            from_state=self.states.get(instance_id, I.ABSENT), to_state=to_state, reason="test"))
        self.states[instance_id] = to_state

    def placed(self, seconds: float, instance_id: str, backend: BackendType) -> None:
        self.at(seconds, PlacementRequested(request_id=uuid.uuid4(), alias="a", backend_type=backend,
                                            instance_id=instance_id, gpu_memory_gb=0))

    def loading(self, seconds: float, instance_id: str, backend: BackendType) -> None:
        self.at(seconds, InstanceLoading(instance_id=instance_id, alias="a", backend_type=backend, worker_id="w1"))

    def wake(self, seconds: float, instance_id: str) -> None:
        # Only the decision's actions are read here: a PolicyDecided stand-in without the snapshot it records.
        action = PlannedAction(Action.WAKE, SLOW, instance_id, uuid.uuid4(), "demand")
        self.at(seconds, PolicyDecided.model_construct(alias="a", decision=SimpleNamespace(actions=(action,))))


def row(instance_id: str, backend: BackendType, state: I, since_s: float) -> InstanceRow:
    level = {I.SLEEP_1: 1, I.SLEEP_2: 2}.get(state, 0)
    return InstanceRow(instance_id, "a", backend, EngineKind.SIMULATOR, "w1", state, level, 0, None, None, None, None,
                       "test", T0 + timedelta(seconds=since_s))


def test_each_phase_has_its_backend_measured_time_less_the_time_spent_in_it():
    log = Log()
    log.placed(0, "f1", FAST)
    log.move(1, "f1", FAST, I.STARTING)
    log.loading(1.5, "f1", FAST)
    log.move(3, "f1", FAST, I.RUNNING)  # 2 s starting, 1.5 of them loading, 3 s from placement
    log.placed(0, "v1", SLOW)
    log.move(2, "v1", SLOW, I.STARTING)
    log.move(40, "v1", SLOW, I.RUNNING)  # 38 s starting, 40 s from placement
    log.move(60, "v1", SLOW, I.SLEEP_1)
    log.wake(100, "v1")
    log.move(102.5, "v1", SLOW, I.RUNNING)  # a level-1 wake: 2.5 s
    log.placed(100, "v2", SLOW)
    log.move(101, "v2", SLOW, I.STARTING)
    log.move(140, "v2", SLOW, I.RUNNING)
    log.move(150, "v2", SLOW, I.SLEEP_2)
    log.wake(200, "v2")
    log.move(211, "v2", SLOW, I.RUNNING)  # a level-2 wake reloads the weights: 11 s
    log.move(300, "v1", SLOW, I.SLEEP_1)
    log.move(300, "v2", SLOW, I.SLEEP_2)
    starts = StartTimes(hold_timeout_s=120)
    starts.apply(log.events)
    now = T0 + timedelta(seconds=400)

    # Nothing under way (the instances sleep and no wake is decided): the fastest backend, placement to serving.
    asleep = [row("v1", SLOW, I.SLEEP_1, 300), row("v2", SLOW, I.SLEEP_2, 300)]
    placing = starts.progress("a", [FAST, SLOW], asleep, now)
    assert (placing.phase, placing.eta_s, placing.backend) == ("placing", 3.0, FAST)
    assert starts.progress("a", [SLOW], asleep, now).eta_s == 40.0
    assert starts.progress("b", [FAST, SLOW], [], now).eta_s is None  # another alias: nothing measured

    # A level-2 wake decided 4 s ago: 11 s measured at that level, 7 to go; a start 1 s in: 37 to go.
    log.wake(396, "v2")
    starts.apply(log.events[-1:])
    waking = starts.progress("a", [FAST, SLOW], [*asleep, row("v3", SLOW, I.STARTING, 399)], now)
    assert (waking.phase, waking.eta_s, waking.backend) == ("waking", 7.0, SLOW)
    # A level-1 wake decided now would be sooner (2.5 s), and overdue ones say 0, never less.
    log.wake(400, "v1")
    starts.apply(log.events[-1:])
    assert starts.progress("a", [FAST, SLOW], asleep, now).eta_s == 2.5
    overdue = starts.progress("a", [FAST], [row("f2", FAST, I.STARTING, 390)], now)
    assert (overdue.phase, overdue.eta_s) == ("starting", 0.0)
    # The same start once its engine answers and loads: 1.5 s measured, 1 s ago.
    log.placed(398, "f2", FAST)
    log.move(398.5, "f2", FAST, I.STARTING)
    log.loading(399, "f2", FAST)
    starts.apply(log.events[-3:])
    loading = starts.progress("a", [FAST], [row("f2", FAST, I.STARTING, 398.5)], now)
    assert (loading.phase, loading.eta_s, loading.backend) == ("loading", 0.5, FAST)

    assert starts.budget_s("a") == 3 * 39 + 2  # the hold: 3 x the longest start of any backend + 2 s


def test_the_comment_a_held_stream_receives():
    starts = StartTimes(hold_timeout_s=120)
    nothing_measured = starts.progress("a", [FAST], [], T0)
    assert nothing_measured.comment(1.2345) == b": modelpool cold-start phase=placing waited_ms=1234\n\n"
    log = Log()
    log.placed(0, "f1", FAST)
    log.move(0.5, "f1", FAST, I.STARTING)
    log.move(2.25, "f1", FAST, I.RUNNING)
    starts.apply(log.events)
    line = starts.progress("a", [FAST], [row("f2", FAST, I.STARTING, 1)], T0 + timedelta(seconds=2)).comment(3)
    assert line == b": modelpool cold-start phase=starting eta_ms=750 backend=llama.cpp waited_ms=3000\n\n"


async def test_the_times_already_in_the_log_are_read_at_start_as_they_would_have_been_followed(store):
    life = AliasLife(store)
    await life.configure(0)
    await life.instance("v1", SLOW, [(10, I.ABSENT, I.STARTING), (40, I.STARTING, I.RUNNING),
                                     (100, I.RUNNING, I.SLEEP_1), (150, I.SLEEP_1, I.SLEEP_2)])
    await life.decide(200, actions=(PlannedAction(Action.WAKE, SLOW, "v1", uuid.uuid4(), "demand"),))
    await life.instance("v1", SLOW, [(209, I.SLEEP_2, I.RUNNING)])
    head = await store.head_position()
    loaded = StartTimes(hold_timeout_s=120)
    await loaded.load(store.engine, [LIFE_ALIAS], head)
    followed = StartTimes(hold_timeout_s=120)
    async for batch in store.iter_events(0, head):
        followed.apply(batch)
    for times in (loaded, followed):
        assert times.starts.median((LIFE_ALIAS, SLOW)) == 30.0
        assert times.wakes.median((LIFE_ALIAS, SLOW, 2)) == 9.0  # a level-2 wake, from the decision to RUNNING
