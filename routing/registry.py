"""Routers built from an alias's `router:` section: a preset's filters and weighted scorers, or the lists given.

Every filter and scorer has a name here, as llm-d's plugins have a type: a pool
file can put them together in another order or with other weights without new
code. What a router does with sessions follows from its filters: a session
filter makes its requests wait for their own instance (`per_session`), and the
host filters bind sessions in the log (`binds_sessions`).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from routing.plugins.ear import RecomputeLedger, SessionHost
from routing.plugins.kv_aware import prefix_hit
from routing.plugins.least_load import INFLIGHT_WEIGHT, least_inflight, least_pending_prefill
from routing.plugins.round_robin import NextInTurn
from routing.plugins.sticky import session_hash
from routing.scheduler import Endpoint, Filter, Scheduler, Scorer, Weighted, has_room, tokens_text
from shared.contracts.config import RouterConfig, RouterFilter, RouterScorer, ScorerConfig

FILTERS: dict[RouterFilter, Callable[[RouterConfig], Filter]] = {
    "has-room": lambda _: has_room,
    "session-hash": lambda _: session_hash,
    "session-host": lambda c: SessionHost(c.t_hot_tokens, c.t_cool_s, migrate=False),
    "session-host-or-move": lambda c: SessionHost(c.t_hot_tokens, c.t_cool_s, move_kv=c.move_kv,
                                                  ledger=RecomputeLedger(c.recompute_budget)),
}
SCORERS: dict[RouterScorer, Callable[[], Scorer]] = {
    "least-pending-prefill": lambda: least_pending_prefill,
    "least-inflight": lambda: least_inflight,
    "prefix-hit": lambda: prefix_hit,
    "next-in-turn": NextInTurn,  # keeps whose turn it is: one per router
}
DESCRIPTIONS: dict[RouterScorer, Callable[[Endpoint], str]] = {
    "least-pending-prefill": lambda e: f"{tokens_text(e.pending_prefill)} of prompt pending",
    "least-inflight": lambda e: f"{e.inflight} of {e.capacity} slots busy" if e.capacity else f"{e.inflight} in flight",
    "prefix-hit": lambda e: f"{tokens_text(e.cached_tokens)} cached",
    "next-in-turn": lambda _: "next in turn",
}
"""What each scorer saw of the instance it decided for: the route an answer explains (`x-modelpool-route`)."""


def preset(config: RouterConfig) -> tuple[tuple[RouterFilter, ...], tuple[ScorerConfig, ...]]:
    """The filters and weighted scorers `router.plugin` names (docs/routing.md has them as a table)."""
    tie_break = ScorerConfig(name="least-inflight", weight=INFLIGHT_WEIGHT)
    least_load = (ScorerConfig(name="least-pending-prefill"), tie_break)
    prefix_and_load = (ScorerConfig(name="prefix-hit", weight=config.kv_weight),
                       ScorerConfig(name="least-pending-prefill", weight=config.load_weight), tie_break)
    match config.plugin:
        case "round-robin":
            return ("has-room",), (ScorerConfig(name="next-in-turn"),)
        case "least-load":
            return ("has-room",), least_load
        case "kv-aware":
            return ("has-room",), prefix_and_load
        case "sticky":
            return ("session-hash", "has-room"), ()
        # A new session is placed by load (seed 004 §4), and affinity, EAR's ablation, alike.
        case "affinity":
            return ("session-host", "has-room"), least_load
        case "ear":
            return ("session-host-or-move", "has-room"), least_load
    raise ValueError(f"unknown router plugin {config.plugin!r}")


def build_scheduler(config: RouterConfig, rng: random.Random) -> Scheduler:
    filters, scorers = preset(config)
    custom = config.filters is not None or config.scorers is not None
    filters = config.filters if config.filters is not None else filters
    if "has-room" not in filters:  # admission's bound: no router sends an instance more than its capacity
        filters = (*filters, "has-room")
    scorers = config.scorers if config.scorers is not None else scorers
    pulls_prefix = config.pull_prefix and config.move_kv  # a pull is a KV move
    return Scheduler(
        f"{config.plugin} (custom)" if custom else config.plugin,
        [FILTERS[name](config) for name in filters],
        [Weighted(SCORERS[s.name](), s.weight, DESCRIPTIONS[s.name]) for s in scorers if s.weight > 0],
        rng,
        binds_sessions=config.binds_sessions,
        per_session="session-hash" in filters,
        reads_cache=(any(s.name == "prefix-hit" for s in scorers)
                     or "session-host-or-move" in filters or pulls_prefix),
        pulls_prefix=pulls_prefix,
    )
