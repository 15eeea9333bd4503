"""An alias's timeline, history lines and calibration record, folded from typed events in an in-memory log."""

from __future__ import annotations

import pytest
from alias_life import ALIAS, CONFIG, WARMING_REASON, F, I, R, V, at, record_a_cycle

from lab.record import RunRecord, record_from_log
from services.ops.history import inputs_of, summarize
from services.ops.timeline import STATE_EVENTS, Timeline, fold_timeline, recorded_windows
from shared.contracts.backends import EngineKind
from shared.contracts.events import PolicyDecided, event_registry
from shared.eventlog.memory import MemoryEventStore
from shared.eventlog.store import StoredEvent


@pytest.fixture
async def cycle() -> MemoryEventStore:
    store = MemoryEventStore(event_registry())
    await record_a_cycle(store)
    return store


async def timeline(store: MemoryEventStore, since_s: float, until_s: float) -> Timeline:
    facts = [StoredEvent(e.position or 0, e.occurred_at, event)
             for e, event in store.typed(await store.history(ALIAS, until=at(until_s), types=STATE_EVENTS))]
    return fold_timeline(ALIAS, at(since_s), at(until_s), facts, [], [], "")


async def test_the_timeline_folds_the_read_models_reducers_over_the_cycle(cycle):
    t = await timeline(cycle, 0, 1000)
    assert [(s.number, s.from_state, s.to_state) for s in t.switches] == [
        (1, R.COLD, R.FAST_ONLY), (2, R.FAST_ONLY, R.WARMING_VLLM), (3, R.WARMING_VLLM, R.MIXED),
        (4, R.MIXED, R.VLLM_PRIMARY), (5, R.VLLM_PRIMARY, R.FAST_ONLY), (6, R.FAST_ONLY, R.COLD)]
    assert [(s.state, s.start, s.end) for s in t.spans][2:4] == [(R.WARMING_VLLM, at(60), at(100)),
                                                                  (R.MIXED, at(100), at(140))]
    assert t.spans[2].switch.reason == WARMING_REASON
    assert [(s.at, s.value) for s in t.mix] == [(at(0), 0.0), (at(100), 0.2), (at(110), 0.5), (at(120), 0.8),
                                                (at(130), 1.0), (at(400), 0.0)]
    assert [(s.at, s.value) for s in t.targets[V]] == [(at(0), 0), (at(60), 1), (at(400), 0)]
    assert [(s.at, s.value) for s in t.targets[F]] == [(at(0), 0), (at(10), 1), (at(900), 0)]
    assert t.engines == {F: (EngineKind.LLAMA_CPP,), V: (EngineKind.SIMULATOR,)}
    assert t.instances_at(at(12)) == {F: {I.STARTING: 1}}
    assert t.instances_at(at(700)) == {F: {I.RUNNING: 1}, V: {I.SLEEP_2: 1}}
    assert t.instances_at(at(999)) == {}


async def test_a_range_starts_in_the_state_the_log_had_reached(cycle):
    t = await timeline(cycle, 125, 650)
    assert [(s.state, s.switch is None) for s in t.spans] == [
        (R.MIXED, True), (R.VLLM_PRIMARY, False), (R.FAST_ONLY, False)]
    assert t.mix_at(at(125)) == 0.8 and t.instances_at(at(125)) == {F: {I.RUNNING: 1}, V: {I.RUNNING: 1}}
    assert {b: steps[0].value for b, steps in t.targets.items()} == {F: 1, V: 1}
    assert t.engines == {F: (EngineKind.LLAMA_CPP,), V: (EngineKind.SIMULATOR,)}  # configured before the range


async def test_windows_recorded_with_decisions_count_once(cycle):
    decisions = [event for _, event in cycle.typed(await cycle.of_type(PolicyDecided.TYPE))]
    windows = recorded_windows(decisions, at(0), at(200))
    assert [w.window_end for w in windows] == [at(10), at(60), at(100), at(110), at(118), at(140)]


async def test_history_says_what_happened_from_typed_events(cycle):
    lines = [summarize(event) for _, event in cycle.typed(await cycle.history(ALIAS))]
    assert lines[0] == "configured with backends llama.cpp, vllm"
    assert f"routing FAST_ONLY -> WARMING_VLLM (vLLM share 0%) by hybrid: {WARMING_REASON}" in lines
    assert "mix 20% -> 50% to vLLM: held for 10 s, vLLM healthy" in lines
    assert "instance v1 (vllm on w1) SLEEP_1 -> SLEEP_2: autoscaler" in lines
    decided = next(event for _, event in cycle.typed(await cycle.history(ALIAS)) if isinstance(event, PolicyDecided))
    assert inputs_of(decided) == {"instances": []}


async def test_a_pool_run_read_back_for_calibration(cycle, tmp_path):
    record = record_from_log(cycle.typed(await cycle.history(ALIAS)))
    assert record.source == "event log" and record.alias["alias"] == ALIAS
    assert record.alias == CONFIG.model_dump(mode="json")
    assert [(t.t, t.instance_id, t.backend, t.from_state, t.to_state) for t in record.transitions][:2] == [
        (11.0, "f1", F, I.ABSENT, I.STARTING), (15.0, "f1", F, I.STARTING, I.RUNNING)]
    assert len(record.transitions) == 11 and record.wakes == []
    assert [(w.start, w.end) for w in record.windows][:3] == [(8.0, 10.0), (58.0, 60.0), (98.0, 100.0)]
    first_warm = record.windows[1]
    assert first_warm.arrivals == 6 and first_warm.inflight == {"llama.cpp": 3.5, "vllm": 0.0}
    record.write(tmp_path / "record.json")
    again = RunRecord.read(tmp_path / "record.json")
    assert again.transitions == record.transitions and again.windows == record.windows and again.alias == record.alias
