"""Scenario tests: the whole pool as real processes (relay, projector, placement, autoscaler, gateway,
workers) on the real Postgres and NATS, simulated engines (and real llama.cpp where said)."""

from __future__ import annotations

import os
import sys

import pytest

from services.cluster.localpool import LocalPool

sys.path.insert(0, os.path.dirname(__file__))  # for `scenario`


@pytest.fixture
def local_pool(migrated, bus, tmp_path):
    """Start a pool from a pool file and per-worker settings; everything is stopped after the test."""
    pools: list[LocalPool] = []

    def start(pool_yaml: str, *, workers: dict[str, dict[str, str]] | None = None, **env: str) -> LocalPool:
        pool = LocalPool(migrated.database_url, migrated.nats_url, migrated.namespace, pool_yaml, tmp_path / "pool",
                         workers=workers, env={"MODELPOOL_METRIC_WINDOW_S": "1", "MODELPOOL_CONTROL_TICK_S": "0.5", **env})
        pools.append(pool)
        return pool.start()

    yield start
    for pool in pools:
        pool.stop()
