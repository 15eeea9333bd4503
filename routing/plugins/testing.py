"""Constructed states for the plugins' tests: requests and instances built in one line."""

from __future__ import annotations

import random

from routing.registry import build_scheduler
from routing.scheduler import Endpoint, RoutingRequest, Scheduler, SessionState
from shared.contracts.config import RouterConfig


def request(session: str = "s", prompt_tokens: int = 1000, host: str | None = None, moved_at: float | None = None,
            context_tokens: int = 0, now: float = 1000.0) -> RoutingRequest:
    return RoutingRequest(SessionState(session, host, moved_at, context_tokens), prompt_tokens, now)


def endpoints(*loads: int, **fields) -> list[Endpoint]:
    """Instances i0, i1, ... with the given pending prefill tokens; `fields` maps a name to one value per instance."""
    return [Endpoint(f"i{i}", pending_prefill=load, **{k: v[i] for k, v in fields.items()}) for i, load in enumerate(loads)]


def make_router(plugin: str, **options) -> Scheduler:
    """The router a pool file's `router: {plugin: ..., **options}` builds, with a fixed seed for its ties."""
    return build_scheduler(RouterConfig.model_validate({"plugin": plugin, **options}), random.Random(0))
