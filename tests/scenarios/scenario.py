"""What the scenario tests share: a pool of real services, load on it, and reading what it did."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from helpers import eventually
from shared.eventlog.store import EventStore


def routing_path(events) -> list[str]:
    return [f"{e.payload['from_state']}->{e.payload['to_state']}" for e in events if e.type == "RoutingStateChanged"]


async def history(store: EventStore, alias: str) -> list:
    return await store.history(alias)


async def wait_for_state(store: EventStore, alias: str, state: str, timeout: float) -> float:
    """Wait until the alias has switched to `state`; the time it took."""
    start = time.monotonic()

    async def reached():
        return any(e.type == "RoutingStateChanged" and e.payload["to_state"] == state for e in await store.history(alias))

    await eventually(reached, timeout=timeout, interval=0.25)
    return time.monotonic() - start


@dataclass
class Requests:
    """Every request sent, and how it ended: answered (complete), a documented error, or lost."""

    sent: int = 0
    answered: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    served_by: Counter[str] = field(default_factory=Counter)
    instances: Counter[str] = field(default_factory=Counter)

    @property
    def lost(self) -> int:
        return self.sent - self.answered - sum(self.errors.values())


async def one(client: httpx.AsyncClient, alias: str, tally: Requests, *, stream: bool, max_tokens: int = 16) -> None:
    body = {"model": alias, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": "Tell me about lighthouses."}]}
    tally.sent += 1
    try:
        async with client.stream("POST", "/chat/completions", json=body) as response:
            text = (await response.aread()).decode(errors="replace")
            if response.status_code != 200:
                assert '"error"' in text, f"an error without an OpenAI body: {response.status_code} {text[:200]}"
                tally.errors[f"http {response.status_code}"] += 1
                return
            if stream:
                if '"error"' in text:  # an OpenAI-style error event ended the stream
                    tally.errors["stream error"] += 1
                    return
                assert text.rstrip().endswith("data: [DONE]"), text[-200:]
            served = dict(response.headers)
            if "x-modelpool-instance" not in served:  # a held stream says who served it in an SSE comment
                comment = next(line for line in text.splitlines() if line.startswith(": modelpool instance="))
                served = {f"x-modelpool-{k}": v for k, v in (part.split("=", 1) for part in comment[12:].split())}
            tally.served_by[served["x-modelpool-backend"]] += 1
            tally.instances[served["x-modelpool-instance"]] += 1
    except httpx.HTTPError as exc:  # the connection broke: not a documented error
        raise AssertionError(f"request broke without an answer: {exc!r}") from exc
    tally.answered += 1


async def steady_load(url: str, alias: str, tally: Requests, *, concurrency: int, seconds: float,
                      max_tokens: int = 16, stream_every: int = 2, think_s: float = 0.0, seed: int = 0) -> None:
    """`concurrency` clients sending one request after another (every `stream_every`-th one streamed),
    each pausing a random time up to `think_s` between requests: noise on a steady level."""
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    timeout = httpx.Timeout(connect=10.0, read=120.0, write=10.0, pool=None)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        async def client_loop(k: int) -> None:
            n = k
            while time.monotonic() < deadline:
                await one(client, alias, tally, stream=n % stream_every == 0, max_tokens=max_tokens)
                n += 1
                if think_s:
                    await asyncio.sleep(rng.uniform(0, think_s))

        await asyncio.gather(*(client_loop(k) for k in range(concurrency)))


def instance_rows(events) -> dict[str, dict[str, Any]]:
    """Instances as the log says they are now (id -> last transition's payload)."""
    rows: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.type == "InstanceStateChanged":
            rows[e.payload["instance_id"]] = e.payload
    return {k: v for k, v in rows.items() if v["to_state"] != "ABSENT"}
