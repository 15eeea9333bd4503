"""Routers by name, built from an alias's `router:` section of the pool file."""

from __future__ import annotations

import random

from routing.plugins import ear, kv_aware, least_load, round_robin, sticky
from routing.scheduler import Scheduler
from shared.contracts.config import RouterConfig


def build_scheduler(config: RouterConfig, rng: random.Random) -> Scheduler:
    match config.plugin:
        case "round-robin":
            return round_robin.build(rng)
        case "least-load":
            return least_load.build(rng)
        case "kv-aware":
            return kv_aware.build(rng, config.kv_weight, config.load_weight)
        case "sticky":
            return sticky.build(rng)
        case "affinity":
            return ear.build(rng, config.t_hot_tokens, config.t_cool_s, migrate=False)
        case "ear":
            return ear.build(rng, config.t_hot_tokens, config.t_cool_s)
    raise ValueError(f"unknown router plugin {config.plugin!r}")
