"""What a worker starts: only what an alias's recorded configuration says, with flags its engine may be given.

Commands arrive over the bus; the log is the record of what the pool was configured to run. A
`StartInstance` that names an alias the log does not know, another model file, engine or engine flags
than the alias's backend is configured with, or a flag outside its engine's allow-list
(`shared/contracts/engine_flags.py`) is refused, and the refusal recorded with its reason: whoever can
publish on the bus can start only what the pool file already allows.
"""

from __future__ import annotations

from shared.contracts.commands import StartInstance
from shared.contracts.config import AliasConfig
from shared.contracts.engine_flags import refused_flags


def start_refusal(cmd: StartInstance, config: AliasConfig | None) -> str | None:
    """Why the worker must not run `cmd`, given its alias's latest recorded configuration; None when it may."""
    if config is None:
        return f"alias {cmd.alias} is not configured in the log"
    backend = config.backends.get(cmd.backend_type)
    if backend is None:
        return f"alias {cmd.alias} has no {cmd.backend_type.value} backend configured"
    engine = config.engine_for(cmd.backend_type)
    checks = (("engine", cmd.engine.value, engine.value), ("model_path", cmd.model_path, backend.model_path),
              ("model_name", cmd.model_name, backend.model_name), ("engine_args", cmd.engine_args, backend.engine_args))
    for field, asked, configured in checks:
        if asked != configured:
            return (f"{field} {asked!r} is not the one alias {cmd.alias}'s {cmd.backend_type.value} backend is "
                    f"configured with ({configured!r})")
    if refused := refused_flags(engine, cmd.engine_args):
        return f"engine flag {refused[0]!r} may not be given to {engine.value}"
    return None
