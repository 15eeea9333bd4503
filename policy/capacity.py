"""The capacity formulas of seed 000 §5, as plain functions of plain numbers."""

from __future__ import annotations

import math


def c_vllm_estimate(kv_tokens: int, request_tokens: int) -> int:
    """§5.1 fallback: C_vllm = floor(T_kv / T_req), at least 1."""
    return max(1, kv_tokens // max(1, request_tokens))


def c_eff(alpha: float, c_vllm: int) -> int:
    """§5.1: C_eff = floor(alpha * C_vllm)."""
    return math.floor(alpha * c_vllm)


def c_up(alpha: float, c_vllm: int) -> int:
    """§5.1: C_up = max(1, C_eff)."""
    return max(1, c_eff(alpha, c_vllm))


def c_down(beta: float, c_vllm: int) -> int:
    """§5.1: C_down = max(1, floor(beta * C_vllm))."""
    return max(1, math.floor(beta * c_vllm))


def c_prepare(prepare_conc: int, c_up_value: int) -> int:
    """§5.2: C_prepare = min(prepare_conc, C_up), the early warm-up trigger."""
    return min(prepare_conc, c_up_value)


def l_target(l_floor: int, inflight_total: float, c_eff_value: float, c_l: int) -> int:
    """§5.4: L_target = max(L_floor, ceil(max(0, inflight_total - C_eff) / C_l))."""
    # Inflight is a time average: round away float dust so 8.0000001 requests are 8.
    excess = round(max(0.0, inflight_total - c_eff_value), 3)
    return max(l_floor, math.ceil(excess / max(1, c_l)))
