"""Properties of `decide` over random load, failures and timing (hypothesis)."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from world import FAST, SLOW, R, S, World, alias_config, with_hybrid

from policy import decide
from shared.contracts.backends import Action
from shared.contracts.control import DECISION, SNAPSHOT
from shared.contracts.effects import effect_of

SCALE_UP = {Action.START, Action.WAKE}

window = st.fixed_dictionaries({
    "seconds": st.sampled_from([0.5, 1.0, 2.0, 5.0, 30.0, 120.0, 400.0]),
    "inflight_fast": st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 6.0, 30.0]),
    "inflight_slow": st.sampled_from([0.0, 0.0, 1.0, 4.0, 40.0]),
    "queue_wait_p95_s": st.sampled_from([None, 0.1, 3.0]),
    "e2e_p95_fast_s": st.sampled_from([None, 1.0, 40.0]),
    "e2e_p95_slow_s": st.sampled_from([None, 1.0, 40.0]),
    "timeouts_slow": st.sampled_from([0, 0, 0, 2]),
    "demand": st.sampled_from([0, 0, 3]),
    "measured": st.booleans(),
    "fail_vllm": st.sampled_from([False, False, False, True]),
})

configs = st.sampled_from([
    alias_config(),
    alias_config(fast=(1, 3), slow=(0, 2)),
    alias_config(fast=None, slow=(0, 2)),
    alias_config(slow=None),
])

hybrid_params = st.sampled_from([
    {},
    {"down_hold_s": 10, "vllm_sleep_l1_idle_s": 5, "vllm_sleep_l2_idle_s": 10, "vllm_delete_idle_s": 20,
     "cold_idle_s": 15, "retry_s": 10, "vllm_warm_timeout_s": 20, "llama_scale_down_cooldown_s": 3, "mix_step_s": 2},
])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, params=hybrid_params, windows=st.lists(window, min_size=1, max_size=60))
def test_decisions_stay_legal_bounded_deterministic_and_survive_a_json_round_trip(config, params, windows):
    w = World(config=with_hybrid(config, **params))
    for spec in windows:
        if spec["fail_vllm"]:
            w.fail_starts.add(SLOW)
        else:
            w.fail_starts.discard(SLOW)
        w.now += timedelta(seconds=spec["seconds"])
        metrics = w.window(spec["seconds"], inflight_fast=spec["inflight_fast"], inflight_slow=spec["inflight_slow"],
                           queue_wait_p95_s=spec["queue_wait_p95_s"], e2e_p95_fast_s=spec["e2e_p95_fast_s"],
                           e2e_p95_slow_s=spec["e2e_p95_slow_s"], timeouts_slow=spec["timeouts_slow"]) \
            if spec["measured"] else None
        before = w.routing
        w._workers_act()
        snapshot = w.snapshot(metrics, spec["demand"])

        decision = decide(snapshot, w.now)
        # Deterministic, and the same after the snapshot is recorded and read back.
        assert decide(snapshot, w.now) == decision
        recorded = SNAPSHOT.validate_json(SNAPSHOT.dump_json(snapshot))
        assert DECISION.dump_python(decide(recorded, w.now), mode="json") == DECISION.dump_python(decision, mode="json")

        # Bounds.
        for backend, target in decision.targets.items():
            bounds = config.backends[backend]
            assert bounds.min_replicas <= target <= bounds.max_replicas
        assert 0.0 <= decision.mix_weight <= 1.0
        # No tier scales up and down at once; llama.cpp is never asked to sleep; one fast removal per cycle.
        for backend in config.backends:
            mine = [a for a in decision.actions if a.backend is backend]
            instances = {i.instance_id: i for i in snapshot.instances}
            up = [a for a in mine if a.action in SCALE_UP]
            down = [a for a in mine if a.action in (Action.SLEEP, Action.DRAIN) and instances[a.instance_id].state is S.RUNNING
                    or (a.action is Action.DELETE and instances[a.instance_id].state is S.STARTING)]
            assert not (up and down), decision.actions
            if backend is FAST:
                assert not [a for a in mine if a.action is Action.SLEEP]
                assert len(down) <= 1 or any(a.reason.startswith("surplus while") for a in down) or w.routing is R.COLD
        # Every command is legal for its instance's state when it is decided.
        for a in decision.actions:
            current = instances.get(a.instance_id)
            effect_of(a.action, a.backend, current.state if current else S.ABSENT, a.level)
        # One command at a time per instance.
        ids = [a.instance_id for a in decision.actions]
        assert len(ids) == len(set(ids))
        assert not set(ids) & {p.instance_id for p in snapshot.pending}

        # Apply it the way the world does (which also checks every transition is legal).
        w.decisions.append(decision)
        if decision.routing:
            assert decision.routing.from_state is before
        _apply(w, snapshot, decision)


def _apply(w: World, snapshot, decision) -> None:
    from shared.contracts.control import PendingCommand
    from shared.contracts.states import check_routing_transition

    if decision.routing:
        check_routing_transition(decision.routing.from_state, decision.routing.to_state)
        w.routing, w.routing_since = decision.routing.to_state, w.now
    if w.routing is R.MIXED:
        assert round(decision.mix_weight * 100) in w.config.autoscaling_policy.mix_weights
    elif w.routing is R.VLLM_PRIMARY:
        assert decision.mix_weight == 1.0
    else:
        assert decision.mix_weight == 0.0
    w.mix_weight = decision.mix_weight
    w.state = decision.state
    if decision.effective(snapshot):
        w.version += 4
        w.targets = dict(decision.targets)
    for a in decision.actions:
        w.pending[a.instance_id] = PendingCommand(a.command_id, a.action, a.backend, a.instance_id, w.now, a.level)
