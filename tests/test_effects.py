"""What a command does to an instance: one rule for the worker, the lab and the controller's test world."""

from __future__ import annotations

import pytest

from shared.contracts.backends import Action, BackendType
from shared.contracts.effects import EngineStep, command_effect, effect_of
from shared.contracts.states import IllegalTransition, InstanceState

S, FAST, SLOW = InstanceState, BackendType.LLAMA_CPP, BackendType.VLLM


@pytest.mark.parametrize(("action", "state", "level", "step", "accepted", "done"), [
    (Action.START, S.ABSENT, 0, EngineStep.SPAWN, S.STARTING, S.RUNNING),
    (Action.START, S.ERROR, 0, EngineStep.SPAWN, S.STARTING, S.RUNNING),  # a failed instance starts again
    (Action.WAKE, S.SLEEP_2, 0, EngineStep.WAKE, None, S.RUNNING),
    (Action.SLEEP, S.RUNNING, 1, EngineStep.SLEEP, None, S.SLEEP_1),
    (Action.DRAIN, S.RUNNING, 0, EngineStep.WAIT_IDLE, S.DRAINING, None),
    (Action.DELETE, S.STARTING, 0, EngineStep.STOP, S.DELETING, S.ABSENT),  # a cancelled start
    (Action.DELETE, S.DRAINING, 0, EngineStep.STOP, S.DELETING, S.ABSENT),
])
def test_each_command_records_its_states_in_order(action, state, level, step, accepted, done):
    effect = effect_of(action, SLOW, state, level)
    assert (effect.step, effect.accepted, effect.done) == (step, accepted, done)
    assert effect.first is (accepted or done)


def test_a_change_of_sleep_level_wakes_first_and_lands_on_the_new_level():
    effect = effect_of(Action.SLEEP, SLOW, S.SLEEP_1, 2)
    assert effect.wake_first and effect.done is S.SLEEP_2 and effect.sleep_level == 2
    assert not effect_of(Action.SLEEP, SLOW, S.RUNNING, 1).wake_first


@pytest.mark.parametrize(("action", "backend", "state"), [
    (Action.SLEEP, FAST, S.RUNNING),  # llama.cpp has no sleep mode
    (Action.DELETE, SLOW, S.RUNNING),  # a serving instance is drained first
    (Action.WAKE, SLOW, S.ABSENT),  # not on any worker
    (Action.START, FAST, S.RUNNING),  # already up
    (Action.DRAIN, FAST, S.STARTING),  # a start is cancelled with a delete, not drained
    (Action.SLEEP, SLOW, S.DRAINING),  # going away: no sleep
])
def test_a_command_the_state_does_not_allow_is_refused_naming_both_states(action, backend, state):
    with pytest.raises(IllegalTransition) as refused:
        effect_of(action, backend, state, 1)
    assert state.value in str(refused.value) and command_effect(action, 1).first.value in str(refused.value)


def test_commands_that_change_no_instance_and_impossible_levels_are_errors():
    with pytest.raises(ValueError, match="changes no instance"):
        command_effect(Action.STATUS)
    with pytest.raises(ValueError, match="sleep level"):
        command_effect(Action.SLEEP, 3)
