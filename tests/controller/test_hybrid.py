"""The hybrid policy of seed 000, stepped tick by tick on a fake clock.

Every transition is checked at its threshold and not one tick earlier, with the
§11 defaults (C_vllm 39 from T_kv / T_req until vLLM reports 38; C_up 27,
C_down 11, C_prepare 3; llama.cpp reports 4 slots).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from world import FAST, SLOW, T0, R, S, World, alias_config, with_hybrid

from shared.contracts.backends import Action
from shared.contracts.control import StartFailure


def until_switch(w: World, seconds: float, step: float = 2.0, **load):
    """Tick with the given load until the routing state changes (or `seconds` pass); the switching decision."""
    for _ in range(int(seconds / step)):
        d = w.run(step, step, **load)[-1]
        if d.routing:
            return d
    raise AssertionError(f"no routing switch within {seconds} s (still {w.routing.value})")


def actions(decision, action=None, backend=None):
    return [a for a in decision.actions if (action is None or a.action is action) and (backend is None or a.backend is backend)]


def fast_only(**params) -> World:
    """FAST_ONLY with one llama.cpp instance serving (under the hybrid's `params`)."""
    w = World(config=with_hybrid(alias_config(), **params))
    w.at(R.FAST_ONLY)
    w.put("f1", FAST)
    w.tick(0)
    return w


# --------------------------------------------------------------------------- COLD -> FAST_ONLY


def test_cold_alias_waits_for_demand_then_starts_exactly_one_fast_instance():
    w = World()
    assert w.tick(1).routing is None and not w.decisions[-1].actions
    first = w.tick(1, demand=8)
    assert first.routing.from_state is R.COLD and first.routing.to_state is R.FAST_ONLY
    assert "8 request(s) waiting" in first.routing.reason
    (start,) = actions(first, Action.START)
    assert start.backend is FAST and start.instance_id.startswith("a-fast-")
    # The wave keeps signalling while the instance starts: the start in flight counts.
    for _ in range(8):
        assert not actions(w.tick(0.5, demand=8), Action.START)
    (cold,) = [d.cold_start for d in w.decisions if d.cold_start]
    assert cold.instance_id == start.instance_id and cold.backend is FAST
    assert cold.ready_at - cold.demand_at == timedelta(seconds=2.5)  # handled 0.5 s after, up 2 s later
    assert len([c for c in w.commands_sent if c[0] is Action.START]) == 1


def test_a_wave_held_through_the_cold_start_is_not_load_one_instance_starts():
    # The gateways hold the wave while nothing runs: their windows say 8 waiting all along.
    w = World()
    w.tick(1, demand=8)
    while not w.of(FAST, S.RUNNING):  # the last of these windows, the one it came up in, held the wave too
        w.run(1, step=1, arrivals=8, queue_len=8.0, held=8)
    assert len([c for c in w.commands_sent if c[0] is Action.START]) == 1


def test_held_requests_start_a_fast_instance_even_with_no_floor():
    # Scaled to zero inside FAST_ONLY (floor 0, no min_replicas): a request held at a gateway starts one.
    w = World(config=with_hybrid(alias_config(), llama_floor_replicas=0))
    w.tick(1, demand=1)
    assert w.routing is R.FAST_ONLY and len([c for c in w.commands_sent if c[0] is Action.START]) == 1
    idle = World(config=with_hybrid(alias_config(), llama_floor_replicas=0))
    idle.at(R.FAST_ONLY)
    assert not actions(idle.tick(1), Action.START)  # nothing held, nothing kept


def test_an_alias_without_a_fast_tier_is_served_by_vllm_from_cold():
    w = World(config=alias_config(fast=None))
    d = w.tick(1, demand=1)
    assert d.routing.to_state is R.VLLM_PRIMARY and d.mix_weight == 1.0
    assert [a.backend for a in actions(d, Action.START)] == [SLOW]


def test_min_replicas_is_standing_demand():
    w = World(config=alias_config(fast=(1, 2)))
    d = w.tick(1)
    assert d.routing.to_state is R.FAST_ONLY and len(actions(d, Action.START, FAST)) == 1
    assert d.cold_start is None and w.state.policy.demand_at is None


# --------------------------------------------------------------------------- FAST_ONLY -> WARMING_VLLM


def test_warming_needs_consecutive_windows_and_an_opposite_window_resets_the_count():
    w = fast_only()
    assert w.run(2, inflight_fast=3.0)[-1].routing is None  # 1 window >= C_prepare 3
    assert w.state.policy.up_windows == 1
    w.tick(0.5, w.decisions and w.window(2, inflight_fast=3.0))  # the same window seen again does not count
    w.run(2, inflight_fast=1.0)  # below: the count starts over
    assert w.state.policy.up_windows == 0
    assert w.run(2, inflight_fast=3.0)[-1].routing is None
    d = w.run(2, inflight_fast=3.0)[-1]
    assert d.routing.to_state is R.WARMING_VLLM
    assert "2 consecutive windows" in d.routing.reason and "inflight_total 3 >= C_prepare 3" in d.routing.reason
    (start,) = actions(d, Action.START, SLOW)


@pytest.mark.parametrize("signal,reason", [
    ({"queue_wait_p95_s": 2.5}, "queue_wait_p95 2.5 s > 2 s"),
    ({"e2e_p95_fast_s": 31.0}, "e2e_p95_fast 31 s > 30 s"),
    ({"inflight_fast": 27.0}, "inflight_fast 27 >= C_up 27"),
])
def test_each_warm_up_signal_alone_triggers_warming(signal, reason):
    w = fast_only()
    w.run(2, inflight_fast=signal.get("inflight_fast", 0.5), **{k: v for k, v in signal.items() if k != "inflight_fast"})
    d = w.run(2, inflight_fast=signal.get("inflight_fast", 0.5), **{k: v for k, v in signal.items() if k != "inflight_fast"})[-1]
    assert d.routing.to_state is R.WARMING_VLLM and reason in d.routing.reason


def test_hybrid_disabled_or_no_slow_tier_never_warms():
    for w in (fast_only(enable=False), World(config=alias_config(slow=None))):
        w.at(R.FAST_ONLY)
        w.put("f1", FAST)
        assert all(d.routing is None for d in w.run(60, inflight_fast=8.0))
        assert not [a for d in w.decisions for a in d.actions if a.backend is SLOW]


def test_a_fast_burst_scales_llama_cpp_first_bounded_by_max_replicas():
    w = fast_only(enable=False)
    d = w.run(2, inflight_fast=7.0)[-1]  # L_target = ceil(7 / C_l 4) = 2
    assert d.targets[FAST] == 2 and len(actions(d, Action.START, FAST)) == 1
    d = w.run(2, inflight_fast=20.0)[-1]  # wants 5; max_replicas 2
    assert d.targets[FAST] == 2 and "bounded to 0..2" in d.targets_reason


def test_requests_waiting_in_the_gateways_count_as_load():
    # The gateways admit at most an instance's capacity (C_l 4): the rest wait there. A pool
    # blind to the queue would never see more than it already has.
    w = fast_only(enable=False)
    d = w.run(2, inflight_fast=4.0, queue_len=6.0)[-1]  # L_target = ceil((4 + 6) / 4) = 3, bounded to 2
    assert d.targets[FAST] == 2 and "ceil(max(0, 10 - C_eff 0) / C_l 4)" in d.targets_reason
    w = fast_only()
    assert w.of(FAST, S.RUNNING)  # requests wait for a slot, not for a start
    assert w.run(2, inflight_fast=1.0, queue_len=0.0)[-1].routing is None
    w.run(4, inflight_fast=1.0, queue_len=3.0)  # inflight_total 4 >= C_prepare 3, two windows running
    assert w.routing is R.WARMING_VLLM


# --------------------------------------------------------------------------- WARMING_VLLM -> MIXED


def warming() -> World:
    w = fast_only()
    w.run(4, inflight_fast=3.0)
    assert w.routing is R.WARMING_VLLM
    return w


def test_mixed_after_n_ready_healthy_probes_not_one_earlier_and_a_sick_probe_resets():
    w = warming()
    while not w.of(SLOW, S.RUNNING):  # vLLM starts in 40 s
        w.tick(1)
    (slow,) = w.of(SLOW, S.RUNNING)
    assert w.routing is R.WARMING_VLLM
    w.instances[slow.instance_id] = replace(slow, healthy=False)
    w.run(2, inflight_fast=3.0)
    assert w.state.policy.ready_probes == 0
    w.instances[slow.instance_id] = slow
    assert w.run(2, inflight_fast=3.0)[-1].routing is None  # probe 1
    d = w.run(2, inflight_fast=3.0)[-1]  # probe 2 = ready_probes
    assert d.routing.to_state is R.MIXED and d.mix_weight == pytest.approx(0.2)
    assert "healthy in 2 consecutive probes" in d.routing.reason


def test_a_sleeping_vllm_is_woken_rather_than_a_new_one_started():
    w = fast_only()
    w.put("s1", SLOW, S.SLEEP_2, last_active_at=w.now - timedelta(seconds=1000))
    w.put("s2", SLOW, S.SLEEP_1, last_active_at=w.now - timedelta(seconds=400))
    w.run(2, inflight_fast=3.0)
    d = w.run(2, inflight_fast=3.0)[-1]
    assert d.routing.to_state is R.WARMING_VLLM
    assert [(a.action, a.instance_id) for a in actions(d, backend=SLOW)] == [(Action.WAKE, "s2")]  # level 1 wakes faster


# --------------------------------------------------------------------------- MIXED ramp -> VLLM_PRIMARY


def mixed() -> World:
    w = World()
    w.at(R.MIXED, 0.2)
    w.put("f1", FAST)
    w.put("s1", SLOW)
    w.tick(0)
    return w


def test_the_ramp_steps_20_50_80_100_each_after_its_hold_then_vllm_primary():
    w = mixed()
    weights, switches = [0.2], []
    for _ in range(30):
        d = w.run(2, inflight_fast=2.0, inflight_slow=2.0, e2e_p95_slow_s=1.0)[-1]
        if d.mix:
            assert (w.now - w.routing_since) >= timedelta(seconds=10 * len(weights))
            weights.append(d.mix.to_weight)
        if d.routing:
            switches.append((d.routing.to_state, w.now - w.routing_since))
            break
    assert weights == [0.2, 0.5, 0.8, 1.0]
    assert switches and switches[0][0] is R.VLLM_PRIMARY and w.mix_weight == 1.0


def test_a_step_is_held_while_vllm_breaks_its_sla_and_taken_when_it_recovers():
    w = mixed()
    for d in w.run(30, inflight_slow=2.0, e2e_p95_slow_s=45.0):
        assert d.mix is None
    assert any("held: vLLM e2e_p95 45 s > 30 s" in n.what for n in w.decisions[-1].outlook)
    d = w.run(2, inflight_slow=2.0, e2e_p95_slow_s=2.0)[-1]
    assert d.mix and d.mix.to_weight == pytest.approx(0.5)


def test_mixed_step_not_one_tick_early():
    w = mixed()
    w.tick(9.9, w.window(2, e2e_p95_slow_s=1.0))
    assert w.decisions[-1].mix is None
    assert w.tick(0.1, w.window(2, e2e_p95_slow_s=1.0)).mix.to_weight == pytest.approx(0.5)


# --------------------------------------------------------------------------- scale-down order


def vllm_primary(fast: int = 2, fast_max: int = 2) -> World:
    w = World(config=alias_config(fast=(0, fast_max)))
    w.at(R.VLLM_PRIMARY)
    for n in range(fast):
        w.put(f"f{n + 1}", FAST)
    w.put("s1", SLOW)
    w.tick(0)
    return w


def test_fast_buffer_reclaimed_one_per_cooldown_drained_before_delete_never_asked_to_sleep():
    w = vllm_primary(fast=3, fast_max=3)
    began = w.now
    drains, deletes = [], []
    for _ in range(60):
        d = w.run(2, inflight_slow=5.0)[-1]
        assert len(actions(d, Action.DRAIN, FAST)) <= 1  # at most one fast removal per cycle
        for a in actions(d, backend=FAST):
            assert a.action is not Action.SLEEP
            if a.action is Action.DRAIN:
                assert a.substitute_for is Action.SLEEP and "llama.cpp has no sleep" in a.reason
                drains.append(w.now)
            if a.action is Action.DELETE:
                deletes.append((w.now, a.instance_id))
    assert len(drains) == 2 and len(w.of(FAST)) == 1  # down to L_floor
    assert drains[1] - drains[0] >= timedelta(seconds=30)
    assert drains[0] - began == timedelta(seconds=4)  # hysteresis: the second window asking for fewer
    assert all(when > drains[0] for when, _ in deletes)


def test_a_rebound_halts_scale_down_and_restarts_the_hysteresis():
    w = vllm_primary(fast=2)
    w.run(2, inflight_slow=5.0)  # one window asking for 1 fast replica
    d = w.run(2, inflight_slow=0.0, inflight_fast=40.0)[-1]  # load comes back: wants 2 again
    assert not actions(d, Action.DRAIN) and w.state.tiers[FAST].down_windows == 0
    d = w.run(2, inflight_slow=5.0)[-1]
    assert not actions(d, Action.DRAIN)  # counting from one again
    d = w.run(2, inflight_slow=5.0)[-1]
    assert len(actions(d, Action.DRAIN, FAST)) == 1


def test_vllm_primary_to_fast_only_after_the_down_hold_with_vllm_idle():
    w = vllm_primary(fast=1)
    for d in w.run(178, inflight_slow=1.0):
        assert d.routing is None  # low (< min(C_down 11, C_prepare 3)) but not for 180 s yet
    assert w.run(4, inflight_slow=1.0)[-1].routing is None  # 180 s low, but vLLM not idle
    d = w.run(2, inflight_slow=0.0)[-1]
    assert d.routing.to_state is R.FAST_ONLY and d.mix_weight == 0.0 and d.targets[SLOW] == 0


def test_a_busy_window_restarts_the_down_hold():
    w = vllm_primary(fast=1)
    w.run(120, inflight_slow=0.0)
    w.run(2, inflight_slow=6.0)
    assert w.state.policy.low_load_since is None
    restarted = w.now + timedelta(seconds=2)  # the first low window after the busy one
    d = until_switch(w, 200, inflight_slow=0.0)
    assert d.routing.to_state is R.FAST_ONLY and w.now - restarted == timedelta(seconds=180)


def test_the_vllm_sleep_ladder_then_load_returns_and_wakes_it():
    w = fast_only()
    idle_from = w.now
    w.put("s1", SLOW, last_active_at=idle_from)
    seen = []
    for _ in range(1900):
        d = w.tick(1, w.window(1, inflight_fast=0.5))
        seen += [(a.action, a.level, (w.now - idle_from).total_seconds()) for a in actions(d, backend=SLOW)]
        if not w.of(SLOW):
            break
    kinds = [(a, lvl) for a, lvl, _ in seen]
    assert kinds == [(Action.SLEEP, 1), (Action.SLEEP, 2), (Action.DRAIN, 0), (Action.DELETE, 0)]
    idle_at = [t for _, _, t in seen]
    assert 300 <= idle_at[0] < 302 and 900 <= idle_at[1] < 902 and 1800 <= idle_at[2] < 1802

    w = fast_only()
    w.put("s1", SLOW, last_active_at=w.now)
    w.run(950, step=5, inflight_fast=0.5)
    assert w.of(SLOW)[0].state is S.SLEEP_2
    w.run(4, inflight_fast=4.0)
    wakes = [a for d in w.decisions for a in actions(d, backend=SLOW) if a.action in (Action.WAKE, Action.START)]
    assert [(a.action, a.instance_id) for a in wakes] == [(Action.WAKE, "s1")]


def test_fast_only_goes_cold_after_idling_with_min_replicas_zero_only():
    w = fast_only()
    idle_from = w.now
    d = until_switch(w, 400)
    assert d.routing.to_state is R.COLD and "min_replicas 0" in d.routing.reason
    assert w.now - idle_from == timedelta(seconds=300)
    w.run(6)
    assert not w.instances  # drained, then deleted

    w = World(config=alias_config(fast=(1, 2)))
    w.at(R.FAST_ONLY)
    w.put("f1", FAST)
    assert all(d.routing is None for d in w.run(600))


# --------------------------------------------------------------------------- DEGRADED_FAST


def test_vllm_failing_to_start_degrades_and_the_retry_window_warms_again():
    w = warming()
    w.fail_starts.add(SLOW)
    d = until_switch(w, 60, inflight_fast=3.0)
    assert d.routing.to_state is R.DEGRADED_FAST and "failed" in d.routing.reason
    assert actions(d, Action.DELETE, SLOW)  # the failed instance is released
    w.fail_starts.clear()
    assert all(d.routing is None for d in w.run(116, inflight_fast=3.0))  # before retry_s 120
    d = w.run(4, inflight_fast=3.0)[-1]
    assert d.routing.to_state is R.WARMING_VLLM and "retry window" in d.routing.reason


def test_degraded_goes_back_to_fast_only_when_load_is_gone_at_the_retry_window():
    w = fast_only()
    w.at(R.DEGRADED_FAST)
    w.run(120, inflight_fast=0.5)
    assert w.routing is R.FAST_ONLY and "no longer calls for vLLM" in w.decisions[-1].routing.reason


def test_warm_timeout_degrades_and_cancels_the_start():
    w = warming()
    began = w.routing_since
    w.delays.start[SLOW] = 600
    d = until_switch(w, 190, inflight_fast=3.0)
    assert d.routing.to_state is R.DEGRADED_FAST and "not ready after 180 s" in d.routing.reason
    assert 180 < (w.now - began).total_seconds() <= 182  # the first tick past the timeout
    assert [(a.action, a.reason.startswith("surplus while still starting")) for a in actions(d, backend=SLOW)] == \
        [(Action.DELETE, True)]


def test_consecutive_vllm_timeouts_in_mixed_degrade():
    w = mixed()
    w.run(4, inflight_slow=1.0, timeouts_slow=2)
    assert w.routing is R.MIXED
    d = w.run(2, inflight_slow=1.0, timeouts_slow=1)[-1]
    assert d.routing.to_state is R.DEGRADED_FAST and "3 consecutive windows" in d.routing.reason


def test_vllm_unhealthy_in_vllm_primary_degrades():
    w = vllm_primary(fast=1)
    w.put("s1", SLOW, S.ERROR)
    d = w.tick(1, w.window(1, inflight_fast=1.0))
    assert d.routing.to_state is R.DEGRADED_FAST and "no healthy running instance" in d.routing.reason


def test_a_failed_start_is_not_retried_before_start_retry_s():
    w = World()
    w.start_failures[FAST] = StartFailure("a-fast-1", w.now, "no worker can host it")
    d = w.tick(1, demand=1)
    assert d.routing.to_state is R.FAST_ONLY and not actions(d, Action.START)
    assert any("last start failed" in n.what for n in d.outlook)
    assert not actions(w.tick(28, demand=1), Action.START)
    assert actions(w.tick(2, demand=1), Action.START, FAST)


# --------------------------------------------------------------------------- capability matrix, level-triggered ids


def test_a_worker_answering_unsupported_gets_the_substitute_with_the_reason_recorded():
    w = fast_only()
    w.put("s1", SLOW, last_active_at=w.now - timedelta(seconds=301))
    w.unsupported[(SLOW, Action.SLEEP)] = True
    d = w.tick(1, w.window(1))
    assert [(a.action, a.level) for a in actions(d, backend=SLOW)] == [(Action.SLEEP, 1)]
    d = w.tick(1, w.window(1))  # the worker said unsupported
    (drain,) = actions(d, backend=SLOW)
    assert drain.action is Action.DRAIN and drain.substitute_for is Action.SLEEP
    assert "worker answered unsupported for sleep" in drain.reason


@pytest.mark.parametrize("router, level, held", [
    ({"plugin": "ear", "drain_handoff_s": 5}, 0, True),
    ({"plugin": "affinity"}, 0, True),  # the default handoff time, 5 s
    ({"plugin": "ear", "drain_handoff_s": 0}, 0, False),  # no handoff asked for
    ({"plugin": "least-load", "drain_handoff_s": 5}, 0, False),  # its router binds no sessions
    ({"plugin": "ear", "drain_handoff_s": 5}, 2, False),  # drained from sleep: its KV is gone already
])
def test_a_drained_instance_is_deleted_once_its_sessions_had_their_handoff_time(router, level, held):
    w = World(config=with_hybrid(alias_config(router=router))).at(R.FAST_ONLY)
    w.put("f1", FAST)
    w.put("f2", FAST, S.DRAINING, sleep_level=level)
    d = w.tick(1, w.window(1))
    if not held:
        assert [a.instance_id for a in actions(d, Action.DELETE)] == ["f2"]
        return
    assert not actions(d, Action.DELETE)
    assert any(n.what == "delete f2 once its sessions are handed over" and n.at == T0 + timedelta(seconds=5)
               for n in d.outlook), d.outlook
    assert not actions(w.tick(3.9, w.window(1)), Action.DELETE)
    assert [a.instance_id for a in actions(w.tick(0.2, w.window(1)), Action.DELETE)] == ["f2"]


def test_commands_pending_count_and_ids_derive_from_the_decision():
    w = World()
    w.lose_commands = True  # nothing reaches a worker
    d1 = w.tick(1, demand=3)
    (start,) = actions(d1, Action.START)
    for _ in range(3):
        assert not w.tick(1, demand=3).actions  # the start is in flight: no second one
    snapshot = w.snapshot(demand=3)
    from policy import decide

    again = decide(snapshot, w.now)
    assert again == decide(snapshot, w.now)  # deterministic
    assert start.command_id != again.decision_id


def test_the_fast_buffer_is_kept_while_traffic_moves_and_reclaimed_once_vllm_is_primary():
    w = World(config=alias_config(fast=(0, 3)))
    w.at(R.MIXED, 0.2)
    w.put("f1", FAST)
    w.put("s1", SLOW)
    w.put("f2", FAST)
    w.put("f3", FAST)
    for d in w.run(44, inflight_fast=2.0, inflight_slow=8.0, e2e_p95_slow_s=1.0):
        if w.routing is R.MIXED:
            assert not actions(d, Action.DRAIN), d.targets_reason
    assert w.routing is R.VLLM_PRIMARY
    assert "kept until VLLM_PRIMARY" in w.decisions[0].targets_reason
    w.run(40, inflight_slow=10.0)  # two removals, llama_scale_down_cooldown_s (30 s) apart
    assert len(w.of(FAST)) == 1  # back to L_floor once vLLM carries the load


def test_an_alias_without_a_fast_tier_rests_its_vllm_when_idle_and_goes_cold_when_none_is_left():
    w = World(config=with_hybrid(alias_config(fast=None), down_hold_s=20, vllm_sleep_l1_idle_s=30,
                                 vllm_sleep_l2_idle_s=60, vllm_delete_idle_s=90))
    w.at(R.VLLM_PRIMARY)
    w.put("s1", SLOW, last_active_at=w.now)
    d = None
    for _ in range(100):
        d = w.run(2)[-1]
        if d.routing:
            break
    assert d.routing.to_state is R.COLD and "no vLLM instance left" in d.routing.reason
    kinds = [(a.action, a.level) for d in w.decisions for a in d.actions]
    assert kinds == [(Action.SLEEP, 1), (Action.SLEEP, 2), (Action.DRAIN, 0), (Action.DELETE, 0)]
    # Demand while it sleeps wakes it, as for any alias.
    w = World(config=alias_config(fast=None))
    w.at(R.VLLM_PRIMARY)
    w.put("s1", SLOW, S.SLEEP_1, last_active_at=w.now - timedelta(seconds=400))
    d = w.tick(1, w.window(1), demand=2)
    assert [(a.action, a.instance_id) for a in d.actions] == [(Action.WAKE, "s1")]


def test_a_start_that_never_reports_is_cancelled_past_its_budget_and_replaced():
    w = World()
    w.delays.start[FAST] = 10_000  # the worker never says how the start went
    w.tick(1, demand=1)
    w.tick(1, demand=1)
    (stuck,) = w.of(FAST, S.STARTING)
    budget = w.controller.llama_start_timeout_s
    d = w.tick(budget - (w.now - stuck.state_since).total_seconds(), w.window(1, held=1, queue_len=1.0))
    assert not actions(d, Action.DELETE)  # at the budget exactly: not yet
    d = w.tick(1, w.window(1, held=1, queue_len=1.0))
    (cancel,) = actions(d, Action.DELETE)
    assert cancel.instance_id == stuck.instance_id and "past the start budget" in cancel.reason
    d = w.tick(1, w.window(1, held=1, queue_len=1.0))  # the cancel is on its way: the tier is short of one
    (start,) = actions(d, Action.START, FAST)
    assert start.instance_id != stuck.instance_id
