"""What a lab run is set up from: the pool file's alias, the lab's own settings, and `--set` overrides.

    --set autoscaling_policy=heteroscale            choose the alias's policy (seed 001's style)
    --set autoscaling_policy.pd_ratio=0.5           one of its parameters (`hybrid.alpha=0.6` the hybrid's)
    --set controller.start_retry_s=10               the controller's section
    --set lab.tick_s=5  --set workload.peak_rate=12  the lab's settings, the workload's parameters
    --set heteroscale.pd_ratio=0.5                   a parameter of one policy only (for `lab compare`)

The tiers' timing comes from the engines the alias's backends name: the
simulated engine's profile with the backend's `engine_args` (the pool's own
configuration, so the lab and the pool model the same engines), its start-up
and wake delays, batch timing `d_0 + d_1 n`, reported capacity; GPU memory is
the backend's `gpu_memory_gb` awake and the engine's residual memory asleep.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lab.instance import TierModel
from services.engines.simulated.config import EngineConfig
from shared.contracts.backends import BackendType
from shared.configuration import load_pool_config
from shared.contracts.config import AliasConfig, ConfigError, PoolConfig
from shared.contracts.policies import POLICY_NAMES


class Objective(BaseModel):
    """Seed 000 §13.4: min, averaged over metric windows (the time slice Delta), of
    beta D_t + gamma M_t - alpha y_t + eta |actions_t|."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    alpha: float = Field(default=1.0, ge=0)
    """Weight of throughput y_t (requests answered per second)."""
    beta: float = Field(default=1.0, ge=0)
    """Weight of delay D_t (mean E2E seconds of the requests answered in the window)."""
    gamma: float = Field(default=0.1, ge=0)
    """Weight of memory M_t (GB held)."""
    eta: float = Field(default=0.1, ge=0)
    """Weight of control actions (commands sent in the window)."""


class LabSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tick_s: float = Field(default=1.0, gt=0)
    """The controller decides every tick (the pool's control_tick_s)."""
    window_s: float = Field(default=2.0, gt=0)
    """Metric windows, as the gateways measure them (the pool's metric_window_s)."""
    workers: int = Field(default=16, ge=1)
    worker_gpu_memory_gb: float = Field(default=80.0, gt=0)
    worker_slots: int = Field(default=8, ge=1)
    queue_size: int = Field(default=256, ge=0)
    queue_timeout_s: float = Field(default=60.0, gt=0)
    ttft_slo_s: float = Field(default=2.0, gt=0)
    tbt_slo_s: float = Field(default=0.1, gt=0)
    """A request meets the SLO when its TTFT and its mean time between tokens are both within these."""
    drain_s: float = Field(default=600.0, ge=0)
    """After the last arrival, how long the run goes on for answers (and scale-down) before it stops."""
    objective: Objective = Objective()
    seed: int = 0


def tier_models(alias: AliasConfig) -> dict[BackendType, TierModel]:
    out = {}
    for backend, cfg in alias.backends.items():
        args = {k.replace("-", "_"): v for k, v in cfg.engine_args.items()}
        if cfg.max_model_len:
            args.setdefault("max_model_len", cfg.max_model_len)
        try:
            engine = EngineConfig.resolve(backend.value, env={}, **args)  # type: ignore[arg-type]
        except ConfigError as exc:
            raise ConfigError(f"backends.{backend.value}.engine_args.{exc.field}", exc.message) from None
        capacity = engine.max_num_seqs if backend is BackendType.LLAMA_CPP else max(1, engine.kv_tokens // engine.max_model_len)
        out[backend] = TierModel(
            startup_s=engine.startup_s, wake_l1_s=engine.wake_l1_s, wake_l2_s=engine.wake_l2_s,
            d_0=engine.d_0, d_1=engine.d_1, capacity=capacity,
            kv_tokens=engine.kv_tokens if engine.enable_prefix_caching else 0,
            memory_gb=cfg.gpu_memory_gb, sleep_memory_gb=engine.residual_gib,
            engine=f"lab model of {engine.engine_name}",
        )
    return out


def _value(text: str) -> Any:
    """A `--set` value as YAML reads it (numbers, booleans, lists), else the string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_sets(sets: Iterable[str]) -> dict[str, dict[str, Any]]:
    """`section.key=value` strings by section (`autoscaling_policy=NAME` chooses the policy)."""
    out: dict[str, dict[str, Any]] = {"autoscaling_policy": {}, "controller": {}, "lab": {}, "workload": {}, "router": {},
                                      **{name: {} for name in POLICY_NAMES}}
    for item in sets:
        if "=" not in item:
            raise ConfigError("--set", f"{item!r} is not key=value")
        key, text = item.split("=", 1)
        if key == "autoscaling_policy":
            out["autoscaling_policy"]["name"] = text
            continue
        section, _, name = key.partition(".")
        if section not in out or not name:
            raise ConfigError("--set", f"{key!r}: expected one of {', '.join(f'{s}.NAME' for s in out)}")
        out[section][name] = _value(text)
    return out


def apply_sets(pool: PoolConfig, alias_name: str | None, sets: dict[str, dict[str, Any]],
               lab: LabSettings | None = None) -> tuple[AliasConfig, PoolConfig, LabSettings]:
    """The alias (the pool's first unless named) and settings with the overrides applied; errors name the field."""
    alias = pool.alias(alias_name) if alias_name else pool.aliases[0]
    data = alias.model_dump(mode="json")
    chosen = sets.get("autoscaling_policy") or {}
    current = data.get("autoscaling_policy") or {}
    name = chosen.get("name", current.get("name", "hybrid"))
    base = current if current.get("name") == name else {}
    data["autoscaling_policy"] = {**base, **sets.get(name, {}), **chosen, "name": name}
    if sets.get("router"):
        data["router"] = {**data.get("router", {}), **sets["router"]}
    try:
        alias = AliasConfig.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(p) for p in error["loc"]]
        if loc[:1] == ["autoscaling_policy"] and len(loc) > 2:
            del loc[1]  # the union's tag (the policy's name), not a field the user wrote
        raise ConfigError(".".join(loc), error["msg"], "--set") from None
    try:
        pool = pool.model_copy(update={"controller": pool.controller.model_validate(
            {**pool.controller.model_dump(), **sets.get("controller", {})})})
        base = (lab or LabSettings()).model_dump()
        for key, value in _nested(sets.get("lab", {})).items():
            base[key] = {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        lab = LabSettings.model_validate(base)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise ConfigError(".".join(str(p) for p in error["loc"]), error["msg"], "--set") from None
    return alias, pool, lab


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """`objective.gamma: 0.1` -> `{objective: {gamma: 0.1}}`."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        if rest:
            out.setdefault(head, {})[rest] = value
        else:
            out[key] = value
    return out


def load_lab_pool(path: str | None) -> PoolConfig:
    pool = load_pool_config(path, environ={})
    if not pool.aliases:
        raise ConfigError("aliases", "the lab needs at least one alias", path)
    return pool
