"""The admin API: its own port and token; status, history, instances, and a drain recorded that the autoscaler
sends to the worker."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from gateway_support import ALIAS, FAST
from helpers import eventually
from nats.js.errors import NotFoundError

from services.autoscaler.controller import Controller
from shared.contracts.config import PoolConfig
from shared.eventlog.lease import AdvisoryLease

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

        # Every action says who asks and why, and is refused without them.
        for body in ({}, {"operator": "ops"}, {"reason": "why"}, {"operator": " ", "reason": "why"}):
            refused = await client.post(f"{admin}/admin/instances/f1/drain", json=body, headers=auth)
            assert refused.status_code == 400 and refused.json()["error"]["param"] in ("operator", "reason"), body
        not_json = await client.post(f"{admin}/admin/instances/f1/drain", content=b"{", headers=auth)
        huge = await client.post(f"{admin}/admin/instances/f1/drain", json={"operator": "o", "reason": "x" * 5000},
                                 headers=auth)
        assert (not_json.status_code, huge.status_code) == (400, 413)
        who = {"operator": "ops-anna", "reason": "host maintenance"}
        drained = await client.post(f"{admin}/admin/instances/f1/drain", json=who, headers=auth)
        assert drained.status_code == 202 and drained.json()["worker_id"] == "w1"
        unknown = await client.post(f"{admin}/admin/instances/nope/drain", json=who, headers=auth)
        already = await client.post(f"{admin}/admin/instances/f2/drain", json=who, headers=auth)
        no_sleep = await client.post(f"{admin}/admin/instances/f1/sleep", json=who, headers=auth)
        no_such_action = await client.post(f"{admin}/admin/instances/f1/reboot", json=who, headers=auth)
    assert unknown.status_code == 404 and already.status_code == 409 and no_such_action.status_code == 404
    assert already.json()["error"]["code"] == "illegal_transition"
    async with httpx.AsyncClient(timeout=30) as client:  # this gateway keeps no access log: nothing to explain
        unexplained = await client.get(f"{admin}/admin/requests/anything", headers=auth)
    assert unexplained.status_code == 404 and unexplained.json()["error"]["code"] == "no_access_log"
    assert no_sleep.status_code == 409 and no_sleep.json()["error"]["code"] == "unsupported_action"  # llama.cpp

    # The drain is in the log with who and why, its command's id and the instance's worker; the gateway sent
    # nothing (it may not publish commands): the autoscaler sends it to the worker, the event its cause.
    ctx = gateway.ctx
    assert drained.json()["sent_by"] == "autoscaler"
    with pytest.raises(NotFoundError):
        await ctx.js.get_last_msg(ctx.subjects.commands_stream, ctx.subjects.worker_commands("w1"))
    autoscaler = Controller(store=ctx.store, engine=ctx.engine, js=ctx.js, subjects=ctx.subjects,
                            telemetry=ctx.telemetry, telemetry_bus=ctx.telemetry_bus,
                            lease=AdvisoryLease(ctx.settings.asyncpg_dsn, ctx.settings.namespace, "autoscaler"),
                            pool=PoolConfig(), tick_s=1.0, worker_timeout_s=10.0)
    await autoscaler.view.load()
    assert await autoscaler.send_operator_commands() == 1
    assert await autoscaler.send_operator_commands() == 0  # once
    message = await ctx.js.get_last_msg(ctx.subjects.commands_stream, ctx.subjects.worker_commands("w1"))
    command = json.loads(message.data)
    assert command["type"] == "DrainInstance" and command["id"] == drained.json()["command_id"]
    assert command["payload"]["instance_id"] == "f1"
    assert command["payload"]["reason"] == "operator ops-anna: host maintenance"
    recorded = await ctx.store.get(uuid.UUID(drained.json()["event_id"]))
    assert recorded.type == "OperatorCommanded" and recorded.stream_id == f"alias:{ALIAS}"
    assert recorded.payload["operator"] == "ops-anna" and command["causation_id"] == str(recorded.id)
    assert recorded.payload["command_id"] == command["id"] and recorded.payload["worker_id"] == "w1"


async def test_pauses_and_pins_are_recorded_and_the_console_reads_them_back(engines, facts, gateways, tmp_path):
    await facts.alias()
    await facts.running("f1", engines[FAST][0], FAST)
    await facts.route(R.FAST_ONLY)
    port = free_port()
    gateway = await gateways.start(admin_token=TOKEN, admin_port=port, metric_window_s=1,
                                   access_log=str(tmp_path / "access.log"))
    admin, auth = f"http://127.0.0.1:{port}", {"authorization": f"Bearer {TOKEN}"}
    who = {"operator": "ops-ben", "reason": "launch at noon"}
    async with httpx.AsyncClient(timeout=30) as client:
        paused = await client.post(f"{admin}/admin/aliases/{ALIAS}/pause", json=who, headers=auth)
        pinned = await client.post(f"{admin}/admin/aliases/{ALIAS}/pin",
                                   json={**who, "backend": "llama.cpp", "min_replicas": 1}, headers=auth)
        refused = [await client.post(f"{admin}/admin/aliases/{ALIAS}/pin", json={**who, **extra}, headers=auth)
                   for extra in ({"backend": "llama.cpp", "min_replicas": 2}, {"backend": "llama.cpp"},  # max is 1
                                 {"backend": "sglang", "min_replicas": 1}, {"backend": "vllm", "min_replicas": -1},
                                 {"backend": "llama.cpp", "min_replicas": True})]
        unknown = await client.post(f"{admin}/admin/aliases/nope/pause", json=who, headers=auth)
        assert paused.status_code == 200 and pinned.status_code == 200
        assert [r.status_code for r in refused] == [400] * 5 and unknown.status_code == 404

        # The timeline shows them, each linked to the whole event.
        history = (await client.get(f"{admin}/admin/history/{ALIAS}", headers=auth)).json()["events"]
        said = [e for e in history if e["type"] == "OperatorCommanded"]
        assert [e["summary"] for e in said] == ["operator ops-ben: pause the controller: launch at noon",
                                               "operator ops-ben: pin llama.cpp min_replicas to 1: launch at noon"]
        newest = (await client.get(f"{admin}/admin/history/{ALIAS}", params={"limit": 1}, headers=auth)).json()
        assert newest["events"] == history[-1:] and newest["total"] == len(history)
        bad_limit = await client.get(f"{admin}/admin/history/{ALIAS}", params={"limit": "-3"}, headers=auth)
        assert bad_limit.status_code == 400 and bad_limit.json()["error"]["param"] == "limit"
        event = (await client.get(f"{admin}/admin/events/{said[1]['id']}", headers=auth)).json()
        assert event["payload"]["min_replicas"] == 1 and event["position"] == said[1]["position"]
        assert (await client.get(f"{admin}/admin/events/not-a-uuid", headers=auth)).status_code == 400
        assert (await client.get(f"{admin}/admin/events/{uuid.uuid4()}", headers=auth)).status_code == 404

        # The control row folds them (the projector's work, done here once), as the controller reads them.
        projector = Projector(gateway.ctx.store, gateway.ctx.engine)
        await projector.load()
        await projector.catch_up()
        status = (await client.get(f"{admin}/admin/status", headers=auth)).json()
        assert status["control"][ALIAS]["operator"] == {"paused": "ops-ben: launch at noon",
                                                        "min_replicas": {"llama.cpp": 1}}

        # The live charts' data: the gateways' windows as they close, and the instances now.
        answered = await client.post(f"{gateway.url}/v1/chat/completions", json={
            "model": ALIAS, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})

        # Why that request went where it went, from the access log, as `modelpool explain` says it.
        async def explained() -> dict | None:
            found = await client.get(f"{admin}/admin/requests/{answered.headers['x-request-id']}", headers=auth)
            return found.json() if found.status_code == 200 else None
        why = await eventually(explained, timeout=10)
        assert why["record"]["instance"] == "f1" and "served by llama.cpp instance f1" in why["explained"]
        missing = await client.get(f"{admin}/admin/requests/no-such-request", headers=auth)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"

        async def series() -> dict | None:
            found = (await client.get(f"{admin}/admin/aliases/{ALIAS}/series", headers=auth)).json()
            return found if any(p["arrivals_per_s"] > 0 for p in found["points"]) else None
        found = await eventually(series, timeout=15)
        assert found["now"] == {"state": "FAST_ONLY", "mix_weight": 0.0, "instances": {"llama.cpp": {"RUNNING": 1}}}
        last = found["points"][-1]["at"]
        assert all(p["at"] > last for p in (await client.get(
            f"{admin}/admin/aliases/{ALIAS}/series", params={"after": last}, headers=auth)).json()["points"])
        sessions = (await client.get(f"{admin}/admin/sessions", headers=auth)).json()
        assert sessions == {"sessions": [], "migrations": []}

        # The page and its assets need no token (they hold no data); everything they read does.
        page = await client.get(f"{admin}/console")
        assert page.status_code == 200 and "console.js" in page.text
        for name, kind in (("console.js", "text/javascript"), ("console.css", "text/css")):
            asset = await client.get(f"{admin}/console/{name}")
            assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert (await client.get(f"{admin}/console/..%2Fadmin.py")).status_code == 404
        assert (await client.get(f"{admin}/admin/aliases/{ALIAS}/series")).status_code == 401
        assert (await client.get(f"{gateway.url}/console")).status_code == 404  # never on the public port


async def test_with_the_bus_away_the_console_still_reads_the_log_and_its_charts_come_back(
        engines, facts, gateways, tmp_path):
    """NATS stopped under a gateway serving the console: the pool page still has the log's facts and says the live
    ones are missing; the charts' data answers; NATS back, the live facts and new windows come back."""
    from services.cluster.embedded import EmbeddedNats

    await facts.alias()
    await facts.running("f1", engines[FAST][0], FAST)
    await facts.route(R.FAST_ONLY)
    port = free_port()
    with EmbeddedNats(tmp_path / "nats") as nats:
        gateway = await gateways.start(admin_token=TOKEN, admin_port=port, nats_url=nats.url, metric_window_s=1)
        projector = Projector(gateway.ctx.store, gateway.ctx.engine)  # the read models status reads
        await projector.load()
        await projector.catch_up()
        admin, auth = f"http://127.0.0.1:{port}", {"authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(timeout=30) as client:
            async def live(error: bool) -> dict | None:
                status = (await client.get(f"{admin}/admin/status", headers=auth)).json()
                return status if ("error" in status["live"]) == error else None

            await eventually(lambda: live(False), timeout=15)
            nats.stop()
            away = await eventually(lambda: live(True), timeout=15)
            assert [a["alias"] for a in away["aliases"]] == [ALIAS]  # the log's facts, still
            assert "the bus does not answer" in away["live"]["error"]
            during = await client.get(f"{admin}/admin/aliases/{ALIAS}/series", headers=auth)
            assert during.status_code == 200
            last = during.json()["points"][-1]["at"] if during.json()["points"] else None
            nats.start()
            await eventually(lambda: live(False), timeout=30)

            async def new_window() -> bool:
                points = (await client.get(f"{admin}/admin/aliases/{ALIAS}/series", headers=auth)).json()["points"]
                return bool(points) and (last is None or points[-1]["at"] > last)
            await eventually(new_window, timeout=30)
    gateway.ctx.stop.set()
