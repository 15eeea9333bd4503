"""Each autoscaling policy's parameters: one model per policy, chosen per alias by `autoscaling_policy.name`.

The policies themselves are in `policy/`; an alias's pool-file section is
`autoscaling_policy: {name: heteroscale, pd_ratio: 0.5}` (a bare name takes the
defaults). Every parameter has its default here and a line on where it comes from.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.contracts.backends import BackendType

class HybridPolicyConfig(BaseModel):
    """The hybrid fast/slow policy of seed 000: its thresholds, windows and idle times, per alias.

    Defaults are seed 000 §11's for Qwen3-VL-2B, and below them the numbers the
    seed's rules need but do not give (ours, documented in docs/controller.md).
    Pool files from before per-alias parameters set them pool-wide in a `policy:`
    section by their environment names (`HYBRID_ALPHA`, `LLAMA_FLOOR_REPLICAS`);
    the loader carries those into every hybrid alias (`LEGACY_HYBRID`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Literal["hybrid"] = "hybrid"
    debug: bool = False
    enable: bool = True
    """Off: the alias is served by llama.cpp alone, and vLLM is never warmed."""
    alpha: float = Field(default=0.7, gt=0, le=1)
    """§4.1: the load share of the fast tier's capacity at which vLLM is warmed."""
    beta: float = Field(default=0.3, gt=0, le=1)
    """§4.1: the load share below which load goes back to the fast tier."""
    up_consecutive: int = Field(default=2, ge=1)
    prepare_conc: int = Field(default=3, ge=1)
    """§5.2: C_prepare = min(prepare_conc, C_up), the early warm-up trigger."""
    down_hold_s: float = Field(default=180, ge=0)
    mix_weights: tuple[int, ...] = (20, 50, 80, 100)
    """The MIXED ramp: percentages of traffic sent to vLLM, step by step."""
    vllm_warm_timeout_s: float = Field(default=180, gt=0)
    llama_floor_replicas: int = Field(default=1, ge=0)
    llama_scale_down_cooldown_s: float = Field(default=30, ge=0)
    vllm_sleep_l1_idle_s: float = Field(default=300, ge=0)
    vllm_sleep_l2_idle_s: float = Field(default=900, ge=0)
    vllm_delete_idle_s: float = Field(default=1800, ge=0)
    # Beyond §11: numbers the seed's rules need but do not give.
    queue_sla_s: float = Field(default=2.0, gt=0)
    """queue_sla of §4.1: a queue_wait_p95 above it counts toward warming vLLM."""
    e2e_sla_s: float = Field(default=30.0, gt=0)
    """e2e_sla of §4.1 (fast tier); also the SLA a MIXED step must hold on vLLM to go on."""
    ready_probes: int = Field(default=2, ge=1)
    """N_ready of §4.1: consecutive healthy probes of vLLM before MIXED."""
    mix_step_s: float = Field(default=10, ge=0)
    """Time each MIXED weight is held, healthy and within SLA, before the next step."""
    retry_s: float = Field(default=120, ge=0)
    """The retry window of DEGRADED_FAST (§4.1 item 7)."""
    timeout_windows: int = Field(default=3, ge=1)
    """Consecutive windows with vLLM timeouts that count as 'consecutive timeouts' (§4.1 item 6)."""
    cold_idle_s: float = Field(default=300, ge=0)
    """An alias with min_replicas 0 everywhere goes back to COLD after this long without a request."""
    vllm_kv_tokens: int = Field(default=160_000, ge=1)
    """T_kv of §5.1, for C_vllm = floor(T_kv / T_req) until a vLLM instance reports its capacity."""
    request_tokens: int | None = Field(default=None, ge=1)
    """T_req of §5.1; default: the vLLM backend's max_model_len (4096 without one)."""
    llama_c_l: int = Field(default=1, ge=1)
    """C_l of §5.4 until a llama.cpp instance reports its capacity (its sequence slots)."""
    scale_up_cooldown_s: float = Field(default=0, ge=0)
    """Minimum time between two scale-ups of one tier (§13.6 SCALE_UP_COOLDOWN)."""
    scale_down_consecutive: int = Field(default=2, ge=1)
    """Consecutive windows asking for fewer fast replicas before one is removed (hysteresis)."""

    @field_validator("mix_weights", mode="before")
    @classmethod
    def _parse_weights(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(int(part) for part in value.split(",") if part.strip())
        return value

    @field_validator("mix_weights")
    @classmethod
    def _ramp(cls, weights: tuple[int, ...]) -> tuple[int, ...]:
        if not weights or list(weights) != sorted(set(weights)) or not 0 < weights[0] or weights[-1] != 100:
            raise ValueError("must be strictly increasing percentages ending at 100, e.g. 20,50,80,100")
        return weights

    @model_validator(mode="after")
    def _orders(self) -> "HybridPolicyConfig":
        if not self.vllm_sleep_l1_idle_s <= self.vllm_sleep_l2_idle_s <= self.vllm_delete_idle_s:
            raise ValueError("vllm_sleep_l1_idle_s <= vllm_sleep_l2_idle_s <= vllm_delete_idle_s must hold")
        if self.beta > self.alpha:
            raise ValueError("beta (the scale-down share) must not exceed alpha (the scale-up share)")
        return self


class ReplicaPolicyConfig(BaseModel):
    """What every replica-count policy (HeteroScale and the baselines of seed 001) shares."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: BackendType | None = None
    """The tier it scales; default vLLM when the alias has it, else llama.cpp. Other tiers get none."""
    min_instances: int = Field(default=1, ge=0)
    max_instances: int = Field(default=100, ge=1)
    scale_out_cooldown: float = Field(default=180.0, ge=0)
    """Seconds after a scale-out before the next one."""
    scale_in_cooldown: float = Field(default=600.0, ge=0)
    """Seconds after any scaling of the tier before a scale-in."""
    debug: bool = False
    """Every decision's reason carries the whole computation, and the lab prints each decision."""

    @model_validator(mode="after")
    def _instance_bounds(self) -> "ReplicaPolicyConfig":
        if self.min_instances > self.max_instances:
            raise ValueError(f"min_instances ({self.min_instances}) exceeds max_instances ({self.max_instances})")
        return self


class HeteroScaleConfig(ReplicaPolicyConfig):
    """HeteroScale (seed 001): latency panic first, then proportional control on decode TPS with the P/D ratio.
    Names and defaults are the seed's."""

    name: Literal["heteroscale"] = "heteroscale"
    target_decode_tps_per_instance: float = Field(default=100.0, gt=0)
    pd_ratio: float = Field(default=0.33, gt=0)
    """Prefill instances per decode instance (0.33: 1:3)."""
    scale_out_threshold: float = Field(default=0.1, ge=0)
    scale_in_threshold: float = Field(default=0.1, ge=0, lt=1)
    enable_latency_trigger: bool = True
    tbt_slo: float = Field(default=0.1, gt=0)
    latency_panic_threshold: float = Field(default=1.2, gt=0)
    latency_panic_scale_factor: float = Field(default=1.2, gt=1)
    disaggregated: bool = True
    """Instances carry a prefill or a decode role; off: one pool sized by the same rule."""
    prefill_rounding: Literal["nearest", "ceil"] = "nearest"
    """How I_new_total / total_parts becomes a prefill count: the seed's worked scenario rounds 6.25 to 6
    (nearest); its step 2 writes a ceiling, which `ceil` gives."""


class UtilizationConfig(ReplicaPolicyConfig):
    """Seed 001's Utilization baseline, in the form of Kubernetes' HPA: desired = ceil(current x u / target),
    u the share of the tier's request slots in use (requests on it and waiting for it over its capacity)."""

    name: Literal["utilization"] = "utilization"
    target_utilization: float = Field(default=0.7, gt=0, le=1)
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    """No change while u / target is within 1 +- tolerance."""
    scale_out_cooldown: float = Field(default=60.0, ge=0)
    scale_in_cooldown: float = Field(default=300.0, ge=0)


class LatencyConfig(ReplicaPolicyConfig):
    """Seed 001's Latency baseline: a step controller on the p95 latencies against their SLOs."""

    name: Literal["latency"] = "latency"
    ttft_slo: float = Field(default=2.0, gt=0)
    tbt_slo: float = Field(default=0.1, gt=0)
    scale_in_below: float = Field(default=0.5, gt=0, lt=1)
    """Scale in when both p95s are below this share of their SLOs."""
    step: int = Field(default=1, ge=1)
    """Instances added or removed per decision."""
    scale_out_cooldown: float = Field(default=60.0, ge=0)
    scale_in_cooldown: float = Field(default=300.0, ge=0)


class PeriodicConfig(ReplicaPolicyConfig):
    """Seed 001's Periodic baseline: replicas by time of day (of a period), from a fixed schedule."""

    name: Literal["periodic"] = "periodic"
    period_s: float = Field(default=86_400.0, gt=0)
    schedule: tuple[tuple[float, int], ...] = ((0.0, 1),)
    """(seconds into the period, instances from then on), by time; the last entry wraps to the period's start."""
    scale_out_cooldown: float = Field(default=0.0, ge=0)
    scale_in_cooldown: float = Field(default=0.0, ge=0)

    @field_validator("schedule")
    @classmethod
    def _ordered(cls, schedule: tuple[tuple[float, int], ...]) -> tuple[tuple[float, int], ...]:
        if not schedule:
            raise ValueError("needs at least one (seconds, instances) entry")
        times = [t for t, _ in schedule]
        if times != sorted(set(times)) or times[0] < 0 or any(n < 0 for _, n in schedule):
            raise ValueError("entries must be (seconds >= 0, instances >= 0) with strictly increasing seconds")
        return schedule

    def replicas_at(self, seconds: float) -> int:
        """The schedule's instances at `seconds` (any time: taken modulo the period)."""
        offset = seconds % self.period_s
        current = self.schedule[-1][1]
        for at, n in self.schedule:
            if at > offset:
                break
            current = n
        return current


AutoscalingPolicy = Annotated[
    Union[HybridPolicyConfig, HeteroScaleConfig, UtilizationConfig, LatencyConfig, PeriodicConfig],
    Field(discriminator="name"),
]
POLICY_NAMES = ("hybrid", "heteroscale", "utilization", "latency", "periodic")


LEGACY_HYBRID: dict[str, str] = {
    **{f"HYBRID_{name.upper()}": name for name in (
        "enable", "alpha", "beta", "up_consecutive", "prepare_conc", "down_hold_s", "mix_weights", "vllm_warm_timeout_s",
        "queue_sla_s", "e2e_sla_s", "ready_probes", "mix_step_s", "retry_s", "timeout_windows", "cold_idle_s",
        "vllm_kv_tokens", "request_tokens")},
    **{name.upper(): name for name in (
        "llama_floor_replicas", "llama_scale_down_cooldown_s", "vllm_sleep_l1_idle_s", "vllm_sleep_l2_idle_s",
        "vllm_delete_idle_s", "llama_c_l", "scale_up_cooldown_s", "scale_down_consecutive")},
}
"""The hybrid's parameters by the names of the pool-wide `policy:` section (and environment) they once had."""
