"""What operators ask of the controller (a pause, a pinned minimum), as the decision code honours it, and how the
log keeps it (`OperatorCommanded` folded into the alias's control row, recorded in every snapshot)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from pydantic import ValidationError
from world import FAST, SLOW, World, alias_config

from shared.contracts.backends import Action, BackendType
from shared.contracts.control import SNAPSHOT, OperatorHold
from shared.contracts.events import OperatorAction, OperatorCommanded
from shared.contracts.states import RoutingState as R
from shared.eventlog.store import StoredEvent
from shared.projections.readmodels import CONTROL, held

NOW = datetime(2026, 11, 27, 9, 0, tzinfo=timezone.utc)


def starts(world: World) -> int:
    return len([c for c in world.commands_sent if c[0] is Action.START])


def test_a_paused_alias_is_neither_switched_nor_scaled_until_it_is_resumed():
    w = World(operator=OperatorHold(paused="alice: load test until 14:00"))
    for _ in range(5):
        decision = w.tick(1, demand=8)  # requests held at the gateways: unpaused, this is a cold start
        assert decision.routing is None and decision.actions == () and decision.cold_start is None
        assert not decision.effective(w.snapshot())  # nothing changed: nothing recorded
    assert w.routing is R.COLD and starts(w) == 0
    assert decision.outlook[0].what == "nothing: the controller is paused for this alias by alice: load test until 14:00"
    w.operator = OperatorHold()
    assert w.tick(1, demand=8).routing.to_state is R.FAST_ONLY and starts(w) == 1


def test_a_paused_alias_keeps_its_instances_and_its_policy_state():
    w = World()
    w.tick(1, demand=8)
    w.run(10, step=1, arrivals=8, queue_len=8.0)
    state, routing = w.state, w.routing
    w.operator = OperatorHold(paused="bob: investigating")
    sent = len(w.commands_sent)
    w.run(120, step=2)  # two idle minutes: unpaused, the idle fast tier would be let go
    assert (w.state, w.routing, len(w.commands_sent)) == (state, routing, sent)


def test_a_pinned_minimum_replaces_the_configured_one_within_max_replicas_and_says_so():
    w = World(config=alias_config(fast=(0, 3)), operator=OperatorHold(min_replicas={FAST: 2}))
    w.at(R.FAST_ONLY)
    decision = w.tick(1)
    assert len(decision.actions) == 2 and {a.action for a in decision.actions} == {Action.START}
    assert "llama.cpp min_replicas pinned to 2 by an operator" in decision.targets_reason
    capped = World(config=alias_config(fast=(0, 3)), operator=OperatorHold(min_replicas={FAST: 9}))
    capped.at(R.FAST_ONLY)
    assert capped.tick(1).targets[FAST] == 3
    # A pin on a tier the alias does not have changes nothing.
    only_fast = World(config=alias_config(slow=None), operator=OperatorHold(min_replicas={SLOW: 1}))
    only_fast.at(R.FAST_ONLY)
    assert "pinned" not in only_fast.tick(1).targets_reason


def test_the_hold_is_recorded_in_the_snapshot_and_read_back():
    w = World(operator=OperatorHold(paused="carol: why", min_replicas={SLOW: 1}))
    recorded = SNAPSHOT.dump_python(w.snapshot(), mode="json")
    assert recorded["operator"] == {"paused": "carol: why", "min_replicas": {"vllm": 1}}
    assert SNAPSHOT.validate_python(recorded).operator == w.operator
    del recorded["operator"]  # a snapshot recorded before operators could hold an alias
    assert SNAPSHOT.validate_python(recorded).operator == OperatorHold()


def commanded(action: OperatorAction, **fields) -> OperatorCommanded:
    return OperatorCommanded(alias="a", action=action, operator="dana", reason="because", **fields)


def test_the_control_row_keeps_the_latest_pause_and_pins():
    steps = [commanded(OperatorAction.PAUSE), commanded(OperatorAction.PIN, backend_type=FAST, min_replicas=2),
             commanded(OperatorAction.PIN, backend_type=SLOW, min_replicas=1),
             commanded(OperatorAction.DRAIN, instance_id="a-fast-1"),  # an instance action holds nothing
             commanded(OperatorAction.UNPIN, backend_type=FAST), commanded(OperatorAction.RESUME)]
    hold, seen = OperatorHold(), []
    for event in steps:
        hold = held(hold, event)
        seen.append(hold)
    assert seen[0] == OperatorHold("dana: because") and seen[2].min_replicas == {FAST: 2, SLOW: 1}
    assert seen[3] == seen[2] and seen[4] == OperatorHold("dana: because", {SLOW: 1})
    assert seen[5] == OperatorHold(None, {SLOW: 1})
    rows: dict = {}
    for position, event in enumerate(steps, 1):
        CONTROL.apply(rows, StoredEvent(position, NOW, event))
    assert rows["a"].operator == OperatorHold(None, {SLOW: 1}) and rows["a"].version == len(steps)


@pytest.mark.parametrize("fields", [
    {"action": OperatorAction.DRAIN}, {"action": OperatorAction.PIN, "backend_type": BackendType.VLLM},
    {"action": OperatorAction.UNPIN}, {"action": OperatorAction.PAUSE, "reason": ""},
    {"action": OperatorAction.PAUSE, "operator": ""}, {"action": OperatorAction.SLEEP, "instance_id": "i", "level": 3},
])
def test_an_incomplete_operator_command_is_refused(fields):
    with pytest.raises(ValidationError):
        OperatorCommanded(**{"alias": "a", "operator": "erin", "reason": "why", **fields})
