"""HeteroScale (seed 001): its two worked scenarios with the seed's numbers, and each of its rules."""

from __future__ import annotations

from datetime import timedelta

import pytest
from world import SLOW, R, S, World, alias_config

from shared.contracts.backends import Action, Role
from shared.contracts.policies import HeteroScaleConfig

P, D = Role.PREFILL, Role.DECODE


def pool(prefill: int = 10, decode: int = 30, **params) -> World:
    """A disaggregated vLLM alias serving with `prefill` + `decode` instances, under HeteroScale."""
    w = World(config=alias_config(fast=None, slow=(0, 200), autoscaling_policy={"name": "heteroscale", **params}))
    w.at(R.VLLM_PRIMARY)
    for i in range(prefill):
        w.put(f"p{i:02}", SLOW, role=P)
    for i in range(decode):
        w.put(f"d{i:02}", SLOW, role=D)
    w.tick(0)  # no window yet: hold what there is
    return w


def roles_after(w: World, decision) -> dict[Role, int]:
    """The awake instances by role once the decision's commands took effect."""
    w.tick(1)
    w.tick(1)
    awake = [i for i in w.instances.values() if i.state in (S.RUNNING, S.STARTING) and i.instance_id not in w.pending]
    return {r: sum(1 for i in awake if i.role is r) for r in (P, D)}


def test_scenario_1_daily_fluctuation_10p_30d_at_2500_tps_scales_in_to_6p_18d():
    w = pool()
    d = w.tick(2, w.window(decode_tokens_per_s=2500.0, tbt_p95_s=0.05))
    assert d.roles == {P: 6, D: 18} and d.targets[SLOW] == 24
    assert "scale_in" in d.targets_reason and "ratio 24/40 = 0.60 < 0.9" in d.targets_reason
    drained = [a for a in d.actions if a.action is Action.DRAIN]
    assert sum(1 for a in drained if a.instance_id.startswith("p")) == 4
    assert sum(1 for a in drained if a.instance_id.startswith("d")) == 12
    assert not [a for a in d.actions if a.action is Action.START]
    assert roles_after(w, d) == {P: 6, D: 18}


def test_scenario_2_burst_tbt_0_15_against_slo_0_1_panics_to_12p_36d():
    w = pool()
    d = w.tick(2, w.window(decode_tokens_per_s=2500.0, tbt_p95_s=0.15))
    assert d.roles == {P: 12, D: 36}
    assert "LATENCY_PANIC: tbt=0.15s > 0.12s" in d.targets_reason
    starts = [a for a in d.actions if a.action is Action.START]
    assert [a.role for a in starts].count(P) == 2 and [a.role for a in starts].count(D) == 6
    assert all(a.instance_id.startswith(f"a-slow-{a.role.value}-") for a in starts)


def test_the_panic_comes_before_proportional_control():
    # 500 TPS alone would scale in to 1P+3D; the latency trigger wins.
    d = pool().tick(2, World().window(decode_tokens_per_s=500.0, tbt_p95_s=0.2))
    assert d.roles == {P: 12, D: 36}


def test_without_the_latency_trigger_the_burst_is_left_to_proportional_control():
    w = pool(enable_latency_trigger=False)
    d = w.tick(2, w.window(decode_tokens_per_s=2500.0, tbt_p95_s=0.5))
    assert d.roles == {P: 6, D: 18}


@pytest.mark.parametrize(("tps", "expected"), [
    (4200.0, None),   # 42 -> 10P+30D = 40 of 40: ratio 1.0, hold
    (4600.0, None),   # 11P+33D = 44 / 40 = 1.1: not above 1.1, hold
    (4900.0, (12, 36)),  # 12P+36D = 48 / 40 = 1.2 > 1.1: scale out
    (3600.0, None),   # 9P+27D = 36 / 40 = 0.9: not below 0.9, hold
    (3200.0, (8, 24)),   # 32 / 40 = 0.8 < 0.9: scale in
])
def test_thresholds(tps, expected):
    w = pool()
    d = w.tick(2, w.window(decode_tokens_per_s=tps, tbt_p95_s=0.05))
    assert d.roles == ({P: expected[0], D: expected[1]} if expected else {P: 10, D: 30})


def test_pd_ratio_and_ceil_rounding_are_parameters():
    w = pool(pd_ratio=0.5)  # 25 / (1 + 2) = 8.33 -> 8P, 8 / 0.5 -> 16D
    assert w.tick(2, w.window(decode_tokens_per_s=2500.0, tbt_p95_s=0.05)).roles == {P: 8, D: 16}
    w = pool(prefill_rounding="ceil")  # the seed's step 2: ceil(6.2) -> 7P, 7 / 0.33 -> 21D
    assert w.tick(2, w.window(decode_tokens_per_s=2500.0, tbt_p95_s=0.05)).roles == {P: 7, D: 21}


def test_scale_out_cooldown_holds_a_second_panic_for_180_s():
    w = pool()
    burst = {"decode_tokens_per_s": 4000.0, "tbt_p95_s": 0.15}
    assert w.tick(2, w.window(**burst)).roles == {P: 12, D: 36}
    for _ in range(5):
        w.tick(2, w.window(**burst))
    held = w.tick(2, w.window(**burst))
    assert "scale-up cooldown" in held.targets_reason and not [a for a in held.actions if a.action is Action.START]
    assert held.roles == {P: 12, D: 36}  # what the tier has while the cooldown lasts
    w.now += timedelta(seconds=180)
    again = w.tick(0, w.window(**burst))
    assert again.roles == {P: 15, D: 44} and [a for a in again.actions if a.action is Action.START]


def test_scale_in_waits_600_s_after_the_last_scaling():
    w = pool()
    w.tick(2, w.window(decode_tokens_per_s=4000.0, tbt_p95_s=0.15))  # panic: 12P+36D
    for _ in range(5):
        w.tick(2, w.window(decode_tokens_per_s=4000.0, tbt_p95_s=0.05))  # starts come up
    quiet = {"decode_tokens_per_s": 2500.0, "tbt_p95_s": 0.05}
    held = w.tick(2, w.window(**quiet))
    assert "scale-down cooldown" in held.targets_reason and not held.actions
    w.now += timedelta(seconds=600)
    d = w.tick(0, w.window(**quiet))
    assert d.roles == {P: 6, D: 18} and len([a for a in d.actions if a.action is Action.DRAIN]) == 24


def test_min_and_max_instances_bound_the_total_and_keep_both_roles():
    w = pool(max_instances=44)
    assert w.tick(2, w.window(decode_tokens_per_s=2500.0, tbt_p95_s=0.5)).roles == {P: 11, D: 33}
    w = pool(prefill=1, decode=3, min_instances=8)
    assert w.decisions[0].roles == {P: 2, D: 6}  # the bound applies even while it holds
    assert w.tick(2, w.window(decode_tokens_per_s=10.0, tbt_p95_s=0.01)).roles == {P: 2, D: 6}


def test_a_cold_alias_starts_one_prefill_and_one_decode_instance_on_demand():
    w = World(config=alias_config(fast=None, slow=(0, 10),
                                  autoscaling_policy={"name": "heteroscale", "min_instances": 0}))
    assert not w.tick(1).actions
    d = w.tick(1, demand=3)
    assert d.routing.to_state is R.VLLM_PRIMARY
    assert sorted(a.role for a in d.actions if a.action is Action.START) == [D, P]


def test_not_disaggregated_one_pool_sized_by_the_same_rule():
    w = World(config=alias_config(fast=None, slow=(0, 100), autoscaling_policy={"name": "heteroscale",
                                                                                 "disaggregated": False}))
    w.at(R.VLLM_PRIMARY)
    for i in range(40):
        w.put(f"i{i:02}", SLOW)
    w.tick(0)
    d = w.tick(2, w.window(decode_tokens_per_s=2500.0, tbt_p95_s=0.05))
    assert d.targets[SLOW] == 25 and not d.roles
    d = w.tick(2, w.window(decode_tokens_per_s=2500.0, tbt_p95_s=0.15))
    assert d.targets[SLOW] == 30  # the panic: 25 x 1.2


def test_parameters_keep_the_seed_names_and_defaults():
    c = HeteroScaleConfig()
    assert (c.target_decode_tps_per_instance, c.pd_ratio, c.scale_out_threshold, c.scale_in_threshold) == (100.0, 0.33, 0.1, 0.1)
    assert (c.min_instances, c.max_instances, c.enable_latency_trigger, c.tbt_slo) == (1, 100, True, 0.1)
    assert (c.latency_panic_threshold, c.latency_panic_scale_factor) == (1.2, 1.2)
    assert (c.scale_out_cooldown, c.scale_in_cooldown) == (180.0, 600.0)
