"""Routing states (per alias) and instance states, with their allowed transitions.

Seed 000 §4 is the authority. The transition tables live here and nowhere else:
every writer of an instance or routing state change goes through
`check_instance_transition` / `check_routing_transition`.
"""

from __future__ import annotations

from enum import Enum

from shared.contracts.backends import BackendType


class RoutingState(str, Enum):
    COLD = "COLD"  # no usable instance
    FAST_ONLY = "FAST_ONLY"  # only llama.cpp serves
    WARMING_VLLM = "WARMING_VLLM"  # llama.cpp serves; vLLM starting or waking in the background
    MIXED = "MIXED"  # both serve, split by mix_weight
    VLLM_PRIMARY = "VLLM_PRIMARY"  # vLLM carries the load; llama.cpp is the floor / buffer
    DEGRADED_FAST = "DEGRADED_FAST"  # vLLM failed; fast only until the retry window


class InstanceState(str, Enum):
    ABSENT = "ABSENT"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SLEEP_1 = "SLEEP_1"
    SLEEP_2 = "SLEEP_2"
    DRAINING = "DRAINING"
    DELETING = "DELETING"
    ERROR = "ERROR"


class IllegalTransition(ValueError):
    """A state change the lifecycle does not allow. Names both states."""

    def __init__(self, kind: str, from_state: Enum, to_state: Enum, detail: str = "") -> None:
        self.from_state = from_state
        self.to_state = to_state
        message = f"illegal {kind} transition {from_state.value} -> {to_state.value}"
        super().__init__(f"{message} ({detail})" if detail else message)


_I = InstanceState

# Seed 000 §4.2, common to every backend.
_COMMON: frozenset[tuple[InstanceState, InstanceState]] = frozenset(
    {
        (_I.ABSENT, _I.STARTING),
        (_I.STARTING, _I.RUNNING),
        (_I.RUNNING, _I.DRAINING),
        (_I.DRAINING, _I.DELETING),
        (_I.DELETING, _I.ABSENT),
        (_I.RUNNING, _I.ERROR),
        (_I.ERROR, _I.STARTING),
        # Beyond the seed's list, because the seed's own triggers need them: a start
        # can fail (§4.1 item 6, "启动失败") and an instance in ERROR must still be
        # releasable, or its resources would leak with no legal way out.
        (_I.STARTING, _I.ERROR),
        (_I.ERROR, _I.DELETING),
        # A start can be cancelled, so scale-down never waits out a long vLLM start.
        (_I.STARTING, _I.DELETING),
    }
)

# Seed 000 §4.2, vLLM only: RUNNING <-> SLEEP_1 <-> SLEEP_2, SLEEP_* -> DRAINING / DELETING.
_SLEEP: frozenset[tuple[InstanceState, InstanceState]] = frozenset(
    {
        (_I.RUNNING, _I.SLEEP_1),
        (_I.SLEEP_1, _I.RUNNING),
        (_I.SLEEP_1, _I.SLEEP_2),
        (_I.SLEEP_2, _I.SLEEP_1),
        # One wake command brings either level straight back to RUNNING: from level 2 the
        # worker wakes the weights' memory, reloads the weights (level 2 discarded them),
        # then wakes the KV cache — never a level-1 stop in between.
        (_I.SLEEP_2, _I.RUNNING),
        (_I.SLEEP_1, _I.DRAINING),
        (_I.SLEEP_2, _I.DRAINING),
        (_I.SLEEP_1, _I.DELETING),
        (_I.SLEEP_2, _I.DELETING),
    }
)

INSTANCE_TRANSITIONS: dict[BackendType, frozenset[tuple[InstanceState, InstanceState]]] = {
    BackendType.LLAMA_CPP: _COMMON,
    BackendType.VLLM: _COMMON | _SLEEP,
}


def check_instance_transition(backend: BackendType, from_state: InstanceState, to_state: InstanceState) -> None:
    """Raise `IllegalTransition` unless `backend` may go from `from_state` to `to_state`."""
    if (from_state, to_state) not in INSTANCE_TRANSITIONS[backend]:
        raise IllegalTransition("instance", from_state, to_state, f"backend {backend.value}")


def instance_transition_allowed(backend: BackendType, from_state: InstanceState, to_state: InstanceState) -> bool:
    return (from_state, to_state) in INSTANCE_TRANSITIONS[backend]


_R = RoutingState

# Seed 000 §4.1: the core transitions, plus "any state -> DEGRADED_FAST".
ROUTING_TRANSITIONS: frozenset[tuple[RoutingState, RoutingState]] = frozenset(
    {
        (_R.COLD, _R.FAST_ONLY),
        (_R.FAST_ONLY, _R.WARMING_VLLM),
        (_R.WARMING_VLLM, _R.MIXED),
        (_R.MIXED, _R.VLLM_PRIMARY),
        (_R.VLLM_PRIMARY, _R.FAST_ONLY),
        (_R.DEGRADED_FAST, _R.WARMING_VLLM),
        # Load gone entirely: the last instance is released and the alias is cold again
        # (§5.4 scale-down to min_replicas 0). Without it an idle alias could never cool.
        (_R.FAST_ONLY, _R.COLD),
        # The retry window came and load no longer asks for vLLM: the alias is plainly
        # fast again instead of reporting a degradation that is over.
        (_R.DEGRADED_FAST, _R.FAST_ONLY),
        # An alias with no fast tier: vLLM takes the first demand alone, and the alias
        # cools when its last vLLM instance is gone.
        (_R.COLD, _R.VLLM_PRIMARY),
        (_R.VLLM_PRIMARY, _R.COLD),
    }
    | {(state, _R.DEGRADED_FAST) for state in RoutingState if state is not _R.DEGRADED_FAST}
)


def check_routing_transition(from_state: RoutingState, to_state: RoutingState) -> None:
    if (from_state, to_state) not in ROUTING_TRANSITIONS:
        raise IllegalTransition("routing", from_state, to_state)
