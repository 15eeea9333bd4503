"""The public edge: API keys, the size limit, OpenAI-shaped refusals, no way through to engine control paths."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from gateway_support import ALIAS, FAST, SLOW
from test_gateway_admission import pool
from test_gateway_holds import CHAT

from helpers import eventually
from services.ops import explain
from shared.contracts.backends import EngineKind
from shared.contracts.events import WorkerLost, WorkerRegistered
from shared.contracts.messages import Envelope
from shared.contracts.states import InstanceState as I, RoutingState as R

ERROR_KEYS = {"message", "type", "param", "code"}
ROOT = Path(__file__).resolve().parents[2]


async def serving(engines, facts) -> None:
    await facts.alias()
    await facts.running("f1", engines[FAST][0], FAST)
    await facts.running("v1", engines[SLOW][0], SLOW)
    await facts.route(R.FAST_ONLY)


async def test_api_keys_from_the_pool_file_and_a_key_file_guard_the_api_and_nothing_else(engines, facts, gateways, tmp_path):
    await serving(engines, facts)
    key_file = tmp_path / "keys"
    key_file.write_text("# operators\nk-file   # the on-call key\n\n")
    gateway = await gateways.start(pool(api_keys="k-listed", api_keys_file=str(key_file)))
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic k-listed"},
                        {"authorization": "Bearer"}):
            refused = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert refused.status_code == 401, headers
            assert set(refused.json()["error"]) == ERROR_KEYS and refused.json()["error"]["code"] == "invalid_api_key"
            assert refused.headers["www-authenticate"].startswith("Bearer")
        assert (await client.get("/v1/models")).status_code == 401
        for key in ("k-listed", "k-file"):
            served = await client.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"})
            assert served.status_code == 200, served.text
        assert (await client.get("/v1/models", headers={"authorization": "Bearer k-file"})).status_code == 200
        assert (await client.get("/health")).status_code == 200 and (await client.get("/metrics")).status_code == 200

    sdk = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="wrong", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError):
            await sdk.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    finally:
        await sdk.close()


async def test_a_body_over_the_limit_is_a_413_whether_its_length_is_declared_or_not(engines, facts, gateways):
    await serving(engines, facts)
    gateway = await gateways.start(pool(max_body_bytes=2000))
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 3000}]}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        declared = await client.post("/v1/chat/completions", json=big)

        async def chunks():
            for _ in range(10):
                yield b" " * 500  # JSON allows leading whitespace: valid until the limit cuts it
            yield httpx.Request("POST", "/", json=CHAT).read()
        chunked = await client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        small = await client.post("/v1/chat/completions", json=CHAT)
    for refused in (declared, chunked):
        assert refused.status_code == 413
        assert set(refused.json()["error"]) == ERROR_KEYS and refused.json()["error"]["code"] == "request_too_large"
    assert small.status_code == 200


async def test_refusals_are_openai_errors(engines, facts, gateways):
    await serving(engines, facts)
    gateway = await gateways.start()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        cases = {
            "not json": await client.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}),
            "not an object": await client.post("/v1/chat/completions", json=[1, 2]),
            "no model": await client.post("/v1/chat/completions", json={"messages": CHAT["messages"]}),
            "no messages": await client.post("/v1/chat/completions", json={"model": ALIAS}),
            "no prompt": await client.post("/v1/completions", json={"model": ALIAS}),
            "bad stream": await client.post("/v1/chat/completions", json={**CHAT, "stream": "yes"}),
            "unknown model": await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}),
            "no such path": await client.get("/v2/everything"),
            "wrong method": await client.get("/v1/chat/completions"),
        }
    expected = {"not json": 400, "not an object": 400, "no model": 400, "no messages": 400, "no prompt": 400,
                "bad stream": 400, "unknown model": 404, "no such path": 404, "wrong method": 405}
    for name, response in cases.items():
        assert response.status_code == expected[name], (name, response.text)
        assert set(response.json()["error"]) == ERROR_KEYS, name
    assert cases["no model"].json()["error"]["param"] == "model"
    assert cases["bad stream"].json()["error"]["param"] == "stream"


async def raw_request(url: str, method: str, target: str) -> int:
    """Send `target` byte for byte (no client normalising `..` or `%2F`) and read the status."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    body = b"{}"
    writer.write(f"{method} {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    return int(status_line.split()[1])


CONTROL_PATHS = ["/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache", "/is_sleeping", "/slots", "/sim/status"]
TRICKS = ["{p}", "/{p}", "/v1{p}", "/v1/..{p}", "/v1/chat/completions/../..{p}", "/./{p}", "/%2e%2e{p}",
          "/v1%2F..{p}", "/v1/chat/completions%2F..%2F..{p}", "/v1/chat/completions/{p}", "/v1/completions/..%2F..{p}",
          "/v1/models/..{p}", "/%2F{p}", "/v1/chat/completions?next={p}"]


async def test_no_path_trick_reaches_an_engine_control_endpoint(engines, facts, gateways):
    await serving(engines, facts)
    gateway = await gateways.start()
    reached = []
    for path in CONTROL_PATHS:
        for trick in TRICKS:
            target = trick.format(p=path).replace("//", "/", 1) if trick.startswith("{p}") else trick.format(p=path)
            for method in ("POST", "GET"):
                status = await raw_request(gateway.url, method, target)
                if status not in (400, 404, 405):
                    reached.append((method, target, status))
    assert not reached
    async with httpx.AsyncClient(timeout=10) as client:  # and the vLLM engine behind it was never put to sleep
        assert (await client.get(f"{engines[SLOW][0].url}/is_sleeping")).json()["is_sleeping"] is False


async def test_models_lists_each_alias_with_its_routing_state_and_which_backends_are_simulated(engines, facts, gateways):
    await serving(engines, facts)
    gateway = await gateways.start()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        (card,) = (await client.get("/v1/models")).json()["data"]
        served = await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "req-42"})
        fresh = await client.post("/v1/chat/completions", json=CHAT)
    assert card["id"] == ALIAS and card["routing_state"] == "FAST_ONLY" and card["simulated"] is True
    assert card["backends"] == {"llama.cpp": {"engine": "simulated-llama.cpp", "simulated": True},
                                "vllm": {"engine": "simulated-vllm", "simulated": True}}
    assert served.headers["x-request-id"] == "req-42" and len(fresh.headers["x-request-id"]) == 32


async def test_each_request_is_one_access_log_line_with_what_served_it(engines, facts, gateways, caplog):
    await serving(engines, facts)
    gateway = await gateways.start()
    caplog.set_level(logging.INFO, logger="modelpool.access")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        answered = await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "plain-1"})
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                                     headers={"x-request-id": "stream-1"})
        await client.post("/v1/chat/completions", json={"model": ALIAS}, headers={"x-request-id": "bad-1"})
    lines = {r["request_id"]: r for r in (json.loads(m.getMessage()) for m in caplog.records if m.name == "modelpool.access")}
    assert set(lines) == {"plain-1", "stream-1", "bad-1"}
    plain, stream = lines["plain-1"], lines["stream-1"]
    for line in (plain, stream):
        assert line["alias"] == ALIAS and line["status"] == 200 and line["outcome"] == "ok"
        assert line["instance"] == "f1" and line["backend"] == "llama.cpp" and line["engine"] == "simulated-llama.cpp"
        assert line["e2e_s"] > 0 and line["queue_s"] >= 0 and line["completion_tokens"] >= 1 and line["prompt_tokens"] >= 1
    assert stream["stream"] is True and 0 < stream["ttft_s"] <= stream["e2e_s"]
    assert lines["bad-1"]["status"] == 400 and lines["bad-1"]["outcome"] == "rejected" and "route" not in lines["bad-1"]
    # Why it went there: the header and the line say the same.
    for line, response in ((plain, answered), (stream, streamed)):
        assert line["route"] == response.headers["x-modelpool-route"]
        assert line["route"] == "llama.cpp f1; least-load: the only instance with room"


async def test_an_image_request_reaches_the_simulated_vision_language_engine(engines, facts, gateways):
    await serving(engines, facts)
    await facts.route(R.WARMING_VLLM, R.MIXED, R.VLLM_PRIMARY, mix_weight=1.0)
    gateway = await gateways.start()
    text_only = {**CHAT, "messages": [{"role": "user", "content": "What is in this picture?"}]}
    with_image = {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        plain = await client.post("/v1/chat/completions", json=text_only)
        seen = await client.post("/v1/chat/completions", json=with_image)
    assert seen.status_code == 200 and seen.headers["x-modelpool-engine"] == "simulated-vllm"
    # The image reached the engine whole: it counts as the model's image tokens in the prompt.
    assert seen.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"] + 100


async def test_explain_says_why_a_past_request_went_where_it_went_from_the_access_log(engines, facts, gateways, tmp_path,
                                                                                       capsys):
    await serving(engines, facts)
    log = tmp_path / "access.log"
    gateway = await gateways.start(access_log=str(log))
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "why-1"})
        await client.post("/v1/chat/completions", json={"model": ALIAS}, headers={"x-request-id": "why-2"})
    await eventually(lambda: log.exists() and log.read_text().count("\n") == 2)
    capsys.readouterr()  # what the gateway printed

    assert explain.main(["why-1", "--access-log", str(log)]) == 0
    told = capsys.readouterr().out.splitlines()
    assert told[0].startswith(f"request why-1 /v1/chat/completions for {ALIAS}, ended 20") and told[0].endswith("200 ok")
    assert told[1] == "  served by llama.cpp instance f1 (engine simulated-llama.cpp)"
    assert told[2] == "  why: least-load: the only instance with room"
    assert explain.main(["why-1", "--access-log", str(log), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["route"] == "llama.cpp f1; least-load: the only instance with room"
    assert explain.main(["why-2", "--access-log", str(log)]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("  refused at the edge: ")
    assert explain.main(["why-3", "--access-log", str(log)]) == 1
    assert "no request 'why-3'" in capsys.readouterr().err
    assert explain.main(["why-1", "--access-log", str(tmp_path / "none.log")]) == 2


async def test_metrics_show_the_pool_as_the_log_has_it_for_alerts(engines, facts, gateways):
    await serving(engines, facts)
    await facts.instance("f2", FAST, I.STARTING, I.ERROR)
    for worker in ("w1", "w2"):
        await facts.store.append(f"worker:{worker}", [Envelope.wrap(WorkerRegistered(
            worker_id=worker, host="127.0.0.1", gpu_memory_gb=24, slots=4, engines=[EngineKind.SIMULATOR]))])
    gateway = await gateways.start()

    def pool_metrics(text: str) -> dict[str, float]:
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(("modelpool:alias_routing_state", "modelpool:instances", "modelpool:workers"))}

    seen = pool_metrics(await gateway.metrics())
    assert seen[f'modelpool:alias_routing_state{{alias="{ALIAS}",state="FAST_ONLY"}}'] == 1
    assert seen[f'modelpool:alias_routing_state{{alias="{ALIAS}",state="DEGRADED_FAST"}}'] == 0
    assert 0 <= seen[f'modelpool:alias_routing_state_seconds{{alias="{ALIAS}"}}'] < 60
    assert seen[f'modelpool:instances{{alias="{ALIAS}",backend="llama.cpp",state="RUNNING"}}'] == 1
    assert seen[f'modelpool:instances{{alias="{ALIAS}",backend="llama.cpp",state="ERROR"}}'] == 1
    assert seen[f'modelpool:instances{{alias="{ALIAS}",backend="vllm",state="RUNNING"}}'] == 1
    assert (seen['modelpool:workers{status="up"}'], seen['modelpool:workers{status="lost"}']) == (2, 0)

    # Every metric the shipped alerts watch is one this gateway exports.
    exported = set(re.findall(r"^# TYPE (\S+) ", await gateway.metrics(), re.MULTILINE))
    watched = set(re.findall(r"modelpool:[a-z0-9_]+", (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text()))
    assert len(watched) >= 4 and watched <= exported, watched - exported

    await facts.store.append("worker:w2", [Envelope.wrap(WorkerLost(worker_id="w2", reason="no heartbeat"))])
    await facts.route(R.DEGRADED_FAST)
    await gateway.caught_up()
    seen = pool_metrics(await gateway.metrics())
    assert (seen['modelpool:workers{status="up"}'], seen['modelpool:workers{status="lost"}']) == (1, 1)
    assert seen[f'modelpool:alias_routing_state{{alias="{ALIAS}",state="DEGRADED_FAST"}}'] == 1


async def test_metrics_say_how_far_the_relay_is_behind_the_log(facts, gateways):
    await facts.alias()
    gateway = await gateways.start()

    def lag(text: str) -> tuple[float, float]:
        found = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("modelpool:relay_lag_"))
        return float(found["modelpool:relay_lag_events"]), float(found["modelpool:relay_lag_seconds"])

    async def caught_up() -> bool:
        return lag(await gateway.metrics()) == (0.0, 0.0)

    await eventually(caught_up, timeout=10)
    # The relay stops: what is recorded meanwhile waits in the log, and says for how long.
    gateways.relay_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await gateways.relay_task
    gateways.relay_task = None
    await facts.route(R.FAST_ONLY)
    await facts.mix(0.0)
    await asyncio.sleep(1.2)
    events, seconds = lag(await gateway.metrics())
    assert events == 2 and seconds >= 1.0
