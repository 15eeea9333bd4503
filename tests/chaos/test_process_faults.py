"""A service, a worker, a gateway replica or an engine killed (or hung) under load: the warm alias is served,
what was lost is replaced, and the control plane acts again within seconds."""

from __future__ import annotations

import asyncio

import pytest
from chaos_checks import assert_healed

from services.cluster.chaos import SETTLE_S, engine_pid, pool_yaml
from services.processes import is_alive


@pytest.mark.parametrize("service", ["relay", "projector", "placement", "autoscaler"])
async def test_a_control_plane_service_sigkilled_and_restarted_costs_no_request(chaos_pool, service):
    chaos = await chaos_pool(pool_yaml({"warm": "affinity"}))
    await chaos.warm(["warm"], 1)
    load = chaos.load(["warm"], clients=4)
    injected = await chaos.inject(f"{service}-kill", down_s=2)
    recovery_s, probe = await chaos.probe("probe")
    report = await load.stop()
    counted = report.during(injected)
    assert counted["sent"] >= 10 and counted["failed"] == 0, counted
    assert probe.ok and recovery_s <= 10, (probe, recovery_s)
    await assert_healed(chaos, ["warm"], 1)


async def test_a_worker_sigkilled_takes_its_engines_along_and_the_other_workers_instance_carries_the_load(chaos_pool):
    chaos = await chaos_pool(pool_yaml({"warm": "least-load"}, replicas=2), workers={"w1": {}, "w2": {}})
    await chaos.warm(["warm"], 2)
    hosts = await chaos.sql("SELECT instance_id, worker_id, endpoint FROM proj_instances WHERE alias = 'warm'")
    assert {h["worker_id"] for h in hosts} == {"w1", "w2"}  # placed apart (anti-affinity)
    (on_w1,) = [h for h in hosts if h["worker_id"] == "w1"]
    engine = engine_pid(on_w1["endpoint"])
    load = chaos.load(["warm"], clients=4, max_tokens=40)
    injected = await chaos.inject("worker-kill", down_s=2)
    async def engine_gone() -> bool:
        return not is_alive(engine)

    # The engine died with its worker: SIGTERMed by the kernel, it ends once its open answers are cut.
    await chaos.wait_for("the engine gone with its worker", engine_gone, 10)
    (error, *_) = await chaos.wait_for("the lost instance recorded",
                                       lambda: chaos.errors_of("warm", on_w1["instance_id"]), 30)
    await asyncio.sleep(SETTLE_S)
    report = await load.stop()
    counted = report.during(injected)
    assert counted["sent"] >= 10 and counted["failed"] == 0, counted
    assert await chaos.replaced_within("warm", error["at"]) <= 10
    await assert_healed(chaos, ["warm"], 2, lost_workers=None)  # lost or not, depending on how fast it came back


@pytest.mark.parametrize("fault", ["engine-hang", "engine-kill"])
async def test_an_engine_hung_or_killed_is_recorded_replaced_and_its_requests_finish_elsewhere(chaos_pool, fault):
    chaos = await chaos_pool(pool_yaml({"warm": "affinity"}, replicas=2))
    await chaos.warm(["warm"], 2)
    load = chaos.load(["warm"], clients=4, max_tokens=40)
    injected = await chaos.inject(fault, alias="warm")
    await asyncio.sleep(SETTLE_S)
    report = await load.stop()
    counted = report.during(injected)
    assert counted["sent"] >= 10 and counted["failed"] == 0, counted
    if fault == "engine-hang":
        assert "no answer from /health" in injected.detail["reason"]
        assert injected.returned - injected.began <= 3 + 5  # the hang timeout, and a probe or two
    (error, *_) = await chaos.errors_of("warm", injected.detail["instance_id"])
    assert await chaos.replaced_within("warm", error["at"]) <= 10
    await assert_healed(chaos, ["warm"], 2)


async def test_a_gateway_replica_sigkilled_cuts_only_what_it_was_answering(chaos_pool):
    chaos = await chaos_pool(pool_yaml({"warm": "least-load"}), gateways=2)
    await chaos.warm(["warm"], 1)
    load = chaos.load(["warm"], clients=4, max_tokens=40)
    await asyncio.sleep(2)
    injected = await chaos.inject("gateway-kill", down_s=2)
    await asyncio.sleep(3)
    report = await load.stop()
    broken = [o for o in report.between(injected.began - 30, injected.began) if not o.ok]
    assert len(broken) <= 4 and all(o.gateway.endswith(f":{chaos.gateway_ports[1]}/v1") for o in broken), broken
    after = report.count(report.between(injected.began + 0.5, injected.returned + 3))
    assert after["sent"] >= 10 and after["failed"] == 0, after  # the balancer sends everything new to the other
    await assert_healed(chaos, ["warm"], 1)

