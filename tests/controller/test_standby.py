"""Standby: a backend's `standby_replicas` kept provisioned, asleep while no load asks for them (policy/reconcile.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pydantic import ValidationError
from world import FAST, SLOW, R, S, World, alias_config, with_hybrid

from shared.contracts.backends import Action
from shared.contracts.config import AliasConfig

LADDER = {"down_hold_s": 20, "vllm_sleep_l1_idle_s": 30, "vllm_sleep_l2_idle_s": 60, "vllm_delete_idle_s": 90}


def standby(config: AliasConfig, n: int = 1, level: int = 1) -> AliasConfig:
    vllm = config.backends[SLOW].model_copy(update={"standby_replicas": n, "standby_sleep_level": level})
    return config.model_copy(update={"backends": {**config.backends, SLOW: vllm}})


def pure_vllm(n: int = 1, level: int = 1, max_replicas: int = 1) -> World:
    return World(config=standby(with_hybrid(alias_config(fast=None, slow=(0, max_replicas)), **LADDER), n, level))


def sent(w: World) -> list[tuple[Action, int]]:
    return [(a.action, a.level) for d in w.decisions for a in d.actions]


@pytest.mark.parametrize("level", [1, 2])
def test_a_cold_alias_starts_its_standby_lets_it_sleep_to_its_level_and_never_deletes_it(level: int) -> None:
    w = pure_vllm(level=level)
    d = w.tick(1)
    (start,) = d.actions
    assert start.action is Action.START and "standby" in start.reason
    w.run(3600, step=5)  # an hour without a request: past every rung of the ladder
    assert w.routing is R.COLD
    # Started once, never cancelled while starting (the COLD target is 0), slept down to its level and kept there.
    assert sent(w) == [(Action.START, 0), *((Action.SLEEP, n) for n in range(1, level + 1))]
    (kept,) = w.of(SLOW)
    assert kept.state is (S.SLEEP_1 if level == 1 else S.SLEEP_2)
    assert all("drain and delete" not in step.what for step in w.decisions[-1].outlook)


def test_without_standby_the_same_idle_alias_ends_with_no_vllm() -> None:
    w = pure_vllm(n=0)
    w.at(R.VLLM_PRIMARY)
    w.put("s1", SLOW, last_active_at=w.now)
    w.run(400, step=5)
    assert not w.of(SLOW) and w.routing is R.COLD
    assert sent(w) == [(Action.SLEEP, 1), (Action.SLEEP, 2), (Action.DRAIN, 0), (Action.DELETE, 0)]


def test_demand_wakes_the_standby_instead_of_starting_one() -> None:
    w = pure_vllm(level=2)
    w.put("s1", SLOW, S.SLEEP_2, last_active_at=w.now - timedelta(seconds=4000))
    d = w.tick(1, w.window(1), demand=3)
    assert d.routing.to_state is R.VLLM_PRIMARY
    assert [(a.action, a.instance_id) for a in d.actions] == [(Action.WAKE, "s1")]


def test_the_surplus_beyond_the_standby_still_goes_and_the_most_recently_busy_is_kept() -> None:
    w = pure_vllm(max_replicas=2)
    w.put("old", SLOW, S.SLEEP_1, last_active_at=w.now - timedelta(seconds=500))
    w.put("recent", SLOW, S.SLEEP_1, last_active_at=w.now - timedelta(seconds=400))
    w.run(400, step=5)
    assert [i.instance_id for i in w.of(SLOW)] == ["recent"] and w.of(SLOW)[0].state is S.SLEEP_1
    assert not any(a.action is Action.START for d in w.decisions for a in d.actions)


def test_a_failed_vllm_keeps_no_standby_in_degraded_fast() -> None:
    # The hybrid lets a failed tier go outright (no sleep in its ladder): the standby does not hold it.
    w = World(config=standby(with_hybrid(alias_config(), **LADDER)))
    w.at(R.DEGRADED_FAST)
    w.put("f1", FAST)
    w.put("s1", SLOW)
    d = w.tick(1, w.window(1))
    assert [(a.action, a.instance_id) for a in d.actions if a.backend is SLOW] == [(Action.DRAIN, "s1")]


@pytest.mark.parametrize("backends, policy, message", [
    ({"llama.cpp": {"standby_replicas": 1}}, "hybrid", "needs a backend that sleeps"),
    ({"vllm": {"standby_replicas": 1}}, "utilization", "needs the hybrid policy"),
    ({"vllm": {"standby_replicas": 2}}, "hybrid", "exceeds max_replicas"),
])
def test_standby_is_refused_where_it_could_not_hold(backends: dict[str, dict[str, Any]], policy: str,
                                                    message: str) -> None:
    base = alias_config().model_dump(mode="json")
    for name, extra in backends.items():
        base["backends"][name].update(extra)
    with pytest.raises(ValidationError, match=message):
        AliasConfig.model_validate({**base, "autoscaling_policy": {"name": policy}})
