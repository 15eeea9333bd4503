"""NATS and Postgres killed, paused or cut off under load: a warm alias is served throughout, by every router,
and the control plane heals by itself."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from chaos_checks import assert_healed

from helpers import eventually
from services.cluster.chaos import OwnServers, pool_yaml

ROUTERS = {f"warm-{plugin}": plugin for plugin in ("round-robin", "least-load", "kv-aware", "sticky", "affinity", "ear")}


@pytest.mark.parametrize("fault", ["nats-kill", "postgres-kill"])
async def test_a_server_gone_for_longer_than_the_heartbeat_timeout_costs_no_request_of_any_router(chaos_pool, fault):
    chaos = await chaos_pool(pool_yaml(ROUTERS))
    aliases = list(ROUTERS)
    await chaos.warm(aliases, 1)
    load = chaos.load(aliases, clients=4)
    injected = await chaos.inject(fault, outage_s=10)
    recovery_s, probe = await chaos.probe("probe")
    report = await load.stop()

    counted = report.during(injected)
    assert counted["sent"] >= 20 and counted["failed"] == 0, counted
    assert probe.ok, probe
    assert recovery_s <= 10, f"the pool acted again {recovery_s:.1f} s after {fault} ended"
    await assert_healed(chaos, aliases, 1)
    if fault == "postgres-kill":
        # Sessions that began while the log was away were bound in memory, and recorded once it was back.
        began = {o.alias for o in report.between(injected.began, injected.returned)}
        bound = await chaos.sql("SELECT DISTINCT payload->>'alias' AS alias FROM events WHERE type = 'SessionBound'")
        assert {"warm-affinity", "warm-ear"} <= began and {"warm-affinity", "warm-ear"} <= {r["alias"] for r in bound}


async def test_a_paused_nats_is_no_death_of_the_workers_it_cannot_hear(chaos_pool):
    chaos = await chaos_pool(pool_yaml({"warm": "least-load"}))
    await chaos.warm(["warm"], 1)
    load = chaos.load(["warm"], clients=4)
    injected = await chaos.inject("nats-pause", outage_s=10)
    recovery_s, probe = await chaos.probe("probe")
    report = await load.stop()
    counted = report.during(injected)
    assert counted["sent"] >= 20 and counted["failed"] == 0, counted
    # A resumed server answers on the connections it had: every service finds it back at once, none reconnects
    # (the probe's instance was started 30-40 ms after the resume here), so the pool acts again at once.
    assert probe.ok and recovery_s <= 5, (probe, recovery_s)
    await assert_healed(chaos, ["warm"], 1)  # and no worker recorded lost


async def test_every_services_postgres_sessions_ended_at_once(chaos_pool):
    chaos = await chaos_pool(pool_yaml({"warm": "affinity"}))
    await chaos.warm(["warm"], 1)
    load = chaos.load(["warm"], clients=4)
    injected = await chaos.inject("postgres-terminate")
    assert injected.detail["sessions_ended"] >= 6  # at least one per service
    recovery_s, probe = await chaos.probe("probe")
    report = await load.stop()
    counted = report.during(injected)
    assert counted["failed"] == 0, counted
    assert probe.ok and recovery_s <= 10, (probe, recovery_s)
    await assert_healed(chaos, ["warm"], 1)


async def test_a_cold_start_asked_for_while_postgres_is_away_completes_soon_after_it_is_back(chaos_pool):
    chaos = await chaos_pool(pool_yaml({"warm": "least-load"}))
    await chaos.warm(["warm"], 1)
    injected = await chaos.inject("cold-start-postgres-away", alias="probe", outage_s=10)
    assert injected.detail["request"].ok, injected.detail["request"]  # held through the outage, then answered
    assert injected.detail["running_after_s"] <= 20
    await assert_healed(chaos, ["warm"], 1)


async def test_a_service_started_before_its_servers_waits_for_them(tmp_path):
    servers = OwnServers(tmp_path / "servers")
    env = {**os.environ, **servers.database_env, "NATS_URL": servers.nats_url, "MODELPOOL_NAMESPACE": "early"}
    await asyncio.to_thread(servers.postgres.start)  # the schema first (as `modelpool up` and compose do) ...
    migrated = subprocess.run([sys.executable, "-m", "services.cli", "migrate"], env={**env, **servers.owner_env},
                              capture_output=True)
    assert migrated.returncode == 0, migrated.stderr
    servers.postgres.stop()  # ... then neither server is there when the service starts
    log = tmp_path / "relay.log"
    with open(log, "wb") as out:
        relay = subprocess.Popen([sys.executable, "-m", "services.cli", "relay"], env=env, stdout=out,
                                 stderr=subprocess.STDOUT)
    try:
        await asyncio.sleep(3)
        assert relay.poll() is None and "NATS not reachable yet" in log.read_text(), log.read_text()
        await asyncio.to_thread(servers.nats.start)
        await eventually(lambda: "connecting to Postgres failed" in log.read_text(), timeout=10)
        await asyncio.sleep(1)
        assert relay.poll() is None, log.read_text()  # still waiting, for Postgres now
        await asyncio.to_thread(servers.postgres.start)
        await eventually(lambda: "relay starting after position" in log.read_text(), timeout=30)
        assert relay.poll() is None
    finally:
        relay.terminate()
        relay.wait(timeout=15)
        servers.stop()
