"""Replaying an agentic trace against any OpenAI endpoint, closed loop, as agents send it.

Each session is its own client: turn 0 goes at its offset from the start; each
later turn only once the previous answer is complete, plus its tool time. Turn
k's messages are turn k-1's, the answer the endpoint gave, and `new_input_tokens`
words of new text, so prefix reuse is what it would be for a real agent. Every
request carries its session in `x-session-id`.

What is measured per request: time to the first content, time per output token
after it, end to end, the prompt and cached tokens the engine reports, and the
instance that served it (the gateway's `x-modelpool-instance`).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import mean, median

import httpx
import orjson

from services.ops.load import quantile
from shared.contracts.trace import TraceRequest

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
         "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey")
"""New text: common words, about one token each for a real tokenizer as for the simulator's estimate."""


def new_text(session_id: str, turn: int, tokens: int) -> str:
    """`tokens` words of text, different for every session and turn (so only real reuse hits a cache)."""
    offset = zlib.crc32(f"{session_id}/{turn}".encode()) % len(WORDS)
    return f"[{session_id}/{turn}] " + " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(tokens))


@dataclass
class Served:
    """One replayed request as it went."""

    session_id: str
    turn: int
    sent: float
    first: float | None = None
    done: float | None = None
    status: int | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    instance: str | None = None


@dataclass
class Replay:
    base_url: str
    model: str
    client: httpx.AsyncClient
    clock: Callable[[], float] = time.monotonic
    served: list[Served] = field(default_factory=list)

    async def run(self, requests: list[TraceRequest]) -> float:
        """Replay every session at once, each closed loop; the wall time it took."""
        sessions: dict[str, list[TraceRequest]] = {}
        for r in requests:
            sessions.setdefault(r.session_id, []).append(r)
        began = self.clock()
        await asyncio.gather(*(self._session(turns, began) for turns in sessions.values()))
        return self.clock() - began

    async def _session(self, turns: list[TraceRequest], began: float) -> None:
        messages: list[dict[str, str]] = []
        ready_at = began
        for r in turns:
            await asyncio.sleep(max(0.0, ready_at + r.delay_s - self.clock()))
            messages.append({"role": "user", "content": new_text(r.session_id, r.turn, r.new_input_tokens)})
            answer = await self._send(r, messages)
            if answer is None:
                return  # the session cannot go on without its answer
            messages.append({"role": "assistant", "content": answer})
            ready_at = self.clock()

    async def _send(self, r: TraceRequest, messages: list[dict[str, str]]) -> str | None:
        record = Served(r.session_id, r.turn, self.clock())
        self.served.append(record)
        body = {"model": self.model, "messages": messages, "max_tokens": r.output_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        parts: list[str] = []
        try:
            async with self.client.stream("POST", f"{self.base_url}/v1/chat/completions", json=body,
                                          headers={"x-session-id": r.session_id}) as response:
                record.status = response.status_code
                record.instance = response.headers.get("x-modelpool-instance")
                if response.status_code != 200:
                    record.error = (await response.aread()).decode(errors="replace")[:300]
                    return None
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        record.error = str(chunk["error"].get("message"))
                        return None
                    for choice in chunk.get("choices") or ():
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            record.first = record.first or self.clock()
                            parts.append(content)
                    usage = chunk.get("usage")
                    if usage:
                        record.prompt_tokens = usage.get("prompt_tokens") or 0
                        record.completion_tokens = usage.get("completion_tokens") or 0
                        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        except httpx.HTTPError as exc:
            record.error = repr(exc)
            return None
        record.done = self.clock()
        return "".join(parts)


def trace_span_s(requests: list[TraceRequest]) -> float:
    """How long the trace lasts if every answer were instant: its sessions' starts plus their tool times."""
    ends: dict[str, float] = {}
    for r in requests:
        ends[r.session_id] = ends.get(r.session_id, 0.0) + r.delay_s
    return max(ends.values(), default=0.0)


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": round(mean(values), 4), "p50": round(quantile(values, 0.5), 4),
            "p90": round(quantile(values, 0.9), 4), "p99": round(quantile(values, 0.99), 4)}


def summarise(served: list[Served], requests: list[TraceRequest], wall_s: float) -> dict:
    ok = [s for s in served if s.done is not None and s.error is None]
    ttft = [s.first - s.sent for s in ok if s.first is not None]
    tpot = [(s.done - s.first) / (s.completion_tokens - 1) for s in ok
            if s.first is not None and s.completion_tokens > 1]
    prompts = sum(s.prompt_tokens for s in ok)
    # The most a prefix cache could reuse inside sessions: each later turn's previous prompt and answer.
    by_turn = {(s.session_id, s.turn): s for s in ok}
    reusable = sum(min(s.prompt_tokens, prev.prompt_tokens + prev.completion_tokens) for s in ok
                   if (prev := by_turn.get((s.session_id, s.turn - 1))) is not None)
    per_instance: dict[str, list[float]] = {}
    for s in ok:
        if s.first is not None and s.instance:
            per_instance.setdefault(s.instance, []).append(s.first - s.sent)
    instance_p90 = [quantile(v, 0.9) for v in per_instance.values()]
    span = trace_span_s(requests)
    return {
        "requests": len(requests), "answered": len(ok), "failed": len(served) - len(ok),
        "not_sent": len(requests) - len(served),
        "ttft_s": _stats(ttft), "tpot_s": _stats(tpot), "e2e_s": _stats([s.done - s.sent for s in ok]),
        "apc": round(sum(s.cached_tokens for s in ok) / prompts, 4) if prompts else None,
        "apc_upper_bound_intra_session": round(reusable / prompts, 4) if prompts else None,
        "instance_ttft_p90_s": {"instances": len(instance_p90),
                                "median": round(median(instance_p90), 4) if instance_p90 else None,
                                "max": round(max(instance_p90), 4) if instance_p90 else None},
        "wall_s": round(wall_s, 3), "trace_span_s": round(span, 3),
        "amplification": round(wall_s / span, 3) if span else None,
        "errors": sorted({s.error for s in served if s.error})[:5],
    }
