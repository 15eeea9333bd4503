"""One way to configure every part of modelpool: defaults, then a file, then the environment, then arguments.

Each part's settings are one pydantic model, a *section*: the pool file's
`controller` and `gateway` and its aliases (`shared/contracts/config.py`), a
process's `Settings` (`shared/settings.py`), each engine's settings, the
simulator's. `layered` builds any section from its layers, later winning, and
an error names the field and the layer it came from: the file, the variable,
the arguments. A section's environment names are its prefix and the field in
capitals (`MODELPOOL_LLAMACPP_N_SEQ_MAX`), or its own table where the names are
older than that rule (`GATEWAY_ENVIRONMENT`).

`load_pool_config` reads a pool file this way, and upcasts pool files written
before the hybrid policy's parameters moved into each alias: their pool-wide
`policy:` section (and `HYBRID_*`-style variables) fill in every hybrid alias's
`autoscaling_policy` and the `controller:` section.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from shared.contracts.config import (
    CONTROLLER_ENVIRONMENT,
    GATEWAY_ENVIRONMENT,
    LEGACY_CONTROLLER,
    ConfigError,
    ControllerConfig,
    GatewayConfig,
    PoolConfig,
    split_legacy_policy,
)
from shared.contracts.policies import LEGACY_HYBRID

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
Layer = tuple[str, Mapping[str, Any]]
"""Where some values come from (`config/pool.yaml`, `environment variable X`, `arguments`), and the values."""


def environment_names(model: type[BaseModel], prefix: str) -> dict[str, str]:
    """Each field's variable: the prefix and the field's name in capitals."""
    return {name: prefix + name.upper() for name in model.model_fields}


def from_environment(environ: Mapping[str, str], names: Mapping[str, str]) -> list[Layer]:
    """One layer per variable that is set (an empty one is unset), so an error names the variable."""
    return [(f"environment variable {var}", {field: environ[var]}) for field, var in names.items() if environ.get(var)]


def field_path(loc: Sequence[Any]) -> str:
    """`aliases[0].backends` style path for a pydantic error location."""
    parts: list[str] = []
    for item in loc:
        parts.append(f"[{item}]" if isinstance(item, int) else ("." if parts else "") + str(item))
    return "".join(parts) or "<root>"


def config_error(exc: ValidationError, source: str | None, section: str = "") -> ConfigError:
    error = exc.errors()[0]
    field = field_path([*([section] if section else []), *error["loc"]])
    message = "required field is missing" if error["type"] == "missing" else error["msg"]
    return ConfigError(field, message, source)


def _merged(under: Any, over: Any) -> Any:
    if isinstance(under, dict) and isinstance(over, Mapping):
        return {**under, **{k: _merged(under.get(k), v) for k, v in over.items()}}
    return over


def layered(model: type[M], layers: Sequence[Layer], section: str = "") -> M:
    """`model` from its defaults and `layers`, later winning, nested sections merged key by key (a None value sets
    nothing); a `ConfigError` naming the field (within `section`) and the layer its bad value came from."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, layer in layers:
        for name, value in layer.items():
            if value is not None:
                values[name] = _merged(values.get(name), value)
                origin[name] = source
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]
        raise config_error(exc, origin.get(str(loc[0])) if loc else None, section) from None


def read_yaml(path: str | Path, expected: str = "a mapping with `aliases` (and optionally `controller` and `gateway`)"
              ) -> dict[str, Any]:
    """A YAML file that holds a mapping (an empty file: an empty one)."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError("<file>", f"cannot read: {exc.strerror}", source) from exc
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"not valid YAML: {exc}", source) from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError("<root>", f"must be {expected}", source)
    return loaded


def _mapping(data: Mapping[str, Any], key: str, source: str | None) -> dict[str, Any]:
    section = data.get(key)
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(key, "must be a mapping", source)
    return section


def _legacy(values: Mapping[str, Any], source: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pool-wide `policy:` section split into the hybrid's parameters and the controller's."""
    hybrid, controller, unknown = split_legacy_policy(values)
    if unknown:
        raise ConfigError(f"policy.{unknown[0]}", "not a setting of the hybrid policy or the controller", source)
    return hybrid, controller


def _with_hybrid(alias: Any, under: Mapping[str, Any], over: Mapping[str, Any]) -> Any:
    """An alias's entry with pool-wide hybrid parameters under (file) and over (environment) its own."""
    if not isinstance(alias, dict) or not (under or over):
        return alias
    policy = alias.get("autoscaling_policy", "hybrid")
    policy = {"name": policy} if isinstance(policy, str) else policy
    if not isinstance(policy, dict) or policy.get("name", "hybrid") != "hybrid":
        return alias  # another policy: the hybrid's parameters are not its own (a bad value is named later)
    return {**alias, "autoscaling_policy": {**under, **policy, **over}}


def load_pool_config(path: str | Path | None = None, *, environ: Mapping[str, str] | None = None,
                     controller: Mapping[str, Any] | None = None,
                     gateway: Mapping[str, Any] | None = None) -> PoolConfig:
    """The pool file at `path` (none: no aliases) over the defaults, the environment over it, then `controller` and
    `gateway` arguments; a pool-wide `policy:` section of an older file is carried into its new places."""
    return pool_config(read_yaml(path) if path is not None else {}, source=str(path) if path is not None else None,
                       environ=environ, controller=controller, gateway=gateway)


def pool_config(data: Mapping[str, Any], *, source: str | None = None, environ: Mapping[str, str] | None = None,
                controller: Mapping[str, Any] | None = None, gateway: Mapping[str, Any] | None = None) -> PoolConfig:
    """A pool file's contents (`source` names it in errors), layered and upcast as `load_pool_config` does."""
    environ = os.environ if environ is None else environ
    legacy_file = _mapping(data, "policy", source)
    hybrid_file, controller_file = _legacy(legacy_file, source)
    hybrid_env = {field: environ[name] for name, field in LEGACY_HYBRID.items() if environ.get(name)}
    controller_env = from_environment(environ, {field: name for name, field in LEGACY_CONTROLLER.items()})
    if legacy_file or hybrid_env or controller_env:
        log.warning("%s: a pool-wide `policy:` section (or HYBRID_*-style variables) is read as each hybrid alias's "
                    "autoscaling_policy and the controller: section; write them there", source or "pool")
    controller_config = layered(ControllerConfig, [
        (f"{source} (policy:)", controller_file), (source or "<defaults>", _mapping(data, "controller", source)),
        *controller_env, *from_environment(environ, CONTROLLER_ENVIRONMENT), ("arguments", controller or {})], section="controller")
    gateway_config = layered(GatewayConfig, [
        (source or "<defaults>", _mapping(data, "gateway", source)), *from_environment(environ, GATEWAY_ENVIRONMENT),
        ("arguments", gateway or {})], section="gateway")
    aliases = data.get("aliases", [])
    if isinstance(aliases, list):
        aliases = [_with_hybrid(alias, hybrid_file, hybrid_env) for alias in aliases]
    rest = {k: v for k, v in data.items() if k not in ("policy", "controller", "gateway", "aliases")}
    try:
        return PoolConfig.model_validate({**rest, "controller": controller_config, "gateway": gateway_config,
                                          "aliases": aliases})
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]
        param = str(loc[-1]) if loc else ""
        from_env = len(loc) > 2 and loc[0] == "aliases" and loc[2] == "autoscaling_policy" and param in hybrid_env
        raise config_error(exc, "the environment" if from_env else source) from None
