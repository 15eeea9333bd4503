"""The services as real processes: crash safety of the relay and projector, and a request end to end from COLD."""

from __future__ import annotations

import asyncio
import random
import signal

import httpx
import openai
from sqlalchemy import text

from helpers import ServiceProcess, eventually
from services.ops.replay import replay
from shared.bus import subjects as h
from shared.contracts.events import SessionBound, SessionMigrated
from shared.contracts.messages import Envelope
from shared.net import free_port


def service_env(settings, **extra: str) -> dict[str, str]:
    return {
        "DATABASE_URL": settings.database_url,
        "NATS_URL": settings.nats_url,
        "MODELPOOL_NAMESPACE": settings.namespace,
        **extra,
    }


async def tracked(store, name: str) -> int:
    async with store.engine.connect() as conn:
        value = (await conn.execute(text("SELECT position FROM tracking WHERE name = :n"), {"n": name})).scalar()
    return int(value or 0)


async def test_relay_and_projector_killed_mid_stream_lose_and_double_nothing(store, bus, settings, tmp_path):
    env = service_env(settings)
    relay = ServiceProcess("relay", env, tmp_path)
    projector = ServiceProcess("projector", env, tmp_path)
    writers = 8
    appended: list[Envelope] = []
    stop_writing = asyncio.Event()

    async def writer(n: int) -> None:
        rng = random.Random(n)
        i = 0
        while not stop_writing.is_set():
            if i == 0:
                event = SessionBound(session_id=f"s{n}", alias="a", instance_id="i0")
            else:
                event = SessionMigrated(session_id=f"s{n}", alias="a", from_instance_id=f"i{i - 1}",
                                        to_instance_id=f"i{i}", reason="hot")
            appended.extend(await store.append(f"session:s{n}", [Envelope.wrap(event)]))
            i += 1
            await asyncio.sleep(rng.uniform(0.005, 0.02))

    async def mid_stream(name: str) -> int:
        """Wait until `name` has made progress but is behind the head: the moment to kill it."""
        async def caught_in_the_middle():
            position = await tracked(store, name)
            return position if 0 < position < await store.head_position() else 0

        return await eventually(caught_in_the_middle, timeout=30, interval=0.01)

    async def chaos() -> None:
        nonlocal relay, projector
        try:
            at = await mid_stream("relay")
            relay.kill(signal.SIGKILL)
            relay = ServiceProcess("relay", env, tmp_path)
            await eventually(lambda: _past(store, "relay", at), timeout=30)  # the new relay is at work
            await mid_stream("sessions")
            projector.kill(signal.SIGKILL)
            projector = ServiceProcess("projector", env, tmp_path)
            await asyncio.sleep(1.0)
        finally:
            stop_writing.set()

    try:
        await asyncio.gather(chaos(), *(writer(n) for n in range(writers)))
        head = await store.head_position()
        await eventually(lambda: _all_at(store, head), timeout=60)
    finally:
        codes = (relay.stop(), projector.stop())
    assert codes == (0, 0), relay.output()[-2000:] + projector.output()[-2000:]
    total = len(appended)
    assert total > 100

    # Every event is in the log once.
    async with store.engine.connect() as conn:
        count = (await conn.execute(text("SELECT count(*), count(DISTINCT id) FROM events"))).one()
    assert tuple(count) == (total, total)

    # Every event was delivered, once, although the killed relay's tail was published again.
    info = await bus.js.stream_info(bus.subjects.events_stream)
    assert info.state.messages == total
    sub = await bus.js.pull_subscribe(bus.subjects.all_events, durable=None)
    positions: list[int] = []
    while len(positions) < total:
        for m in await sub.fetch(200, timeout=5):
            positions.append(int(m.headers[h.POSITION]))
            await m.ack()  # unacked, the consumer would stop at its max_ack_pending
    assert sorted(positions) == sorted(e.position for e in appended)

    # Each projection equals a rebuild from the log.
    report = await replay(settings)
    assert report.consistent, [d.describe() for d in report.differences]
    assert report.rows["sessions"] == writers


async def _past(store, name: str, position: int) -> bool:
    return await tracked(store, name) > position


async def _all_at(store, head: int) -> bool:
    positions = [await tracked(store, name) for name in ("relay", "routing", "instances", "sessions", "workers")]
    return all(p >= head for p in positions)


POOL = """
aliases:
  - alias: tiny
    backends:
      llama.cpp: {model_name: tiny, model_path: default, gpu_memory_gb: 0, min_replicas: 0, max_replicas: 2, engine: simulator}
      vllm: {model_name: tiny, model_path: /models/tiny, gpu_memory_gb: 12, max_replicas: 1, max_model_len: 4096, engine: simulator}
"""


async def test_a_request_on_a_cold_alias_is_held_the_controller_starts_an_instance_and_it_answers(store, bus, settings, tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text(POOL)
    port = free_port()
    env = service_env(settings, MODELPOOL_CONFIG=str(pool), MODELPOOL_GATEWAY_PORT=str(port),
                      MODELPOOL_WORKER_ID="w1", MODELPOOL_WORKER_GPU_MEMORY_GB="24",
                      MODELPOOL_WORKER_SIM_SPEEDUP="100")
    services = [ServiceProcess(name, env, tmp_path) for name in ("relay", "projector", "autoscaler", "placement", "worker", "gateway")]
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            async def alias_listed():
                try:
                    models = (await client.get("/v1/models")).json()["data"]
                except (httpx.HTTPError, KeyError, ValueError):
                    return None
                return models or None

            (card,) = await eventually(alias_listed, timeout=60)
            assert card["id"] == "tiny" and card["simulated"] is True
            assert "simulated-llama.cpp" in card["engine"] and "simulated-vllm" in card["engine"]

            await eventually(lambda: store.stream_version("worker:w1"), timeout=60)  # registered, so placeable
            # Nothing serves `tiny` yet: the request is held, the controller starts an instance, and it is answered.
            cold = asyncio.create_task(client.post("/v1/chat/completions", timeout=60,
                                                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}))
            unknown = await client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
            assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
            bad = await client.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
            assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"

            answered = await cold
            assert answered.status_code == 200
            instance = answered.headers["x-modelpool-instance"]
            assert instance.startswith("tiny-fast-")

        sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        raw = await sdk.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8)
        completion = raw.parse()
        assert completion.choices[0].message.content and completion.usage.completion_tokens <= 8
        assert raw.headers["x-modelpool-engine"] == "simulated-llama.cpp"
        assert raw.headers["x-modelpool-instance"] == instance
        chunks = [c async for c in await sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Count"}], max_tokens=5, stream=True)]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        await sdk.close()

        async def cold_start_recorded():  # at the controller's first tick after the instance runs
            return "ColdStartCompleted" in [e.type for e in await store.history("tiny")]

        await eventually(cold_start_recorded, timeout=10)
        history = [e.type for e in await store.history("tiny")]
        assert history[:1] == ["AliasConfigured"]
        assert {"PolicyDecided", "RoutingStateChanged", "PlacementRequested", "PlacementDecided", "InstanceStateChanged",
                "InstanceCommandCompleted", "ColdStartCompleted"} <= set(history)
        assert history.count("PlacementDecided") == 1  # the cold request started one instance
        decided = next(e for e in await store.history("tiny") if e.type == "PlacementDecided")
        assert decided.payload["worker_id"] == "w1" and decided.payload["fallback_level"] == 1
    finally:
        codes = {s.command: s.stop() for s in reversed(services)}
    assert set(codes.values()) == {0}, {s.command: s.output()[-1500:] for s in services}
    worker_events = [e.type for e in await store.read_stream("worker:w1")]
    assert worker_events == ["WorkerRegistered", "WorkerDeregistered"]


def test_a_bad_pool_configuration_stops_the_autoscaler_naming_field_and_file(tmp_path, settings):
    import subprocess
    import sys

    pool = tmp_path / "pool.yaml"
    pool.write_text("aliases:\n  - alias: tiny\n    routing_state: COLD\n")
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "autoscaler"],
        env={**service_env(settings, MODELPOOL_CONFIG=str(pool)), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert f"aliases[0].backends in {pool}: required field is missing" in result.stderr
