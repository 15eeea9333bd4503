"""`modelpool autoscaler`: the only decision maker of the pool.

On start it loads the pool configuration and records each alias whose
configuration changed (AliasConfigured), so the log says what every later
decision was made under. A configuration error stops it with a message naming
the field and the file.
"""

from __future__ import annotations

import logging

from services.runtime import ServiceContext, run_service
from shared.contracts.config import PoolConfig, load_pool_config
from shared.contracts.events import AliasConfigured
from shared.contracts.messages import Envelope
from shared.projections.projector import rebuild
from shared.projections.readmodels import ROUTING

log = logging.getLogger(__name__)


async def register_aliases(ctx: ServiceContext, config: PoolConfig) -> int:
    """Record AliasConfigured for each alias whose configuration is new or changed."""
    rows, _, _ = await rebuild(ctx.store, [ROUTING])
    recorded = 0
    for alias in config.aliases:
        current = alias.model_dump(mode="json")
        if (rows[ROUTING.name].get(alias.alias) or {}).get("config") != current:
            await ctx.record(Envelope.wrap(AliasConfigured(alias=alias.alias, config=alias)))
            recorded += 1
    return recorded


async def serve(ctx: ServiceContext, config: PoolConfig) -> None:
    changed = await register_aliases(ctx, config)
    log.info("%d aliases configured (%d recorded as changed)", len(config.aliases), changed)
    await ctx.stop.wait()


def main(argv: list[str]) -> int:
    from shared.settings import Settings

    settings = Settings.load()
    # Read the configuration before connecting to anything: a bad file fails fast.
    config = load_pool_config(settings.config_path)
    return run_service("autoscaler", lambda ctx: serve(ctx, config), settings)
