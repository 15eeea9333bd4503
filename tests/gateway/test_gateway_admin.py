"""The admin API: its own port and token; status, history, instances, and a drain that reaches the worker."""

from __future__ import annotations

import json

import httpx
from gateway_support import ALIAS, FAST

from shared.contracts.states import InstanceState as I, RoutingState as R
from shared.net import free_port
from shared.projections.projector import Projector

TOKEN = "admin-token-for-tests-0123"


async def test_the_admin_api_answers_only_its_token_on_its_own_port_and_drains_through_the_worker(engines, facts, gateways):
    await facts.alias()
    await facts.running("f1", engines[FAST][0], FAST)
    await facts.instance("f2", FAST, I.STARTING, I.RUNNING, I.DRAINING, endpoint=engines[FAST][1].url)
    await facts.route(R.FAST_ONLY)
    port = free_port()
    gateway = await gateways.start(admin_token=TOKEN, admin_port=port)
    admin = f"http://127.0.0.1:{port}"
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(timeout=30) as client:
        for headers in ({}, {"authorization": "Bearer admin-token-for-tests-0124"}, {"authorization": TOKEN}):
            refused = await client.get(f"{admin}/admin/status", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        # Not on the public port, token or not.
        for path in ("/admin/status", "/admin/instances", "/admin/instances/f1/drain"):
            assert (await client.post(f"{gateway.url}{path}", headers=auth)).status_code in (404, 405)
            assert (await client.get(f"{gateway.url}{path}", headers=auth)).status_code in (404, 405)

        # Status reads the read models, as `modelpool status` does: the projector's work, done here once.
        projector = Projector(gateway.ctx.store, gateway.ctx.engine)
        await projector.load()
        await projector.catch_up()
        status = (await client.get(f"{admin}/admin/status", headers=auth)).json()
        assert [(a["alias"], a["state"]) for a in status["aliases"]] == [(ALIAS, "FAST_ONLY")]
        instances = (await client.get(f"{admin}/admin/instances", headers=auth)).json()["instances"]
        assert {(i["instance_id"], i["state"]) for i in instances} == {("f1", "RUNNING"), ("f2", "DRAINING")}
        history = (await client.get(f"{admin}/admin/history/{ALIAS}", headers=auth)).json()["events"]
        assert any(e["type"] == "RoutingStateChanged" for e in history)
        bad_time = await client.get(f"{admin}/admin/history/{ALIAS}", params={"since": "yesterday"}, headers=auth)
        assert bad_time.status_code == 400

        # Prometheus finds the engines' /metrics here (http_sd_configs): every engine that answers, labelled.
        assert (await client.get(f"{admin}/admin/sd/engines")).status_code == 401
        targets = (await client.get(f"{admin}/admin/sd/engines", headers=auth)).json()
        assert [t["labels"]["instance_id"] for t in targets] == ["f1", "f2"]
        assert targets[0] == {"targets": [engines[FAST][0].url.removeprefix("http://")], "labels": {
            "alias": ALIAS, "backend": "llama.cpp", "engine": "simulator", "instance_id": "f1", "worker": "w1"}}

        drained = await client.post(f"{admin}/admin/instances/f1/drain", headers=auth)
        assert drained.status_code == 202 and drained.json()["worker_id"] == "w1"
        unknown = await client.post(f"{admin}/admin/instances/nope/drain", headers=auth)
        already = await client.post(f"{admin}/admin/instances/f2/drain", headers=auth)
    assert unknown.status_code == 404 and already.status_code == 409
    assert already.json()["error"]["code"] == "not_drainable"

    # The drain is on its way to the instance's worker, as the controller's commands travel.
    ctx = gateway.ctx
    message = await ctx.js.get_last_msg(ctx.subjects.commands_stream, ctx.subjects.worker_commands("w1"))
    command = json.loads(message.data)
    assert command["type"] == "DrainInstance" and command["id"] == drained.json()["command_id"]
    assert command["payload"]["instance_id"] == "f1" and "operator" in command["payload"]["reason"]
