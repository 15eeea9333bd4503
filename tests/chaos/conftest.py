"""The chaos suite: faults injected into the real services on servers of the suite's own, under steady load.

Each test starts a pool (every service as a process, simulated engines) on a NATS
server and a Postgres it may kill, pause and restart, drives load on warm
aliases, injects one fault, and then checks that the pool healed: every service
up and reaching both servers, fresh requests served, the projections equal to a
rebuild of the log, every recorded decision reproduced by the policy code, and
each alias back where the load puts it.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # for `chaos_checks`

from services.cluster.chaos import ChaosPool  # noqa: E402

# Short timings, so a 10 s outage is longer than a worker's heartbeat timeout and a hang is found in seconds.
CHAOS_ENV = {
    "MODELPOOL_METRIC_WINDOW_S": "1",
    "MODELPOOL_CONTROL_TICK_S": "0.5",
    "MODELPOOL_WORKER_TIMEOUT_S": "3",
    "MODELPOOL_WORKER_HANG_TIMEOUT_S": "3",
    "MODELPOOL_WORKER_SIM_SPEEDUP": "5",
    "MODELPOOL_UPSTREAM_FIRST_BYTE_TIMEOUT_S": "5",
    "MODELPOOL_WORKER_SLOTS": "16",
}


@pytest.fixture
async def chaos_pool(tmp_path):
    """Start a ChaosPool from a pool file (and options); stopped after the test, logs kept under tmp_path."""
    pools: list[ChaosPool] = []

    async def start(pool_yaml: str, **options) -> ChaosPool:
        env = {**CHAOS_ENV, **options.pop("env", {})}
        pool = ChaosPool(tmp_path / f"chaos{len(pools)}", pool_yaml, env=env, **options)
        pools.append(pool)
        return await pool.__aenter__()

    yield start
    for pool in pools:
        await pool.__aexit__(None, None, None)
