"""Scale from zero: held requests, demand signals, keep-alives, the hold's bound, and clients that leave."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from datetime import datetime, timedelta, timezone

import httpx
import openai
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from gateway_support import ALIAS, FAST, SLOW

from helpers import eventually
from shared.contracts.config import PoolConfig
from shared.contracts.events import PlacementRequested
from shared.contracts.messages import Envelope
from shared.contracts.states import InstanceState as I, RoutingState as R

CHAT = {"model": ALIAS, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


class Stream:
    """A raw SSE request read in the background: its lines with the time each arrived."""

    def __init__(self, client: httpx.AsyncClient, body: dict) -> None:
        self.lines: list[tuple[float, str]] = []
        self.response: httpx.Response | None = None
        self.task = asyncio.create_task(self._read(client, body))

    async def _read(self, client: httpx.AsyncClient, body: dict) -> None:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            self.response = response
            async for line in response.aiter_lines():
                if line:
                    self.lines.append((time.monotonic(), line))

    def text(self) -> list[str]:
        return [line for _, line in self.lines]

    def data(self) -> list[dict]:
        return [json.loads(line[6:]) for line in self.text() if line.startswith("data: {")]


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_held_requests_are_answered_once_an_instance_runs(engines, facts, gateways):
    await facts.alias()
    gateway = await gateways.start(hold_keepalive_s=0.2, metric_window_s=1.0)
    demand = await gateways.demand()
    began = datetime.now(timezone.utc)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        sent = time.monotonic()
        stream = Stream(client, {**CHAT, "stream": True})
        plain = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))

        # Demand goes out at once, and again every second while the requests wait.
        await eventually(lambda: demand, timeout=2)
        assert demand[0][0] - sent < 0.5 and demand[0][1].alias == ALIAS and demand[0][1].gateway_id == "g1"
        await eventually(lambda: stream.response is not None, timeout=2)  # 200 and SSE headers before any instance
        assert stream.response.status_code == 200 and stream.response.headers["content-type"].startswith("text/event-stream")
        await asyncio.sleep(1.3)
        assert len(demand) >= 2 and max(d.held for _, d in demand) == 2
        # Nothing measured yet: the phase without an ETA, every second.
        placing = [line for line in stream.text() if line.startswith(": modelpool cold-start phase=placing waited_ms=")]
        assert len(placing) >= 2 and not plain.done()

        await facts.instance("f1", FAST, I.STARTING, endpoint=engines[FAST][0].url)  # starting is not serving
        await eventually(lambda: stream.text()[-1].startswith(
            ": modelpool cold-start phase=starting backend=llama.cpp waited_ms="), timeout=3)
        await asyncio.sleep(0.3)
        assert not plain.done() and not stream.data()

        await facts.instance("f1", FAST, I.RUNNING, endpoint=engines[FAST][0].url)
        ran = time.monotonic()
        answer = await asyncio.wait_for(plain, 5)
        await asyncio.wait_for(stream.task, 5)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert answer.headers["x-modelpool-instance"] == "f1"
    served = [t for t, line in stream.lines if line.startswith("data: {")]
    assert served[0] - ran < 1.0  # woken by the view catching up, not by a slow poll
    assert stream.text()[-1] == "data: [DONE]" and "".join(c["choices"][0]["delta"].get("content") or ""
                                                             for c in stream.data() if c["choices"])
    assert all(line.startswith(": modelpool cold-start phase=") for t, line in stream.lines if t < ran)
    assert [line for line in stream.text() if "phase=ready" in line][0].startswith(
        ": modelpool cold-start phase=ready backend=llama.cpp waited_ms=")
    assert int(answer.headers["x-modelpool-cold-start-ms"]) >= 1300  # held from before the 1.3 s above

    signals = len(demand)
    await asyncio.sleep(1.3)
    assert len(demand) == signals  # nothing held, nothing asked for
    text = await gateway.metrics()
    assert metric(text, "modelpool:request_queue_time_seconds_count", alias=ALIAS, outcome="served") == 2
    assert metric(text, "modelpool:num_requests_waiting", alias=ALIAS) == 0
    assert metric(text, "modelpool:requests_total", alias=ALIAS, backend="llama.cpp", outcome="ok") == 2
    windows = await gateway.ctx.telemetry_bus.read_windows(began, alias=ALIAS)
    assert max(w.held for w in windows) == 2 and max(w.queue_len for w in windows) > 1
    assert sum(w.requests_fast for w in windows) == 2 and sum(w.errors_gateway for w in windows) == 0
    assert max(w.queue_wait_s.maximum for w in windows) > 1.5  # the hold is queue wait


async def test_a_held_client_is_told_the_phase_and_an_eta_from_the_alias_measured_starts(engines, facts, gateways):
    await facts.alias()
    earlier = datetime.now(timezone.utc) - timedelta(minutes=5)
    # The alias's last llama.cpp instance: placed, then 4 s STARTING -> RUNNING; 5 s from placement to serving.
    placed = PlacementRequested(request_id=uuid.uuid4(), alias=ALIAS, backend_type=FAST, instance_id="f0", gpu_memory_gb=0)
    await facts.store.append(f"placement:{placed.request_id}", [Envelope.wrap(placed, occurred_at=earlier)])
    await facts.instance("f0", FAST, I.STARTING, I.RUNNING, I.DRAINING, I.DELETING, I.ABSENT, endpoint="http://127.0.0.1:9",
                         at=[earlier + timedelta(seconds=s) for s in (1, 5, 60, 61, 62)])
    gateway = await gateways.start(hold_timeout_s=30.0, hold_keepalive_s=5.0)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        stream = Stream(client, {**CHAT, "stream": True})
        plain = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await eventually(lambda: any("cold-start" in line for line in stream.text()), timeout=2)
        placing = progress(stream.text()[-1])
        assert placing["phase"] == "placing" and placing["backend"] == "llama.cpp" and placing["eta_ms"] == 5000

        # An instance has been starting for a second: 4 s measured, about 3 s to go.
        await facts.instance("f1", FAST, I.STARTING, endpoint=engines[FAST][0].url,
                             at=[datetime.now(timezone.utc) - timedelta(seconds=1)])
        await eventually(lambda: progress(stream.text()[-1])["phase"] == "starting", timeout=3)
        starting = progress(stream.text()[-1])
        assert starting["backend"] == "llama.cpp" and 1800 <= starting["eta_ms"] <= 3000, starting
        await asyncio.sleep(1.1)  # counting down
        assert progress(stream.text()[-1])["eta_ms"] <= starting["eta_ms"] - 700

        await facts.instance("f1", FAST, I.RUNNING, endpoint=engines[FAST][0].url)
        answer = await asyncio.wait_for(plain, 5)
        await asyncio.wait_for(stream.task, 5)
    ready = [progress(line) for line in stream.text() if "phase=ready" in line]
    assert len(ready) == 1 and ready[0]["backend"] == "llama.cpp" and ready[0]["waited_ms"] >= 1500
    assert answer.status_code == 200 and int(answer.headers["x-modelpool-cold-start-ms"]) >= 1500
    assert stream.data() and stream.text()[-1] == "data: [DONE]"


def progress(line: str) -> dict:
    """The fields of a `: modelpool cold-start` comment line."""
    assert line.startswith(": modelpool cold-start "), line
    fields = dict(part.split("=", 1) for part in line.split()[3:])
    return {k: v if k in ("phase", "backend") else int(v) for k, v in fields.items()}


async def test_a_request_for_sleeping_instances_is_held_until_one_wakes(engines, facts, gateways):
    await facts.alias()
    await facts.instance("v1", SLOW, I.STARTING, I.RUNNING, I.SLEEP_1, endpoint=engines[SLOW][0].url)
    await facts.route(R.VLLM_PRIMARY)
    gateway = await gateways.start()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        plain = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.5)
        assert not plain.done()
        await facts.instance("v1", SLOW, I.RUNNING, endpoint=engines[SLOW][0].url)
        answer = await asyncio.wait_for(plain, 5)
    assert answer.status_code == 200 and answer.headers["x-modelpool-instance"] == "v1"


async def test_an_expired_hold_is_a_503_with_retry_after_or_an_error_event_in_the_stream(facts, gateways):
    await facts.alias()
    gateway = await gateways.start(hold_timeout_s=1.0, hold_keepalive_s=0.3, metric_window_s=1.0)
    began = datetime.now(timezone.utc)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        stream = Stream(client, {**CHAT, "stream": True})
        sent = time.monotonic()
        refused = await client.post("/v1/chat/completions", json=CHAT)
        waited = time.monotonic() - sent
        await asyncio.wait_for(stream.task, 5)
    assert refused.status_code == 503 and 0.9 < waited < 2.5
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "alias_starting" and "starting" in error["message"] and ALIAS in error["message"]

    assert stream.response.status_code == 200 and ": modelpool cold-start phase=placing waited_ms=0" in stream.text()
    assert stream.text()[-1] == "data: [DONE]"
    (last,) = stream.data()
    assert last["error"]["code"] == "alias_starting"

    await asyncio.sleep(1.2)
    windows = await gateway.ctx.telemetry_bus.read_windows(began, alias=ALIAS)
    assert sum(w.errors_gateway for w in windows) == 2 and sum(w.arrivals for w in windows) == 2
    assert sum(w.requests_fast + w.requests_slow for w in windows) == 0
    text = await gateway.metrics()
    assert metric(text, "modelpool:request_queue_time_seconds_count", alias=ALIAS, outcome="expired") == 2
    # The stream's 200 went out before the hold expired; the other request got the 503.
    for status in ("200", "503"):
        assert metric(text, "modelpool:requests_total", alias=ALIAS, backend="none", outcome="hold_expired",
                      status=status) == 1


async def test_the_hold_is_bounded_by_the_alias_measured_start_time(facts, gateways):
    await facts.alias()
    start = datetime.now(timezone.utc) - timedelta(minutes=5)
    # The alias's last instance took 0.2 s from STARTING to RUNNING, then went away.
    await facts.instance("f0", FAST, I.STARTING, I.RUNNING, I.DRAINING, I.DELETING, I.ABSENT, endpoint="http://127.0.0.1:9",
                         at=[start, start + timedelta(seconds=0.2), *[start + timedelta(seconds=60 + i) for i in range(3)]])
    gateway = await gateways.start(hold_timeout_s=30.0)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        sent = time.monotonic()
        refused = await client.post("/v1/chat/completions", json=CHAT)
        waited = time.monotonic() - sent
    # 3 x 0.2 s + 2 s margin, far below the 30 s cap.
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "alias_starting"
    assert 2.4 < waited < 4.0, waited


async def test_a_client_that_leaves_while_held_is_let_go(facts, gateways):
    await facts.alias()
    gateway = await gateways.start(hold_keepalive_s=0.2)
    demand = await gateways.demand()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        stream = Stream(client, {**CHAT, "stream": True})
        try:
            await client.post("/v1/chat/completions", json=CHAT, timeout=0.5)
        except httpx.ReadTimeout:
            pass
        await eventually(lambda: any(line.startswith(": modelpool cold-start") for line in stream.text()), timeout=2)
        stream.task.cancel()  # the streaming client hangs up too

    async def released() -> bool:
        text = await gateway.metrics()
        return metric(text, "modelpool:num_requests_waiting", alias=ALIAS) == 0 and \
            metric(text, "modelpool:request_queue_time_seconds_count", alias=ALIAS, outcome="left") == 2

    await eventually(released, timeout=3)
    signals = len(demand)
    await asyncio.sleep(1.3)
    assert len(demand) == signals
    text = await gateway.metrics()
    # The streaming client had its 200 and SSE headers, the other nothing yet.
    assert re.search(r'modelpool:requests_total\{alias="tiny",backend="none",outcome="client_left",status="200"\} 1', text)
    assert re.search(r'modelpool:requests_total\{alias="tiny",backend="none",outcome="client_left",status="none"\} 1', text)


async def test_the_openai_sdk_and_langchain_wait_through_a_hold_and_its_progress_comments(engines, facts, gateways):
    await facts.alias()
    gateway = await gateways.start(hold_keepalive_s=0.2, hold_timeout_s=8.0)
    sdk = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    chat = ChatOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", model=ALIAS, max_tokens=5, max_retries=0)
    try:
        async def later_running() -> None:
            await asyncio.sleep(2.3)  # three progress comments, then the ready one
            await facts.running("f1", engines[FAST][0], FAST)

        async def consume() -> str:
            stream = await sdk.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Count"}],
                                                       max_tokens=5, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        async def consume_langchain() -> str:
            return "".join([part.content async for part in chat.astream([HumanMessage(content="Count")])])

        text, chained, _ = await asyncio.gather(consume(), consume_langchain(), later_running())
        assert text and chained

        # The same alias, cold again: the SDK sees the expiry as an API error, in the stream or not.
        await facts.instance("f1", FAST, I.DRAINING)
        await gateway.caught_up()
        failed = None
        try:
            await sdk.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        except openai.APIStatusError as exc:
            failed = exc
        assert failed is not None and failed.status_code == 503 and failed.body["code"] == "alias_starting"
        broken = None
        try:
            stream = await sdk.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=2, stream=True)
            async for _ in stream:
                pass
        except openai.APIError as exc:
            broken = exc
        assert broken is not None and "starting" in broken.message
    finally:
        await sdk.close()


async def test_an_alias_of_the_pool_file_not_yet_registered_is_held_as_cold_and_an_unknown_one_is_404(engines, facts, gateways):
    # The pool is starting: the gateway has its pool file, the controller has not recorded the alias yet.
    pool = PoolConfig.model_validate({"aliases": [{"alias": ALIAS, "backends": {"llama.cpp": {
        "model_name": ALIAS, "model_path": "default", "gpu_memory_gb": 0, "engine": "simulator"}}}]})
    gateway = await gateways.start(pool)
    demand = await gateways.demand()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        listed = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == [ALIAS] and listed[0]["simulated"] is True
        unknown = await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

        plain = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await eventually(lambda: demand, timeout=2)
        assert demand[0][1].alias == ALIAS and not plain.done()
        await facts.alias()
        await facts.running("f1", engines[FAST][0], FAST)
        answer = await asyncio.wait_for(plain, 5)
    assert answer.status_code == 200 and answer.headers["x-modelpool-instance"] == "f1"
