"""Which backend a request of an alias goes to, by its routing state (seed 000 §12.4).

Fast only in FAST_ONLY / WARMING_VLLM / DEGRADED_FAST, split by the mix weight
(the share sent to vLLM) in MIXED, vLLM first with llama.cpp as the floor in
VLLM_PRIMARY; a COLD alias takes whatever comes up first. Pure: the gateway
and the policy lab's simulated gateway both ask it.
"""

from __future__ import annotations

from shared.contracts.backends import BackendType

FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM


def backend_order(state: str, mix_weight: float, draw: float) -> tuple[BackendType, ...]:
    """The backends a request may go to, in the order to try them; `draw` is uniform in [0, 1)."""
    if state in ("FAST_ONLY", "WARMING_VLLM", "DEGRADED_FAST"):
        return (FAST,)
    if state == "MIXED":
        return (SLOW, FAST) if draw < mix_weight else (FAST, SLOW)
    if state == "COLD":
        return (FAST, SLOW)
    return (SLOW, FAST)  # VLLM_PRIMARY: llama.cpp is the floor
