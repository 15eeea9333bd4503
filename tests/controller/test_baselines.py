"""The baselines of seed 001 (utilization, latency, periodic): each one's rule, through `decide`."""

from __future__ import annotations

from datetime import timedelta

import pytest
from world import SLOW, R, S, T0, World, alias_config

from shared.contracts.backends import Action
from shared.contracts.config import AliasConfig


def serving(policy: dict, n: int = 4, capacity: int = 10) -> World:
    w = World(config=alias_config(fast=None, slow=(0, 50), autoscaling_policy=policy), capacity={SLOW: capacity})
    w.at(R.VLLM_PRIMARY)
    for i in range(n):
        w.put(f"v{i}", SLOW)
    w.tick(0)
    return w


@pytest.mark.parametrize(("inflight", "target"), [
    (28.0, 4),   # 28/40 = 0.70: on target
    (30.0, 4),   # 0.75 / 0.7 = 1.07: within the 10 % tolerance
    (36.0, 6),   # 0.90 / 0.7 = 1.29: ceil(4 x 1.29) = 6
    (8.0, 2),    # 0.20 / 0.7 = 0.29: ceil(4 x 0.29) = 2
])
def test_utilization_is_the_hpa_rule(inflight, target):
    w = serving({"name": "utilization", "scale_in_cooldown": 0})
    d = w.tick(2, w.window(inflight_slow=inflight))
    assert d.targets[SLOW] == target, d.targets_reason


def test_utilization_counts_requests_waiting_for_a_slot():
    w = serving({"name": "utilization"})
    w.now += timedelta(seconds=4)  # a window with the instances up from its start
    w.run(2, step=2, inflight_slow=40.0, queue_len=20.0)
    assert w.decisions[-1].targets[SLOW] == 9  # 60/40 = 1.5 / 0.7 -> ceil(4 x 2.14)


def test_latency_steps_out_on_an_slo_breach_and_in_when_well_below():
    w = serving({"name": "latency", "scale_out_cooldown": 0, "scale_in_cooldown": 0})
    assert w.tick(2, w.window(ttft_p95_s=3.0, tbt_p95_s=0.05)).targets[SLOW] == 5
    w.tick(4)
    assert w.tick(2, w.window(ttft_p95_s=1.5, tbt_p95_s=0.12)).targets[SLOW] == 6  # TBT over its SLO
    w.tick(4)
    assert w.tick(2, w.window(ttft_p95_s=1.5, tbt_p95_s=0.06)).targets[SLOW] == 6  # between: hold
    assert w.tick(2, w.window(ttft_p95_s=0.5, tbt_p95_s=0.03)).targets[SLOW] == 5  # both below half


def test_latency_cooldowns_pace_it():
    w = serving({"name": "latency"})  # 60 s out, 300 s in
    w.tick(2, w.window(ttft_p95_s=3.0))
    w.tick(4)
    held = w.tick(2, w.window(ttft_p95_s=3.0))
    assert held.targets[SLOW] == 5 and "scale-up cooldown" in held.targets_reason
    w.now += timedelta(seconds=60)
    assert w.tick(0, w.window(ttft_p95_s=3.0)).targets[SLOW] == 6
    w.now += timedelta(seconds=5)
    calm = w.tick(0, w.window(ttft_p95_s=0.1, tbt_p95_s=0.01))
    assert "scale-down cooldown" in calm.targets_reason and not [a for a in calm.actions if a.action is Action.DRAIN]
    w.now += timedelta(seconds=300)
    assert [a for a in w.tick(0, w.window(ttft_p95_s=0.1)).actions if a.action is Action.DRAIN]


def test_periodic_follows_its_schedule_by_time_of_day():
    schedule = [[0, 2], [8 * 3600, 6], [20 * 3600, 3]]
    w = serving({"name": "periodic", "schedule": schedule}, n=2)
    assert T0.hour == 8 and w.decisions[-1].targets[SLOW] == 6
    w.now = T0.replace(hour=19, minute=59)
    assert w.tick(0).targets[SLOW] == 6
    w.now = T0.replace(hour=20)
    assert w.tick(0).targets[SLOW] == 3
    w.now = T0.replace(hour=23) + timedelta(hours=2)  # 01:00 the next day: the schedule wraps
    assert w.tick(0).targets[SLOW] == 2


def test_a_periodic_schedule_must_be_ordered():
    with pytest.raises(ValueError, match="strictly increasing"):
        alias_config(autoscaling_policy={"name": "periodic", "schedule": [[10, 1], [5, 2]]})


def test_a_cold_baseline_alias_starts_on_demand_and_cools_when_idle():
    w = World(config=alias_config(fast=None, slow=(0, 4), autoscaling_policy={"name": "utilization", "min_instances": 0,
                                                                             "scale_in_cooldown": 0}))
    d = w.tick(1, demand=2)
    assert d.routing.to_state is R.VLLM_PRIMARY and [a.action for a in d.actions] == [Action.START]
    w.run(60, step=2, inflight_slow=0.0)
    assert w.routing is R.COLD and not w.instances


def test_the_policy_is_chosen_per_alias_and_named_in_the_decision():
    w = serving({"name": "latency"})
    assert w.decisions[-1].policy == "latency"
    config = AliasConfig.model_validate({"alias": "b", "backends": {"vllm": {
        "model_name": "m", "model_path": "m", "gpu_memory_gb": 1}}, "autoscaling_policy": "heteroscale"})
    assert config.autoscaling_policy.name == "heteroscale" and config.autoscaling_policy.pd_ratio == 0.33
    with pytest.raises(ValueError, match="autoscaling_policy"):
        AliasConfig.model_validate({"alias": "b", "backends": {"vllm": {"model_name": "m", "model_path": "m",
                                    "gpu_memory_gb": 1}}, "autoscaling_policy": {"name": "nope"}})
    assert S.RUNNING
