"""Each API key's limits at the gateway's front door, on a simulated engine: requests and tokens per minute,
requests at once, allowed aliases, new sessions per minute, and the limits held across two replicas through their
usage reports on the bus."""

from __future__ import annotations

import asyncio

import httpx
from gateway_support import ALIAS, FAST, start_engine, wait_healthy

from shared.contracts.states import RoutingState as R


def asking(key: str, content: str = "hello", max_tokens: int = 4, **extra) -> dict:
    return {"headers": {"authorization": f"Bearer {key}", **extra.pop("headers", {})},
            "json": {"model": extra.pop("model", ALIAS), "messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, **extra}}


async def serving(tmp_path, facts, *options: str, router: dict | None = None):
    engine = start_engine(tmp_path, "llama.cpp", ALIAS, "--parallel", "8", *options)
    wait_healthy([engine])
    await facts.alias(router=router)
    await facts.running("f1", engine, FAST, capacity=8)
    await facts.route(R.FAST_ONLY)
    return engine


async def test_a_key_over_its_requests_per_minute_is_told_its_limit_and_when_to_retry(tmp_path, facts, gateways):
    engine = await serving(tmp_path, facts)
    try:
        gateway = await gateways.start(tenant_keys=[{"key": "sk-a", "tenant": "a", "rpm": 3},
                                                    {"key": "sk-b", "tenant": "b"}])
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            for _ in range(3):
                assert (await client.post("/v1/chat/completions", **asking("sk-a"))).status_code == 200
            refused = await client.post("/v1/chat/completions", **asking("sk-a"))
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["code"] == "rpm_exceeded" and "`rpm` (3 requests per minute)" in error["message"]
            assert 1 <= int(refused.headers["retry-after"]) <= 60
            assert (await client.post("/v1/chat/completions", **asking("sk-b"))).status_code == 200  # its own limits
        assert 'modelpool:key_limit_refusals_total{limit="rpm"} 1' in await gateway.metrics()
    finally:
        engine.stop()


async def test_two_replicas_hold_one_limit_between_them(tmp_path, facts, gateways):
    engine = await serving(tmp_path, facts)
    try:
        keys = [{"key": "sk-a", "tenant": "a", "rpm": 4}]
        one, two = await gateways.start(tenant_keys=keys), await gateways.start(tenant_keys=keys)
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(3):
                assert (await client.post(f"{one.url}/v1/chat/completions", **asking("sk-a"))).status_code == 200
            await asyncio.sleep(2.5)  # a report or two of the first replica's minute reaches the second
            assert (await client.post(f"{two.url}/v1/chat/completions", **asking("sk-a"))).status_code == 200
            refused = await client.post(f"{two.url}/v1/chat/completions", **asking("sk-a"))
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "rpm_exceeded", refused.text
            await asyncio.sleep(2.5)
            back = await client.post(f"{one.url}/v1/chat/completions", **asking("sk-a"))
            assert back.status_code == 429, back.text  # and the first has heard of the second's
    finally:
        engine.stop()


async def test_tokens_per_minute_count_what_was_served(tmp_path, facts, gateways):
    engine = await serving(tmp_path, facts)
    try:
        gateway = await gateways.start(tenant_keys=[{"key": "sk-a", "tenant": "a", "tpm": 40}])
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            first = await client.post("/v1/chat/completions", **asking("sk-a", max_tokens=40))
            assert first.status_code == 200, first.text
            assert first.json()["usage"]["completion_tokens"] == 40
            refused = await client.post("/v1/chat/completions", **asking("sk-a", max_tokens=40))
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "tpm_exceeded", refused.text
            assert "`tpm` (40 tokens per minute)" in refused.json()["error"]["message"]
            huge = await client.post("/v1/chat/completions", **asking("sk-a", content="word " * 400))
            assert huge.status_code == 429 and "allows at all" in huge.json()["error"]["message"]
    finally:
        engine.stop()


async def test_concurrent_requests_of_a_key_are_bounded_and_freed_as_they_end(tmp_path, facts, gateways):
    engine = await serving(tmp_path, facts, "--speedup", "1", "--d-0", "0.05", "--d-1", "0")
    try:
        gateway = await gateways.start(tenant_keys=[{"key": "sk-a", "tenant": "a", "max_concurrent": 1}])
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            long = asyncio.create_task(client.post("/v1/chat/completions", **asking("sk-a", max_tokens=40)))
            await asyncio.sleep(0.5)
            refused = await client.post("/v1/chat/completions", **asking("sk-a"))
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "max_concurrent_exceeded"
            assert refused.headers["retry-after"] == "1"
            assert (await long).status_code == 200
            assert (await client.post("/v1/chat/completions", **asking("sk-a"))).status_code == 200
    finally:
        engine.stop()


async def test_a_key_sees_and_uses_only_its_aliases(tmp_path, facts, gateways):
    engine = await serving(tmp_path, facts)
    try:
        await facts.alias("other")
        gateway = await gateways.start(tenant_keys=[{"key": "sk-a", "tenant": "a", "aliases": ["other"]},
                                                    {"key": "sk-b", "tenant": "b"}])
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            refused = await client.post("/v1/chat/completions", **asking("sk-a"))
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
            listed = await client.get("/v1/models", headers={"authorization": "Bearer sk-a"})
            assert [m["id"] for m in listed.json()["data"]] == ["other"]
            everything = await client.get("/v1/models", headers={"authorization": "Bearer sk-b"})
            assert {m["id"] for m in everything.json()["data"]} == {ALIAS, "other"}
            assert (await client.post("/v1/chat/completions", **asking("sk-b"))).status_code == 200
    finally:
        engine.stop()


async def test_a_flood_of_new_sessions_binds_only_the_keys_share(tmp_path, facts, gateways, store):
    engine = await serving(tmp_path, facts, router={"plugin": "affinity"})
    try:
        gateway = await gateways.start(tenant_keys=[{"key": "sk-a", "tenant": "a", "sessions_per_minute": 2}])
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            for i in range(6):
                answer = await client.post("/v1/chat/completions",
                                           **asking("sk-a", headers={"x-session-id": f"flood-{i}"}))
                assert answer.status_code == 200, answer.text  # served all the same
        await asyncio.sleep(1.0)  # bindings are written behind the requests
        bound = [i for i in range(6) if await store.read_stream(f"session:{ALIAS}/flood-{i}")]
        assert bound == [0, 1]
        assert f'modelpool:sessions_unbound_total{{alias="{ALIAS}"}} 4' in await gateway.metrics()
    finally:
        engine.stop()


async def test_keys_are_added_limited_and_revoked_by_editing_the_keys_file(tmp_path, facts, gateways):
    engine = await serving(tmp_path, facts)
    keys = tmp_path / "keys"
    keys.write_text("sk-old tenant=a\n")
    try:
        gateway = await gateways.start(api_keys_file=str(keys))

        async def status(key: str) -> int:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
                return (await client.post("/v1/chat/completions", **asking(key))).status_code

        async def until(key: str, expected: int) -> None:
            for _ in range(60):
                if await status(key) == expected:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError(f"{key} never answered {expected}")

        assert await status("sk-new") == 401
        keys.write_text("sk-old tenant=a\nsk-new tenant=b rpm=1\n")
        await until("sk-new", 200)
        assert await status("sk-new") == 429  # its limit came with it
        keys.write_text("sk-old tenant=a\nsk-new tenant=b rpm=1 colour=red\n")  # a bad edit: the keys in use stay
        await asyncio.sleep(2.5)
        assert await status("sk-old") == 200
        keys.write_text("sk-new tenant=b rpm=1\n")
        await until("sk-old", 401)
    finally:
        engine.stop()
