"""Pool configuration: aliases (seed 000 §12.2), the controller and the gateway.

A pool file is YAML:

    controller:              # optional; how the controller runs (ControllerConfig)
      tick_s: 1
    gateway:                 # optional; the public endpoint's limits, holds and keys (GatewayConfig)
      queue_size: 256
    aliases:
      - alias: qwen3-vl-2b
        backends:
          llama.cpp: {model_name: ..., model_path: ..., gpu_memory_gb: 6.0, min_replicas: 1, max_replicas: 4}
          vllm:      {model_name: ..., model_path: ..., gpu_memory_gb: 12.0, min_replicas: 0, max_replicas: 2,
                      max_model_len: 4096, tensor_parallel_size: 1, engine: simulator}
        router: {plugin: ear, t_hot_tokens: 2048, t_cool_s: 30}   # optional; RouterConfig
        autoscaling_policy: {name: hybrid, alpha: 0.7}             # optional; default hybrid (`policies.py`)

`shared/configuration.py` loads it: the defaults below, the file, the environment,
explicit arguments, later winning; every error names the field and where it came from.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.contracts.backends import ENGINES, Action, BackendType, EngineKind, supports
from shared.contracts.engine_flags import ENGINE_FLAGS, refused_flags
from shared.contracts.policies import LEGACY_HYBRID, AutoscalingPolicy, HybridPolicyConfig
from shared.contracts.states import RoutingState


class ConfigError(ValueError):
    """A configuration problem, naming the offending field and where it came from."""

    def __init__(self, field: str, message: str, source: str | None = None) -> None:
        self.field = field
        self.message = message
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
    standby_replicas: int = Field(default=0, ge=0)
    """Instances kept provisioned while load wants fewer awake: started ahead of the first request when the tier
    has fewer, put to sleep when idle (no deeper than `standby_sleep_level`), never deleted for idleness, and
    woken before any new one is started. For a backend that sleeps (vLLM) under a policy whose ladder sleeps
    (hybrid); 0: seed 000's ladder alone, which deletes an idle vLLM after `vllm_delete_idle_s`."""
    standby_sleep_level: Literal[1, 2] = 1
    """How deep standby instances sleep: 1 keeps the weights in CPU RAM (the faster wake), 2 drops them (the wake
    reloads them)."""
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
        if self.standby_replicas > self.max_replicas:
            raise ValueError(f"standby_replicas ({self.standby_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


RouterPlugin = Literal["round-robin", "least-load", "kv-aware", "sticky", "affinity", "ear"]
RouterFilter = Literal["has-room", "session-hash", "session-host", "session-host-or-move"]
"""Filters by name (`routing/registry.py`): the first leaves instances below their capacity (always applied, last
when not listed); the others keep a session's turns together, by hash, on its host, or on its host unless hot."""
RouterScorer = Literal["least-pending-prefill", "least-inflight", "prefix-hit", "next-in-turn"]
SESSION_FILTERS = ("session-hash", "session-host", "session-host-or-move")
BINDING_FILTERS = ("session-host", "session-host-or-move")
"""The session filters that bind a session to its host in the log (hashing needs no binding)."""
BINDING_PLUGINS = ("affinity", "ear")
"""The presets whose filters include a binding one (`routing/registry.py`)."""


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
    pull_prefix: bool = False
    """A request placed on an instance that holds less of its prompt than another pulls the difference over the
    engines' KV ports (with `move_kv`, where both engines can) instead of computing it again: the instances share
    what any of them holds, as one pooled prefix cache (a KV connector's shared store on vLLM). The router then
    sees every instance that can pull as holding what the best holder does."""
    recompute_budget: float | None = Field(default=0.02, ge=0, le=1)
    """EAR: the share of the prefix-cache hits its placements expect that moves may spend recomputing sessions'
    contexts where their KV cannot move along (vLLM): EAR keeps at least 1 - this of the hits affinity would.
    None: moves recompute whatever they save more wait than."""
    kv_move_timeout_s: float = Field(default=10.0, gt=0)
    """EAR: a KV move that takes longer is abandoned, and the new host recomputes."""
    drain_handoff_s: float = Field(default=5.0, ge=0)
    """Routers that bind sessions: an instance drained (for scale-down or by an operator) hands its sessions over
    to the instances that serve them next within this long, their KV moved first where both engines can; the
    controller deletes it only then. 0: no handoff (each session is placed anew at its next turn, recomputed)."""

    @property
    def binds_sessions(self) -> bool:
        """Its filters bind each session to a host in the log (affinity, EAR, or custom filters that do)."""
        if self.filters is not None:
            return any(f in BINDING_FILTERS for f in self.filters)
        return self.plugin in BINDING_PLUGINS

    @model_validator(mode="after")
    def _one_way_to_keep_sessions(self) -> "RouterConfig":
        kept = [f for f in self.filters or () if f in SESSION_FILTERS]
        if len(kept) > 1:
            raise ValueError(f"filters: at most one of {', '.join(SESSION_FILTERS)} (got {', '.join(kept)})")
        if self.filters is not None and len(set(self.filters)) != len(self.filters):
            raise ValueError("filters: a filter is listed twice")
        return self


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
        for backend, config in backends.items():
            if config.engine is not None and config.engine not in ENGINES[backend]:
                runs = ", ".join(sorted(e.value for e in ENGINES[backend]))
                raise ValueError(f"engine {config.engine.value} cannot run the {backend.value} backend (it runs: {runs})")
        return backends

    @model_validator(mode="after")
    def _standby_sleeps(self) -> "AliasConfig":
        for backend, config in self.backends.items():
            if not config.standby_replicas:
                continue
            if not supports(backend, Action.SLEEP):
                raise ValueError(f"{backend.value}: standby_replicas needs a backend that sleeps (use min_replicas "
                                 f"to keep {backend.value} instances up)")
            if not isinstance(self.autoscaling_policy, HybridPolicyConfig):
                raise ValueError(f"{backend.value}: standby_replicas needs the hybrid policy (the "
                                 f"{self.autoscaling_policy.name} policy deletes surplus instances without sleep)")
        return self

    @model_validator(mode="after")
    def _scaled_backend(self) -> "AliasConfig":
        chosen = getattr(self.autoscaling_policy, "backend", None)
        if chosen is not None and chosen not in self.backends:
            raise ValueError(f"autoscaling_policy.backend {chosen.value} is not one of the alias's backends")
        return self

    def engine_for(self, backend: BackendType) -> EngineKind:
        configured = self.backends[backend].engine
        return configured or EngineKind(backend.value)


GATEWAY_ENVIRONMENT = {
    "queue_size": "MODELPOOL_QUEUE_SIZE",
    "queue_timeout_s": "MODELPOOL_QUEUE_TIMEOUT_S",
    "hold_timeout_s": "MODELPOOL_HOLD_TIMEOUT_S",
    "hold_keepalive_s": "MODELPOOL_HOLD_KEEPALIVE_S",
    "metric_window_s": "MODELPOOL_METRIC_WINDOW_S",
    "max_body_bytes": "MODELPOOL_MAX_BODY_BYTES",
    "connect_timeout_s": "MODELPOOL_UPSTREAM_CONNECT_TIMEOUT_S",
    "read_timeout_s": "MODELPOOL_UPSTREAM_READ_TIMEOUT_S",
    "first_byte_timeout_s": "MODELPOOL_UPSTREAM_FIRST_BYTE_TIMEOUT_S",
    "api_keys": "MODELPOOL_API_KEYS",
    "api_keys_file": "MODELPOOL_API_KEYS_FILE",
    "sessions_per_minute": "MODELPOOL_SESSIONS_PER_MINUTE",
    "max_connections": "MODELPOOL_MAX_CONNECTIONS",
    "header_timeout_s": "MODELPOOL_HEADER_TIMEOUT_S",
    "body_timeout_s": "MODELPOOL_BODY_TIMEOUT_S",
}


Priority = Literal["low", "normal", "high"]


class TenantKey(BaseModel):
    """An API key with the tenant it serves and its limits (docs/tenancy.md): the tenant's weight in the fair share
    of a saturated alias, its priority class in the alias's queue, and what the key may use per minute and at once.
    A limit left out is no limit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(min_length=1)
    tenant: str = Field(min_length=1, max_length=64)
    weight: float = Field(default=1.0, gt=0)
    priority: Priority = "normal"
    rpm: int | None = Field(default=None, ge=1)
    """Requests per minute, over a sliding minute."""
    tpm: int | None = Field(default=None, ge=1)
    """Tokens per minute, prompt and completion, charged as they are consumed."""
    max_concurrent: int | None = Field(default=None, ge=1)
    """Requests of the key under way at once (waiting or served)."""
    aliases: tuple[str, ...] = ()
    """The aliases the key may use; none listed: every alias."""
    sessions_per_minute: int | None = Field(default=None, ge=0)
    """New sessions the key may bind per minute (each is a write to the log); unset: the gateway's
    `sessions_per_minute`."""

    @field_validator("key")
    @classmethod
    def _plain_key(cls, key: str) -> str:
        if any(c.isspace() for c in key):
            raise ValueError("a key must be without whitespace")
        return key

    @field_validator("aliases", mode="before")
    @classmethod
    def _split_aliases(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(alias for alias in value.split(",") if alias)
        return value

    def __repr__(self) -> str:  # never the key itself
        return f"TenantKey(id={key_id(self.key)!r}, tenant={self.tenant!r})"


def key_id(key: str) -> str:
    """A key's name where the key itself must not appear (logs, metrics, the usage shared between gateways)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def anonymous_tenant(key: str) -> str:
    """The tenant of a key listed without one: named after the key's id."""
    return key_id(key)


KEY_FIELDS = ("tenant", "weight", "priority", "rpm", "tpm", "max_concurrent", "aliases", "sessions_per_minute")


def parse_key_line(line: str, where: str) -> TenantKey | None:
    """One line of a keys file: `KEY`, or `KEY tenant=NAME weight=W priority=low|normal|high rpm=N tpm=N
    max_concurrent=N aliases=A,B sessions_per_minute=N` (any of them); None for a blank or comment line."""
    words = line.split("#", 1)[0].split()
    if not words:
        return None
    key, fields = words[0], {}
    for word in words[1:]:
        name, sep, value = word.partition("=")
        if not sep or name not in KEY_FIELDS:
            raise ConfigError("gateway.api_keys_file", f"{where}: {word!r} is not one of {', '.join(KEY_FIELDS)} "
                                                       "as NAME=VALUE")
        fields[name] = value
    try:
        return TenantKey(key=key, **{"tenant": anonymous_tenant(key), **fields})
    except ValidationError as exc:
        error = exc.errors()[0]
        raise ConfigError("gateway.api_keys_file", f"{where}: {'.'.join(map(str, error['loc']))}: {error['msg']}") from None


class GatewayConfig(BaseModel):
    """The public endpoint's admission limits, holds, timeouts, windows and keys (the pool file's `gateway:`).

    Each field is also read from its environment variable (`GATEWAY_ENVIRONMENT`),
    which wins over the file; `MODELPOOL_API_KEYS` is comma-separated.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    queue_size: int = Field(default=256, ge=0)
    """Requests of one alias that may wait for an instance; one more is refused with 429 (seed 003's 256)."""
    queue_timeout_s: float = Field(default=60.0, gt=0)
    """Longest a request waits for a free slot of a running instance before a 408 (seed 003's 60 s)."""
    hold_timeout_s: float = Field(default=120.0, gt=0)
    """Longest a request waits for a cold alias to start; the alias's measured start time sets it below this."""
    hold_keepalive_s: float = Field(default=5.0, gt=0)
    """How often a held stream gets an SSE comment, so clients and proxies keep the connection."""
    metric_window_s: float = Field(default=2.0, gt=0)
    """Length of the gateway's metric windows (seed 000 §6)."""
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
    """Keys the public endpoint accepts as `Authorization: Bearer <key>`, each its own tenant; none (and no
    `tenant_keys`, no file): the endpoint is open, to one tenant."""
    api_keys_file: str | None = None
    """A file of further keys, one per line, each optionally with its tenant, weight and priority
    (`KEY tenant=team-a weight=2 priority=high`; `#` starts a comment)."""
    tenant_keys: tuple[TenantKey, ...] = ()
    """Keys with their tenants, weights, priorities and limits (`{key, tenant, weight, priority, rpm, tpm,
    max_concurrent, aliases, sessions_per_minute}`)."""
    queue_order: Literal["fair", "fifo"] = "fair"
    """The order a saturated alias's waiters are served in: priority classes, then token-fair shares between
    tenants (`routing/fairness.py`), or arrival order alone."""
    priority_aging_s: float = Field(default=10.0, gt=0)
    """Every this long a request waits raises it one priority class: no class waits forever behind another."""
    sessions_per_minute: int = Field(default=300, ge=0)
    """New sessions each key (or the open endpoint) may bind per minute, unless its key says otherwise: a binding
    is a write to the log, so a flood of new session ids must not grow it without bound. Past it, a request is
    served, its session just not bound (its next request is placed anew)."""
    max_connections: int = Field(default=4096, ge=1)
    """Client connections the public endpoint keeps open at once; past it, a new one is answered 503 at once."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A client that has not sent a request's headers whole this long after connecting (or after its last
    answer) is disconnected."""
    body_timeout_s: float = Field(default=30.0, gt=0)
    """A request body not received whole this long after its headers is refused with 408."""

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

    def keys(self) -> dict[str, TenantKey]:
        """Every accepted key with its tenant: the listed ones, the file's (read now, so a changed file is read at
        start) and `tenant_keys`, later ones winning."""
        keys = {key: TenantKey(key=key, tenant=anonymous_tenant(key)) for key in self.api_keys}
        if self.api_keys_file:
            try:
                lines = Path(self.api_keys_file).read_text().splitlines()
            except OSError as exc:
                raise ConfigError("gateway.api_keys_file", f"cannot read {self.api_keys_file}: {exc.strerror}") from exc
            for number, line in enumerate(lines, 1):
                if (parsed := parse_key_line(line, f"{self.api_keys_file}:{number}")) is not None:
                    keys[parsed.key] = parsed
        keys.update((k.key, k) for k in self.tenant_keys)
        return keys


CONTROLLER_ENVIRONMENT = {
    "tick_s": "MODELPOOL_CONTROL_TICK_S",
    "worker_timeout_s": "MODELPOOL_WORKER_TIMEOUT_S",
    "start_retry_s": "MODELPOOL_START_RETRY_S",
    "command_retry_s": "MODELPOOL_COMMAND_RETRY_S",
    "drain_timeout_s": "MODELPOOL_DRAIN_TIMEOUT_S",
    "llama_start_timeout_s": "MODELPOOL_LLAMA_START_TIMEOUT_S",
    "vllm_start_timeout_s": "MODELPOOL_VLLM_START_TIMEOUT_S",
}
LEGACY_CONTROLLER = {
    "START_RETRY_S": "start_retry_s",
    "COMMAND_RETRY_S": "command_retry_s",
    "LLAMA_DRAIN_TIMEOUT_S": "drain_timeout_s",
    "LLAMA_START_TIMEOUT_S": "llama_start_timeout_s",
    "VLLM_START_TIMEOUT_S": "vllm_start_timeout_s",
}
"""The controller's knobs by the names of the pool-wide `policy:` section (and environment) they once had."""


def split_legacy_policy(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """A pool-wide `policy:` section by its old names: the hybrid's parameters, the controller's, and names neither
    knows."""
    hybrid, controller, unknown = {}, {}, []
    for name, value in values.items():
        if name in LEGACY_HYBRID:
            hybrid[LEGACY_HYBRID[name]] = value
        elif name in LEGACY_CONTROLLER:
            controller[LEGACY_CONTROLLER[name]] = value
        else:
            unknown.append(name)
    return hybrid, controller, unknown


class ControllerConfig(BaseModel):
    """How the controller runs, for every alias whatever its policy (the pool file's `controller:` section).

    Each field is also read from its environment variable (`CONTROLLER_ENVIRONMENT`), which wins over the file.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tick_s: float = Field(default=1.0, gt=0)
    """How often the autoscaler decides for every alias (demand on a cold alias does not wait for it)."""
    worker_timeout_s: float = Field(default=10.0, gt=0)
    """A worker silent this long is recorded as lost."""
    start_retry_s: float = Field(default=30, ge=0)
    """After a start of a tier failed (placement or engine), no new start of it for this long."""
    command_retry_s: float = Field(default=10, ge=0)
    """After a command failed on an instance, the same command is not sent to it again for this long."""
    drain_timeout_s: float = Field(default=120, gt=0)
    """Longest a drain waits for an instance's requests (seed 000 §11's LLAMA_DRAIN_TIMEOUT_S)."""
    llama_start_timeout_s: float = Field(default=240, gt=0)
    """A llama.cpp instance STARTING longer than this is cancelled and replaced: its worker failed to say how
    the start went (longer than the worker's own health timeout, 180 s, so a live worker reports first)."""
    vllm_start_timeout_s: float = Field(default=600, gt=0)
    """The same for vLLM, whose starts load large weights."""

    def start_timeout_s(self, backend: BackendType) -> float:
        return self.vllm_start_timeout_s if backend is BackendType.VLLM else self.llama_start_timeout_s


class PoolConfig(BaseModel):
    """A pool file: the controller's and the gateway's sections, and the aliases (`shared/configuration.py`
    loads it, layered and upcast)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    controller: ControllerConfig = ControllerConfig()
    gateway: GatewayConfig = GatewayConfig()
    aliases: list[AliasConfig] = Field(default_factory=list)

    @field_validator("aliases")
    @classmethod
    def _unique(cls, aliases: list[AliasConfig]) -> list[AliasConfig]:
        names = [a.alias for a in aliases]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"alias names must be unique, repeated: {', '.join(duplicates)}")
        for alias in aliases:  # checked in the pool file, not in the recorded AliasConfig: old logs stay readable
            for backend, config in alias.backends.items():
                engine = alias.engine_for(backend)
                if refused := refused_flags(engine, config.engine_args):
                    raise ValueError(
                        f"{alias.alias}: backends.{backend.value}.engine_args.{refused[0]}: not a flag a pool file "
                        f"may give {engine.value} (its address, name and model are the worker's to set, and flags "
                        f"that load code or files are refused; allowed: {', '.join(sorted(ENGINE_FLAGS[engine]))})")
        return aliases

    def alias(self, name: str) -> AliasConfig:
        for alias in self.aliases:
            if alias.alias == name:
                return alias
        raise KeyError(name)
