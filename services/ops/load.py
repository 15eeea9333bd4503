"""`modelpool load ALIAS`: steady concurrent load on the gateway, to watch the pool respond.

N clients each send one streaming chat completion after another for the given
time. Every few seconds it prints what it sees: answers, errors, TTFT and E2E
percentiles, tokens/s, and which backend and engine served (from the gateway's
`x-modelpool-backend` / `x-modelpool-engine` headers). The last line is a JSON
summary. Any OpenAI-compatible endpoint works (`--url`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from shared.openai_protocol import ENGINE_HEADER
from shared.settings import Settings, local_cluster

PROMPTS = (
    "Explain in three sentences why the sky is blue.",
    "Write a short poem about a lighthouse.",
    "List five uses of a paperclip.",
    "What is the capital of France, and what is it known for?",
    "Describe how a bicycle works.",
)


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class StreamAnswer:
    """A streamed answer as it arrived: when its first content token came, how many, who served it."""

    backend: str | None
    engine: str | None
    first_at: float | None = None
    tokens: int = 0
    error: str | None = None
    """The code of the error event that ended the stream, if one did."""


async def read_stream(response: httpx.Response, clock: Callable[[], float] = time.monotonic) -> StreamAnswer:
    """Read a 200 SSE answer from the gateway to its end.

    Who served it is in the `x-modelpool-*` headers, or, for a stream held through
    a cold start (its headers went out before an instance was chosen), in the
    `: modelpool instance=... backend=... engine=...` comment that precedes its data.
    """
    answer = StreamAnswer(response.headers.get("x-modelpool-backend"), response.headers.get(ENGINE_HEADER))
    async for line in response.aiter_lines():
        if line.startswith(": modelpool instance="):
            served = dict(part.split("=", 1) for part in line.split() if "=" in part)
            answer.backend, answer.engine = served.get("backend"), served.get("engine")
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            answer.error = chunk["error"].get("code") or "stream error"
            return answer
        if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
            if answer.first_at is None:
                answer.first_at = clock()
            answer.tokens += 1
    return answer


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    served_by: Counter[str] = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tokens: int = 0

    def summary(self, seconds: float) -> dict:
        return {
            "sent": self.sent, "answered": self.answered, "errors": dict(self.errors),
            "lost": self.sent - self.answered - sum(self.errors.values()),
            "served_by": dict(self.served_by),
            "ttft_p50_s": quantile(self.ttft, 0.5), "ttft_p95_s": quantile(self.ttft, 0.95),
            "e2e_p50_s": quantile(self.e2e, 0.5), "e2e_p95_s": quantile(self.e2e, 0.95),
            "tokens_per_s": round(self.tokens / seconds, 1) if seconds else 0.0,
        }


async def one_request(client: httpx.AsyncClient, alias: str, max_tokens: int, n: int, tally: Tally) -> None:
    body = {"model": alias, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}]}
    tally.sent += 1
    start = time.monotonic()
    try:
        async with client.stream("POST", "/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                tally.errors[f"http {response.status_code}"] += 1
                return
            answer = await read_stream(response)
    except httpx.HTTPError as exc:
        tally.errors[type(exc).__name__] += 1
        return
    tally.tokens += answer.tokens
    if answer.error:
        tally.errors[answer.error] += 1
        return
    tally.served_by[f"{answer.backend or '?'} ({answer.engine or '?'})"] += 1
    tally.answered += 1
    tally.e2e.append(time.monotonic() - start)
    if answer.first_at is not None:
        tally.ttft.append(answer.first_at - start)


async def run(url: str, alias: str, concurrency: int, seconds: float, max_tokens: int, every_s: float) -> dict:
    tally = Tally()
    start = time.monotonic()
    deadline = start + seconds
    timeout = httpx.Timeout(connect=10.0, read=300.0, write=10.0, pool=None)

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def client_loop(k: int) -> None:
            n = k
            while time.monotonic() < deadline:
                await one_request(client, alias, max_tokens, n, tally)
                n += concurrency

        async def report() -> None:
            while True:
                await asyncio.sleep(every_s)
                s = tally.summary(time.monotonic() - start)
                p95 = f"{s['ttft_p95_s']:.2f}s" if s["ttft_p95_s"] is not None else "-"
                print(f"[{time.monotonic() - start:5.0f}s] answered {s['answered']}, errors {sum(s['errors'].values())}, "
                      f"TTFT p95 {p95}, {s['tokens_per_s']} tok/s, served by {s['served_by']}", file=sys.stderr, flush=True)

        reporter = asyncio.create_task(report())
        try:
            await asyncio.gather(*(client_loop(k) for k in range(concurrency)))
        finally:
            reporter.cancel()
    return tally.summary(time.monotonic() - start)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool load", description=__doc__.splitlines()[0])
    parser.add_argument("alias")
    parser.add_argument("--concurrency", type=int, default=4, help="clients sending one request after another (default 4)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long (default 30)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    parser.add_argument("--url", help="the OpenAI base URL (default: the local cluster's gateway)")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between progress lines (default 5)")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.seconds <= 0:
        parser.error("--concurrency must be >= 1 and --seconds > 0")
    url = args.url or local_cluster(os.environ).get("gateway")
    if not url:
        settings = Settings.load()
        url = f"http://{settings.gateway_host}:{settings.gateway_port}/v1"
    summary = asyncio.run(run(url, args.alias, args.concurrency, args.seconds, args.max_tokens, args.every))
    print(json.dumps(summary))
    return 0 if summary["lost"] == 0 else 1
