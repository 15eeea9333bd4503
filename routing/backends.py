"""Which backend a request of an alias goes to, by its routing state (seed 000 §12.4), and which of its instances.

Fast only in FAST_ONLY / WARMING_VLLM / DEGRADED_FAST, split by the mix weight
(the share sent to vLLM) in MIXED, vLLM first with llama.cpp as the floor in
VLLM_PRIMARY; a COLD alias takes whatever comes up first. Pure: the gateway
and the policy lab's simulated gateway both ask it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from shared.contracts.backends import BackendType
from shared.contracts.states import RoutingState

FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM

_FAST_ONLY = frozenset({RoutingState.FAST_ONLY, RoutingState.WARMING_VLLM, RoutingState.DEGRADED_FAST})


def backend_order(state: RoutingState, mix_weight: float, draw: float) -> tuple[BackendType, ...]:
    """The backends a request may go to, in the order to try them; `draw` is uniform in [0, 1)."""
    if state in _FAST_ONLY:
        return (FAST,)
    if state is RoutingState.MIXED:
        return (SLOW, FAST) if draw < mix_weight else (FAST, SLOW)
    if state is RoutingState.COLD:
        return (FAST, SLOW)
    return (SLOW, FAST)  # VLLM_PRIMARY: llama.cpp is the floor


T = TypeVar("T")


def taking_new(instances: Sequence[T], target: int | None, since: Callable[[T], Any]) -> list[T]:
    """The running instances of a tier that take new requests.

    All of them, unless the controller wants fewer than run (`0 < target < len`):
    then the `target` longest running ones, and the rest get nothing new, so they
    go idle and their tier's ladder lets them go (seed 000 §13.5's soft reclaim,
    for either tier). Without it load spread over every instance keeps a surplus
    one busy for ever, and a tier never shrinks while there is load. `since`
    orders them the same way in every gateway and in the lab.
    """
    if not target or target <= 0 or len(instances) <= target:
        return list(instances)
    return sorted(instances, key=since)[:target]
