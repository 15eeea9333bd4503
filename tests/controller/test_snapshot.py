"""The snapshot's instance views kept between ticks, and the change notes they are kept by."""

from __future__ import annotations

import copy
import pickle
import uuid
from dataclasses import FrozenInstanceError
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.autoscaler.facts import LiveFacts
from shared.projections.snapshot import InstanceViews, instance_views
from shared.contracts.backends import Action, BackendType, EngineKind
from shared.contracts.building import builder
from shared.contracts.control import Decision, InstanceView, PolicyState
from shared.contracts.states import InstanceState
from shared.contracts.telemetry import InstanceStatus, WorkerHeartbeat
from shared.projections.rows import InstanceNote, InstanceRow

T0 = datetime(2026, 11, 23, 8, 0, tzinfo=timezone.utc)
ALIASES = ("a", "b")
WORKERS = ("w1", "w2")
INSTANCES = [f"{alias}-{n}" for alias in ALIASES for n in range(3)]


def status(instance_id: str, inflight: int, healthy: bool = True, capacity: int | None = 8) -> InstanceStatus:
    return InstanceStatus(instance_id=instance_id, alias=instance_id.split("-")[0], backend_type="llama.cpp",
                          engine="llama.cpp", status="RUNNING", inflight_requests=inflight, capacity=capacity,
                          last_active_at=T0 + timedelta(seconds=inflight), healthy=healthy)


def test_the_builder_makes_the_same_frozen_object_as_the_class():
    args = ("f1", BackendType.LLAMA_CPP, EngineKind.LLAMA_CPP, "w1", InstanceState.RUNNING, T0, 0, 8, 2, T0, True,
            frozenset(), None)
    built, made = builder(InstanceView)(*args), InstanceView(*args)
    assert type(built) is InstanceView and built == made and hash(built) == hash(made)
    assert copy.copy(built) == made and pickle.loads(pickle.dumps(built)) == made
    with pytest.raises(FrozenInstanceError):
        built.inflight = 3  # type: ignore[misc]
    decision = builder(Decision)(policy="hybrid", policy_version=1, decision_id=uuid.uuid4(), targets={},
                                 targets_reason="", state=PolicyState(), mix_weight=0.0)
    assert type(decision) is Decision and decision.actions == () and decision.state == PolicyState()


@pytest.mark.parametrize("skew_s", [-3600.0, -30.0, 0.0, 30.0, 3600.0])
def test_a_workers_freshness_is_judged_on_the_controllers_clock_whatever_the_workers_says(skew_s):
    """Across hosts clocks differ: a worker whose clock is off by an hour is fresh while it reports, and goes
    stale after three of its intervals without a new report, exactly as one whose clock agrees."""
    facts = LiveFacts()
    worker_clock = T0 + timedelta(seconds=skew_s)
    for tick in range(5):
        facts.heard(WorkerHeartbeat(worker_id="w1", at=worker_clock + timedelta(seconds=tick), interval_s=1,
                                    instances=[status("a-0", 1)]), T0 + timedelta(seconds=tick))
        assert facts.fresh_workers(T0 + timedelta(seconds=tick, milliseconds=500)) == {"w1"}
    assert facts.last_heard("w1") == T0 + timedelta(seconds=4)
    # The same heartbeat read again (from the bucket, say) is no news: it does not refresh the worker.
    facts.heard(WorkerHeartbeat(worker_id="w1", at=worker_clock + timedelta(seconds=4), interval_s=1,
                                instances=[status("a-0", 1)]), T0 + timedelta(seconds=9))
    assert facts.last_heard("w1") == T0 + timedelta(seconds=4)
    assert facts.fresh_workers(T0 + timedelta(seconds=7)) == {"w1"}
    assert facts.fresh_workers(T0 + timedelta(seconds=7.5)) == set()


def test_the_facts_note_changed_and_vanished_reports_only():
    facts = LiveFacts()
    assert facts.take_changes() is None  # nothing read yet: anything may have changed
    first = [status("a-0", 1), status("a-1", 0)]
    facts.heard(WorkerHeartbeat(worker_id="w1", at=T0, interval_s=1, instances=first), T0)
    assert facts.take_changes() == {"a-0": "a", "a-1": "a"}
    # The same again, freshly parsed: no change, and the index keeps the objects it had.
    facts.heard(WorkerHeartbeat(worker_id="w1", at=T0 + timedelta(seconds=1), interval_s=1,
                                instances=[status("a-0", 1), status("a-1", 0)]), T0 + timedelta(seconds=1))
    assert facts.take_changes() == {} and facts.statuses()["a-0"] is first[0]
    facts.heard(WorkerHeartbeat(worker_id="w1", at=T0 + timedelta(seconds=2), interval_s=1, instances=[status("a-0", 3)]),
                T0 + timedelta(seconds=2))
    assert facts.take_changes() == {"a-0": "a", "a-1": "a"} and "a-1" not in facts.statuses()
    facts.heard(WorkerHeartbeat(worker_id="w1", at=T0, interval_s=1, instances=[]), T0 + timedelta(seconds=3))  # older: ignored
    assert facts.take_changes() == {} and "a-0" in facts.statuses()


step = st.one_of(
    st.tuples(st.just("report"), st.sampled_from(INSTANCES), st.integers(0, 3), st.booleans(), st.sampled_from([None, 4, 8])),
    st.tuples(st.just("silence"), st.sampled_from(INSTANCES)),
    st.tuples(st.just("row"), st.sampled_from(INSTANCES),
              st.sampled_from([InstanceState.RUNNING, InstanceState.SLEEP_1, InstanceState.DRAINING, InstanceState.ERROR])),
    st.tuples(st.just("add"), st.sampled_from(INSTANCES)),
    st.tuples(st.just("remove"), st.sampled_from(INSTANCES)),
    st.tuples(st.just("note"), st.sampled_from(INSTANCES)),
    st.tuples(st.just("worker"), st.sampled_from(WORKERS)),
    st.tuples(st.just("tick")),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=1, max_size=80))
def test_views_kept_between_ticks_equal_views_built_afresh(steps):
    """Whatever changes between ticks, told as the controller tells it, the kept views are the fresh ones."""
    facts, views = LiveFacts(), InstanceViews()
    rows = {alias: {} for alias in ALIASES}
    notes = {alias: {} for alias in ALIASES}
    reports = {w: {} for w in WORKERS}
    up, touched = set(WORKERS), set(ALIASES)
    now = T0

    def worker_of(instance_id: str) -> str:
        return WORKERS[int(instance_id[-1]) % 2]

    def add(instance_id: str) -> None:
        alias = instance_id.split("-")[0]
        rows[alias][instance_id] = InstanceRow(instance_id, alias, BackendType.LLAMA_CPP, EngineKind.LLAMA_CPP,
                                               worker_of(instance_id), InstanceState.RUNNING, 0, 0, 8, None, None, None,
                                               "started", now)
        touched.add(alias)

    for instance_id in INSTANCES[::2]:
        add(instance_id)
    for instance_id in INSTANCES:
        reports[worker_of(instance_id)][instance_id] = status(instance_id, 1)
    for kind, *args in [*steps, ("tick",)]:
        alias = args[0].split("-")[0] if args else None
        if kind == "report":
            reports[worker_of(args[0])][args[0]] = status(args[0], args[1], args[2], args[3])
        elif kind == "silence":
            reports[worker_of(args[0])].pop(args[0], None)
        elif kind == "row" and args[0] in rows[alias]:
            rows[alias][args[0]] = rows[alias][args[0]]._replace(state=args[1], updated_at=now)  # as the projection does
            touched.add(alias)
        elif kind == "add":
            add(args[0])
        elif kind == "remove":
            rows[alias].pop(args[0], None)
            touched.add(alias)
        elif kind == "note":
            notes[alias][args[0]] = InstanceNote((Action.SLEEP,), (Action.WAKE, now))
            touched.add(alias)
        elif kind == "worker":
            up ^= {args[0]}
        elif kind == "tick":
            now += timedelta(seconds=1)
            for worker_id, reported in reports.items():
                facts.heard(WorkerHeartbeat(worker_id=worker_id, at=now, interval_s=1, instances=list(reported.values())),
                            now)
            fresh = facts.fresh_workers(now)
            views.begin(facts.statuses(), up, fresh, facts.take_changes(), touched)
            touched = set()
            for name in ALIASES:
                kept = views.of(name, rows[name].values(), notes[name])
                assert kept == instance_views(rows[name].values(), facts.statuses(), up, fresh, notes[name])
