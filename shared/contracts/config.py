"""Pool configuration: aliases (seed 000 §12.2) and policy defaults (seed 000 §11).

A pool file is YAML:

    policy:                  # optional; any of the HYBRID_* / LLAMA_* / VLLM_* keys
      HYBRID_ALPHA: 0.7
    gateway:                 # optional; the public endpoint's limits and keys (GatewayConfig)
      queue_size: 256
    aliases:
      - alias: qwen3-vl-2b
        backends:
          llama.cpp: {model_name: ..., model_path: ..., gpu_memory_gb: 6.0, min_replicas: 1, max_replicas: 4}
          vllm:      {model_name: ..., model_path: ..., gpu_memory_gb: 12.0, min_replicas: 0, max_replicas: 2,
                      max_model_len: 4096, tensor_parallel_size: 1, engine: simulator}
        router: {plugin: ear, t_hot_tokens: 2048, t_cool_s: 30}   # optional; RouterConfig
        autoscaling_policy: {name: heteroscale, pd_ratio: 0.5}      # optional; default hybrid

Layers, later wins: the defaults below, the file, the environment (`HYBRID_ALPHA=0.6`),
explicit arguments. Every error names the field and the file it came from.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.states import RoutingState


class ConfigError(ValueError):
    """A configuration problem, naming the offending field and where it came from."""

    def __init__(self, field: str, message: str, source: str | None = None) -> None:
        self.field = field
        self.source = source
        where = f" in {source}" if source else ""
        super().__init__(f"{field}{where}: {message}")


DEFAULT_T_HOT_TOKENS = 2048
"""EAR's T_hot, from the sweep in docs/benchmarks.md ("EAR's sensitivity"): within 2 % of the best TTFT
p90 (1024) with a third of its moves, for engines whose moved sessions recompute."""
DEFAULT_T_COOL_S = 30.0
"""EAR's T_cool, in seconds, from the same sweep: 10-90 s differ within the runs' spread, none thrashes."""

FLAG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*$")


class BackendConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_name: str
    model_path: str
    gpu_memory_gb: float = Field(ge=0)
    min_replicas: int = Field(default=0, ge=0)
    max_replicas: int = Field(default=1, ge=0)
    max_model_len: int | None = Field(default=None, ge=1)
    tensor_parallel_size: int = Field(default=1, ge=1)
    engine: EngineKind | None = None
    """What runs this backend; defaults to the real engine. `simulator` where no GPU exists."""
    engine_args: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra command-line flags for the engine, e.g. `{gpu-memory-utilization: 0.5}` for vLLM or
    `{startup-s: 10}` for the simulator: `--name value`, `--name` alone for true."""

    @field_validator("engine_args")
    @classmethod
    def _flag_names(cls, args: dict[str, Any]) -> dict[str, Any]:
        for name in args:
            if not FLAG_NAME.match(name):
                raise ValueError(f"{name!r} is not a flag name (letters, digits and '-', without the leading --)")
        return args

    @model_validator(mode="after")
    def _replica_bounds(self) -> "BackendConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


RouterPlugin = Literal["round-robin", "least-load", "kv-aware", "sticky", "affinity", "ear"]
RouterFilter = Literal["has-room", "session-hash", "session-host", "session-host-or-move"]
"""Filters by name (`routing/registry.py`): the first leaves instances below their capacity (always applied, last
when not listed); the others keep a session's turns together, by hash, on its host, or on its host unless hot."""
RouterScorer = Literal["least-pending-prefill", "least-inflight", "prefix-hit", "next-in-turn"]
SESSION_FILTERS = ("session-hash", "session-host", "session-host-or-move")


class ScorerConfig(BaseModel):
    """One scorer of a router, with its weight in the sum the picker takes the highest of."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: RouterScorer
    weight: float = Field(default=1.0, ge=0)


class RouterConfig(BaseModel):
    """How the gateway picks an instance of the alias's backend (docs/routing.md; the plugins in `routing/plugins/`).

    `plugin` names a preset: its filters and weighted scorers. `filters` and `scorers`, when given, replace the
    preset's, as llm-d's scheduling profiles list their plugins."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plugin: RouterPlugin = "least-load"
    filters: tuple[RouterFilter, ...] | None = None
    """The filters, in order, instead of the preset's."""
    scorers: tuple[ScorerConfig, ...] | None = None
    """The weighted scorers instead of the preset's (an empty list: the candidates left tie, picked at random)."""
    t_hot_tokens: int = Field(default=DEFAULT_T_HOT_TOKENS, ge=0)
    """EAR: a host with more pending prefill tokens than this is hot, and its sessions may move."""
    t_cool_s: float = Field(default=DEFAULT_T_COOL_S, ge=0)
    """EAR: a session that moved stays where it is for this long."""
    kv_weight: float = Field(default=2.0, ge=0)
    """kv-aware: the weight of the expected prefix-cache hit."""
    load_weight: float = Field(default=1.0, ge=0)
    """kv-aware: the weight of the load (pending prefill tokens)."""
    session_idle_s: float = Field(default=600.0, gt=0)
    """Routers that bind sessions release one idle this long."""
    move_kv: bool = True
    """EAR: a moved session takes its KV along where both engines can export and import it (their
    internal ports); otherwise, or when the move fails, the new host recomputes the context."""
    kv_move_timeout_s: float = Field(default=10.0, gt=0)
    """EAR: a KV move that takes longer is abandoned, and the new host recomputes."""

    @model_validator(mode="after")
    def _one_way_to_keep_sessions(self) -> "RouterConfig":
        kept = [f for f in self.filters or () if f in SESSION_FILTERS]
        if len(kept) > 1:
            raise ValueError(f"filters: at most one of {', '.join(SESSION_FILTERS)} (got {', '.join(kept)})")
        if self.filters is not None and len(set(self.filters)) != len(self.filters):
            raise ValueError("filters: a filter is listed twice")
        return self


class HybridPolicyConfig(BaseModel):
    """The hybrid fast/slow policy of seed 000; its numbers are the pool's `policy:` section (PolicySettings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Literal["hybrid"] = "hybrid"
    debug: bool = False


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


class AliasConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    alias: str = Field(min_length=1)
    routing_state: RoutingState = RoutingState.COLD
    backends: dict[BackendType, BackendConfig]
    router: RouterConfig = RouterConfig()
    autoscaling_policy: AutoscalingPolicy = HybridPolicyConfig()
    """The policy that decides this alias's routing state and replicas (`policy/`), with its parameters."""

    @field_validator("autoscaling_policy", mode="before")
    @classmethod
    def _policy_by_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value  # `autoscaling_policy: heteroscale`

    @field_validator("backends")
    @classmethod
    def _not_empty(cls, backends: dict[BackendType, BackendConfig]) -> dict[BackendType, BackendConfig]:
        if not backends:
            raise ValueError("at least one backend is required")
        return backends

    @model_validator(mode="after")
    def _scaled_backend(self) -> "AliasConfig":
        chosen = getattr(self.autoscaling_policy, "backend", None)
        if chosen is not None and chosen not in self.backends:
            raise ValueError(f"autoscaling_policy.backend {chosen.value} is not one of the alias's backends")
        return self

    def engine_for(self, backend: BackendType) -> EngineKind:
        configured = self.backends[backend].engine
        return configured or EngineKind(backend.value)


class PolicySettings(BaseModel):
    """Seed 000 §11 defaults for Qwen3-VL-2B. Field names are the environment names."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    HYBRID_ENABLE: bool = True
    HYBRID_ALPHA: float = Field(default=0.7, gt=0, le=1)
    HYBRID_BETA: float = Field(default=0.3, gt=0, le=1)
    HYBRID_UP_CONSECUTIVE: int = Field(default=2, ge=1)
    HYBRID_PREPARE_CONC: int = Field(default=3, ge=1)
    HYBRID_DOWN_HOLD_S: float = Field(default=180, ge=0)
    HYBRID_MIX_WEIGHTS: tuple[int, ...] = (20, 50, 80, 100)
    HYBRID_VLLM_WARM_TIMEOUT_S: float = Field(default=180, gt=0)
    LLAMA_FLOOR_REPLICAS: int = Field(default=1, ge=0)
    LLAMA_SCALE_DOWN_COOLDOWN_S: float = Field(default=30, ge=0)
    LLAMA_DRAIN_TIMEOUT_S: float = Field(default=120, gt=0)
    VLLM_SLEEP_L1_IDLE_S: float = Field(default=300, ge=0)
    VLLM_SLEEP_L2_IDLE_S: float = Field(default=900, ge=0)
    VLLM_DELETE_IDLE_S: float = Field(default=1800, ge=0)
    # Beyond §11: numbers the seed's rules need but do not give. Ours, documented in
    # docs/controller.md; every one overridable like the rest.
    HYBRID_QUEUE_SLA_S: float = Field(default=2.0, gt=0)
    """queue_sla of §4.1: a queue_wait_p95 above it counts toward warming vLLM."""
    HYBRID_E2E_SLA_S: float = Field(default=30.0, gt=0)
    """e2e_sla of §4.1 (fast tier); also the SLA a MIXED step must hold on vLLM to go on."""
    HYBRID_READY_PROBES: int = Field(default=2, ge=1)
    """N_ready of §4.1: consecutive healthy probes of vLLM before MIXED."""
    HYBRID_MIX_STEP_S: float = Field(default=10, ge=0)
    """Time each MIXED weight is held, healthy and within SLA, before the next step."""
    HYBRID_RETRY_S: float = Field(default=120, ge=0)
    """The retry window of DEGRADED_FAST (§4.1 item 7)."""
    HYBRID_TIMEOUT_WINDOWS: int = Field(default=3, ge=1)
    """Consecutive windows with vLLM timeouts that count as 'consecutive timeouts' (§4.1 item 6)."""
    HYBRID_COLD_IDLE_S: float = Field(default=300, ge=0)
    """An alias with min_replicas 0 everywhere goes back to COLD after this long without a request."""
    HYBRID_VLLM_KV_TOKENS: int = Field(default=160_000, ge=1)
    """T_kv of §5.1, for C_vllm = floor(T_kv / T_req) until a vLLM instance reports its capacity."""
    HYBRID_REQUEST_TOKENS: int | None = Field(default=None, ge=1)
    """T_req of §5.1; default: the vLLM backend's max_model_len (4096 without one)."""
    LLAMA_C_L: int = Field(default=1, ge=1)
    """C_l of §5.4 until a llama.cpp instance reports its capacity (its sequence slots)."""
    SCALE_UP_COOLDOWN_S: float = Field(default=0, ge=0)
    """Minimum time between two scale-ups of one tier (§13.6 SCALE_UP_COOLDOWN)."""
    SCALE_DOWN_CONSECUTIVE: int = Field(default=2, ge=1)
    """Consecutive windows asking for fewer fast replicas before one is removed (hysteresis)."""
    START_RETRY_S: float = Field(default=30, ge=0)
    """After a start of a tier failed (placement or engine), no new start of it for this long."""
    COMMAND_RETRY_S: float = Field(default=10, ge=0)
    """After a command failed on an instance, the same command is not sent to it again for this long."""
    LLAMA_START_TIMEOUT_S: float = Field(default=240, gt=0)
    """A llama.cpp instance STARTING longer than this is cancelled and replaced: its worker failed to say how
    the start went (longer than the worker's own health timeout, 180 s, so a live worker reports first)."""
    VLLM_START_TIMEOUT_S: float = Field(default=600, gt=0)
    """The same for vLLM, whose starts load large weights."""

    def start_timeout_s(self, backend: BackendType) -> float:
        return self.VLLM_START_TIMEOUT_S if backend is BackendType.VLLM else self.LLAMA_START_TIMEOUT_S

    @field_validator("HYBRID_MIX_WEIGHTS", mode="before")
    @classmethod
    def _parse_weights(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(int(part) for part in value.split(",") if part.strip())
        return value

    @field_validator("HYBRID_MIX_WEIGHTS")
    @classmethod
    def _ramp(cls, weights: tuple[int, ...]) -> tuple[int, ...]:
        if not weights or list(weights) != sorted(set(weights)) or not 0 < weights[0] or weights[-1] != 100:
            raise ValueError("must be strictly increasing percentages ending at 100, e.g. 20,50,80,100")
        return weights

    @model_validator(mode="after")
    def _idle_order(self) -> "PolicySettings":
        if not self.VLLM_SLEEP_L1_IDLE_S <= self.VLLM_SLEEP_L2_IDLE_S <= self.VLLM_DELETE_IDLE_S:
            raise ValueError("VLLM_SLEEP_L1_IDLE_S <= VLLM_SLEEP_L2_IDLE_S <= VLLM_DELETE_IDLE_S must hold")
        if self.HYBRID_BETA > self.HYBRID_ALPHA:
            raise ValueError("HYBRID_BETA (scale-down share) must not exceed HYBRID_ALPHA (scale-up share)")
        return self


GATEWAY_ENVIRONMENT = {
    "queue_size": "MODELPOOL_QUEUE_SIZE",
    "queue_timeout_s": "MODELPOOL_QUEUE_TIMEOUT_S",
    "max_body_bytes": "MODELPOOL_MAX_BODY_BYTES",
    "connect_timeout_s": "MODELPOOL_UPSTREAM_CONNECT_TIMEOUT_S",
    "read_timeout_s": "MODELPOOL_UPSTREAM_READ_TIMEOUT_S",
    "first_byte_timeout_s": "MODELPOOL_UPSTREAM_FIRST_BYTE_TIMEOUT_S",
    "api_keys": "MODELPOOL_API_KEYS",
    "api_keys_file": "MODELPOOL_API_KEYS_FILE",
}


class GatewayConfig(BaseModel):
    """The public endpoint's admission limits, timeouts and keys (the pool file's `gateway:` section).

    Each field is also read from its environment variable (`GATEWAY_ENVIRONMENT`),
    which wins over the file; `MODELPOOL_API_KEYS` is comma-separated.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    queue_size: int = Field(default=256, ge=0)
    """Requests of one alias that may wait for an instance; one more is refused with 429 (seed 003's 256)."""
    queue_timeout_s: float = Field(default=60.0, gt=0)
    """Longest a request waits for a free slot of a running instance before a 408 (seed 003's 60 s)."""
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1)
    """A larger request body is refused with 413 before it is read whole (images travel inline)."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    """An instance that does not accept a connection this fast is treated like one that refused it."""
    read_timeout_s: float = Field(default=600.0, gt=0)
    """Longest silence from an engine while it answers: between two chunks of a stream, or before a whole answer."""
    first_byte_timeout_s: float = Field(default=60.0, gt=0)
    """Longest wait for the first event of a stream (engines begin a stream at once): an instance silent this
    long is passed over and the request sent to another, as nothing of it has reached the client yet."""
    api_keys: tuple[str, ...] = ()
    """Keys the public endpoint accepts as `Authorization: Bearer <key>`; none: the endpoint is open."""
    api_keys_file: str | None = None
    """A file of further keys, one per line (`#` starts a comment)."""

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(key.strip() for key in value.split(",") if key.strip())
        return value

    @field_validator("api_keys")
    @classmethod
    def _plain_keys(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        for key in keys:
            if not key or any(c.isspace() for c in key):
                raise ValueError("a key must be non-empty and without whitespace")
        return keys

    def keys(self) -> frozenset[str]:
        """Every accepted key: the listed ones and the file's (read now, so a changed file is read at start)."""
        keys = set(self.api_keys)
        if self.api_keys_file:
            try:
                lines = Path(self.api_keys_file).read_text().splitlines()
            except OSError as exc:
                raise ConfigError("gateway.api_keys_file", f"cannot read {self.api_keys_file}: {exc.strerror}") from exc
            keys.update(line.split("#", 1)[0].strip() for line in lines)
            keys.discard("")
        return frozenset(keys)


class PoolConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: PolicySettings = PolicySettings()
    gateway: GatewayConfig = GatewayConfig()
    aliases: list[AliasConfig] = Field(default_factory=list)

    @field_validator("aliases")
    @classmethod
    def _unique(cls, aliases: list[AliasConfig]) -> list[AliasConfig]:
        names = [a.alias for a in aliases]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"alias names must be unique, repeated: {', '.join(duplicates)}")
        return aliases

    def alias(self, name: str) -> AliasConfig:
        for alias in self.aliases:
            if alias.alias == name:
                return alias
        raise KeyError(name)


def _field_path(loc: tuple[Any, ...], data: Any) -> str:
    """`aliases[0].backends` style path for a pydantic error location."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "<root>"


def _first_error(exc: ValidationError, source: str | None) -> ConfigError:
    error = exc.errors()[0]
    field = _field_path(tuple(error["loc"]), None)
    message = "required field is missing" if error["type"] == "missing" else error["msg"]
    return ConfigError(field, message, source)


def load_policy_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: environ[name] for name in PolicySettings.model_fields if name in environ}


def _layered(section: Any, later: dict[str, Any]) -> Any:
    """A file's section with later layers over it; a section that is not a mapping is left for validation to name."""
    if section is None:
        return later
    return {**section, **later} if isinstance(section, dict) else section


def load_pool_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> PoolConfig:
    """Defaults, then the YAML file, then the environment, then explicit policy overrides."""
    environ = os.environ if environ is None else environ
    source = str(path) if path is not None else None
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError("<file>", f"cannot read: {exc.strerror}", source) from exc
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("<file>", f"not valid YAML: {exc}", source) from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError("<root>", "must be a mapping with `aliases` (and optionally `policy` and `gateway`)", source)
        data = loaded
    policy = _layered(data.get("policy"), {**load_policy_env(environ), **dict(overrides or {})})
    gateway_env = {name: environ[var] for name, var in GATEWAY_ENVIRONMENT.items() if environ.get(var)}
    gateway = _layered(data.get("gateway"), gateway_env)
    try:
        return PoolConfig.model_validate({**data, "policy": policy, "gateway": gateway})
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]
        section, name = (loc[0], loc[1]) if len(loc) > 1 else (None, None)
        if section == "policy" and name in environ:
            raise _first_error(exc, "the environment") from None
        if section == "gateway" and name in gateway_env:
            raise _first_error(exc, f"environment variable {GATEWAY_ENVIRONMENT[name]}") from None
        raise _first_error(exc, source) from None
