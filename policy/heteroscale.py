"""HeteroScale (seed 001): a latency panic first, then proportional control on decode TPS with the P/D ratio.

    1. latency panic: TBT > latency_panic_threshold x tbt_slo
         -> prefill and decode each x latency_panic_scale_factor (no proportional step)
    2. proportional: I_new_total = TPS_curr / target_decode_tps_per_instance
         total_parts = 1 + 1 / pd_ratio
         prefill = I_new_total / total_parts (rounded), decode = prefill / pd_ratio (rounded)
         ratio = (prefill + decode) / I_curr
         ratio > 1 + scale_out_threshold -> scale out; ratio < 1 - scale_in_threshold -> scale in; else hold

TBT is the window's p95 time between tokens as the gateways measure it, and
TPS_curr its decode tokens per second (the whole alias's). The cooldowns
(scale_out_cooldown, scale_in_cooldown) and min/max_instances are applied by
the shared scaffolding and rules (`replicas.py`, `rules.py`).

Rounding, said once: the seed's step 2 writes a ceiling for the prefill count
but its worked scenario rounds 6.25 to 6 (2,500 TPS -> 6P+18D);
`prefill_rounding` is `nearest` by default (the scenario) and `ceil` on request.
A panic rounds up (the seed's int() would leave one instance at one).
"""

from __future__ import annotations

import math
from datetime import datetime

from policy.census import TierCensus
from policy.load import Load
from policy.replicas import Count, D, P, ReplicaPolicy, grown, nearest
from policy.text import fmt
from shared.contracts.backends import BackendType
from shared.contracts.policies import HeteroScaleConfig
from shared.contracts.control import AliasSnapshot


class HeteroScalePolicy(ReplicaPolicy[HeteroScaleConfig]):
    name = "heteroscale"
    config_type = HeteroScaleConfig

    def count(self, s: AliasSnapshot, cfg: HeteroScaleConfig, backend: BackendType, load: Load, c: TierCensus,
              now: datetime) -> Count:
        split = cfg.disaggregated
        p_curr, d_curr = (c.by_role.get(P, 0), c.by_role.get(D, 0)) if split else (0, c.supply)
        i_curr = p_curr + d_curr if split else c.supply
        current = Count(i_curr, "", {P: p_curr, D: d_curr} if split else None)
        m = s.metrics
        if m is None:
            current.reason = "no metric window yet: hold"
            return current
        tbt, tps = m.tbt_p95_s, m.decode_tokens_per_s or 0.0
        panic_at = cfg.latency_panic_threshold * cfg.tbt_slo
        if cfg.enable_latency_trigger and tbt is not None and tbt > panic_at and i_curr:
            why = f"LATENCY_PANIC: tbt={fmt(tbt)}s > {fmt(panic_at)}s"
            if not split:
                n = grown(i_curr, cfg.latency_panic_scale_factor)
                return Count(n, f"scale_out {i_curr}->{n}, {why}")
            p_new, d_new = grown(p_curr, cfg.latency_panic_scale_factor), grown(d_curr, cfg.latency_panic_scale_factor)
            return Count(p_new + d_new, f"scale_out prompt:{p_curr}->{p_new}_token:{d_curr}->{d_new}, {why}",
                         {P: p_new, D: d_new})

        needed = tps / cfg.target_decode_tps_per_instance
        if split:
            parts = 1 + 1 / cfg.pd_ratio
            share = needed / parts
            p_new = math.ceil(round(share, 9)) if cfg.prefill_rounding == "ceil" else nearest(share)
            p_new = self._within_bounds(p_new, cfg, load.busy)
            d_new = nearest(p_new / cfg.pd_ratio)
            expected, roles = p_new + d_new, {P: p_new, D: d_new}
            sizes = f"prompt:{p_curr}->{p_new}_token:{d_curr}->{d_new}"
            how = (f"total_needed {fmt(needed)} / total_parts {fmt(parts)} = {fmt(share)} -> {p_new}P, "
                   f"{p_new} / pd_ratio {fmt(cfg.pd_ratio)} -> {d_new}D")
        else:
            expected, roles = math.ceil(round(needed, 9)), None
            sizes = f"{i_curr}->{expected}"
            how = f"total_needed {fmt(needed)} -> {expected}"
        head = f"decode_tps={fmt(tps)} / {fmt(cfg.target_decode_tps_per_instance)} per instance"
        detail = f" ({how})" if cfg.debug else ""
        if i_curr == 0:
            return Count(expected, f"scale_out {sizes}, {head}: none running{detail}", roles)
        ratio = expected / i_curr
        if ratio > 1 + cfg.scale_out_threshold:
            return Count(expected, f"scale_out {sizes}, {head}: ratio {expected}/{i_curr} = {ratio:.2f} > "
                                   f"{fmt(1 + cfg.scale_out_threshold)}{detail}", roles)
        if ratio < 1 - cfg.scale_in_threshold:
            return Count(expected, f"scale_in {sizes}, {head}: ratio {expected}/{i_curr} = {ratio:.2f} < "
                                   f"{fmt(1 - cfg.scale_in_threshold)}{detail}", roles)
        current.reason = f"hold, {head}: ratio {expected}/{i_curr} = {ratio:.2f} within thresholds{detail}"
        return current

    @staticmethod
    def _within_bounds(prefill: int, cfg: HeteroScaleConfig, busy: bool) -> int:
        """The prefill count nearest `prefill` whose P + D lies within min_instances..max_instances
        (at least one of each while there is demand), so the bounds keep the P/D ratio."""
        def total(p: int) -> int:
            return p + nearest(p / cfg.pd_ratio)
        low = max(cfg.min_instances, 2 if busy else 0)
        while total(prefill) < low:
            prefill += 1
        while prefill > 1 and total(prefill) > cfg.max_instances:
            prefill -= 1
        return prefill
