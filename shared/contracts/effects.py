"""What a command does to an instance: the states its worker records, in order, and what it asks of the engine.

One rule for everyone who carries commands out: the worker (real engines, wall
time), the lab (modelled engines, virtual time) and the controller's test world
(a fake clock). Each wraps it with its own clock and engine; none decides again
which state a command leads to, or whether the instance's state allows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shared.contracts.backends import Action, BackendType
from shared.contracts.states import InstanceState, check_instance_transition

S = InstanceState


class EngineStep(str, Enum):
    SPAWN = "spawn"
    """Start the engine; done when it answers healthy."""
    WAKE = "wake"
    """`POST /wake_up` (from level 2: the weights woken, reloaded, then the KV cache woken); done when it answers."""
    SLEEP = "sleep"
    """`POST /sleep?level=n&mode=wait`; done when it answers."""
    WAIT_IDLE = "wait_idle"
    """Wait until no request is in flight (or the drain's timeout); the instance stays DRAINING for the delete."""
    STOP = "stop"
    """Stop the engine and release what it held."""


@dataclass(frozen=True, slots=True)
class CommandEffect:
    step: EngineStep
    accepted: InstanceState | None
    """Recorded as soon as the worker takes the command, before the engine acts (None: nothing is)."""
    done: InstanceState | None
    """Recorded when the engine's step is done (None: the state stays; a drain ends with its outcome only)."""
    sleep_level: int = 0
    """The instance's sleep level once done."""
    wake_first: bool = False
    """Asleep at another level: vLLM ignores `/sleep` while asleep ("already sleeping"), so it is woken first."""

    @property
    def first(self) -> InstanceState:
        """The first state the command records: the one the instance's state must allow."""
        return self.accepted or self.done  # type: ignore[return-value]  # every command records one of them


def command_effect(action: Action, level: int = 0, asleep: bool = False) -> CommandEffect:
    """What `action` does, whatever the instance's state allows (`effect_of` checks that too)."""
    match action:
        case Action.START:
            return CommandEffect(EngineStep.SPAWN, S.STARTING, S.RUNNING)
        case Action.WAKE:
            return CommandEffect(EngineStep.WAKE, None, S.RUNNING)
        case Action.SLEEP:
            if level not in (1, 2):
                raise ValueError(f"sleep level must be 1 or 2, got {level}")
            return CommandEffect(EngineStep.SLEEP, None, S.SLEEP_1 if level == 1 else S.SLEEP_2, level, wake_first=asleep)
        case Action.DRAIN:
            return CommandEffect(EngineStep.WAIT_IDLE, S.DRAINING, None)
        case Action.DELETE:
            return CommandEffect(EngineStep.STOP, S.DELETING, S.ABSENT)
    raise ValueError(f"`{action.value}` changes no instance")


def effect_of(action: Action, backend: BackendType, state: InstanceState, level: int = 0) -> CommandEffect:
    """What `action` does to an instance of `backend` in `state`; `IllegalTransition` when the state does not allow it
    (a command that arrives after its instance moved on, say: the controller decides again)."""
    effect = command_effect(action, level, asleep=state in (S.SLEEP_1, S.SLEEP_2))
    check_instance_transition(backend, state, effect.first)
    return effect
