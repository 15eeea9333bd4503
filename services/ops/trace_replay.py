"""Replaying an agentic trace against any OpenAI endpoint, closed loop as agents send it, or open loop.

Closed loop, each session is its own client: turn 0 goes at its offset from the
start; each later turn only once the previous answer is complete, plus its tool
time. Turn k's messages are turn k-1's, the answer the endpoint gave, and
`new_input_tokens` words of new text, so prefix reuse is what it would be for a
real agent. Open loop, every request goes at the time it would if answers were
instant (its session's offset plus the tool times before it), whatever the
endpoint does; a turn's prompt then carries a stand-in for the answers it did
not wait for. A session that names a `shared_prefix_id` starts with that shared
system prompt. Every request carries its session in `x-session-id`.

`speedup` replays a trace for engines that run faster than real time (the
simulated engine's `--speedup`): tool times are divided by it and every time
reported is multiplied by it, so the summary is in the trace's own seconds.

What is measured per request: time to the first content, time per output token
after it, end to end, the prompt and cached tokens the engine reports, the
instance that served it and why the gateway chose it (its `x-modelpool-instance`
and `x-modelpool-route`).

The client is aiohttp's (`replay_client`): an open-loop replay keeps hundreds
of streams open at once, and a load generator whose own cost grows with them
(httpx's connection pool scans every connection on each request) would time
itself instead of the endpoint.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import mean, median

import aiohttp
import orjson

from services.ops.load import quantile
from shared.contracts.trace import SHARED_PREFIX_TOKENS, TraceRequest

WORDS = ("alpha", "bravo", "delta", "echo", "golf", "hotel", "india", "juliet", "kilo", "lima", "mike", "oscar", "papa",
         "quebec", "romeo", "sierra", "tango", "victor", "yankee", "zulu")
"""New text: common words, about one token each for a real tokenizer and exactly one for the simulator's estimate
(no word longer than the six letters it takes as one token), so a prompt of n words is n tokens there."""


def new_text(session_id: str, turn: int, tokens: int) -> str:
    """`tokens` words of text, different for every session and turn (so only real reuse hits a cache)."""
    offset = zlib.crc32(f"{session_id}/{turn}".encode()) % len(WORDS)
    return f"[{session_id}/{turn}] " + " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(tokens))


def first_messages(r: TraceRequest) -> list[dict[str, str]]:
    """A session's opening: the shared system prompt it names, if any."""
    if r.shared_prefix_id is None:
        return []
    return [{"role": "system", "content": new_text(f"shared-{r.shared_prefix_id}", 0, SHARED_PREFIX_TOKENS)}]


@dataclass
class ReplayedRequest:
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
    route: str | None = None
    """Why the gateway sent it there (`x-modelpool-route`)."""


def replay_client(timeout_s: float, headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """A client for `Replay`: no bound on connections (open loop sends whatever is due), `timeout_s` per request."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


@dataclass
class Replay:
    base_url: str
    model: str
    client: aiohttp.ClientSession
    clock: Callable[[], float] = time.monotonic
    speedup: float = 1.0
    open_loop: bool = False
    served: list[ReplayedRequest] = field(default_factory=list)
    progress: Callable[[int], None] | None = None
    """Called with the number of requests answered so far, after each one."""
    answered: int = 0

    async def run(self, requests: list[TraceRequest]) -> float:
        """Replay every session at once; the wall time it took."""
        sessions: dict[str, list[TraceRequest]] = {}
        for r in requests:
            sessions.setdefault(r.session_id, []).append(r)
        began = self.clock()
        replay = self._open_session if self.open_loop else self._session
        await asyncio.gather(*(replay(turns, began) for turns in sessions.values()))
        return self.clock() - began

    async def _session(self, turns: list[TraceRequest], began: float) -> None:
        messages = first_messages(turns[0])
        ready_at = began
        for r in turns:
            await asyncio.sleep(max(0.0, ready_at + r.delay_s / self.speedup - self.clock()))
            messages.append({"role": "user", "content": new_text(r.session_id, r.turn, r.new_input_tokens)})
            answer = await self._send(r, messages)
            if answer is None:
                return  # the session cannot go on without its answer
            messages.append({"role": "assistant", "content": answer})
            ready_at = self.clock()

    async def _open_session(self, turns: list[TraceRequest], began: float) -> None:
        """Each turn at its time in the trace, without waiting for the one before."""
        messages = first_messages(turns[0])
        due, sends = began, []
        for r in turns:
            due += r.delay_s / self.speedup
            messages.append({"role": "user", "content": new_text(r.session_id, r.turn, r.new_input_tokens)})
            sends.append(asyncio.ensure_future(self._send_at(due, r, list(messages))))
            # The answer it will get is not known yet: the next turn carries a stand-in of its length.
            messages.append({"role": "assistant", "content": new_text(f"{r.session_id}-answer", r.turn, r.output_tokens)})
        await asyncio.gather(*sends)

    async def _send_at(self, due: float, r: TraceRequest, messages: list[dict[str, str]]) -> None:
        await asyncio.sleep(max(0.0, due - self.clock()))
        await self._send(r, messages)

    async def _send(self, r: TraceRequest, messages: list[dict[str, str]]) -> str | None:
        record = ReplayedRequest(r.session_id, r.turn, self.clock())
        self.served.append(record)
        body = {"model": self.model, "messages": messages, "max_tokens": r.output_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        parts: list[str] = []
        try:
            async with self.client.post(f"{self.base_url}/v1/chat/completions", data=orjson.dumps(body),
                                        headers={"x-session-id": r.session_id,
                                                 "content-type": "application/json"}) as response:
                record.status = response.status
                record.instance = response.headers.get("x-modelpool-instance")
                record.route = response.headers.get("x-modelpool-route")
                if response.status != 200:
                    record.error = (await response.read()).decode(errors="replace")[:300]
                    return None
                async for line in response.content:
                    if not line.startswith(b"data: {"):
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
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            record.error = repr(exc)
            return None
        record.done = self.clock()
        self.answered += 1
        if self.progress is not None:
            self.progress(self.answered)
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


def apc_bounds(ok: list[ReplayedRequest], requests: list[TraceRequest]) -> tuple[int, int]:
    """The most a prefix cache could have reused of the answered prompts: inside sessions, and across any of them.

    Inside a session, each later turn could reuse its predecessor's prompt and
    answer. Across sessions, a session's first turn could also reuse the system
    prompt it shares with a session that was sent before it.
    """
    by_turn = {(s.session_id, s.turn): s for s in ok}
    intra = sum(min(s.prompt_tokens, prev.prompt_tokens + prev.completion_tokens) for s in ok
                if (prev := by_turn.get((s.session_id, s.turn - 1))) is not None)
    shared = {(r.session_id, r.turn): r.shared_prefix_id for r in requests if r.turn == 0 and r.shared_prefix_id}
    seen: set[str] = set()
    across = 0
    for s in sorted(ok, key=lambda s: s.sent):
        prefix = shared.get((s.session_id, s.turn))
        if prefix is not None:
            if prefix in seen:
                across += min(s.prompt_tokens, SHARED_PREFIX_TOKENS)
            seen.add(prefix)
    return intra, intra + across


def instance_changes(ok: list[ReplayedRequest]) -> tuple[int, list[tuple[str, float]]]:
    """Turns served elsewhere than their session's previous turn, and when (session, sent) each was."""
    last: dict[str, str] = {}
    changes: list[tuple[str, float]] = []
    for s in sorted(ok, key=lambda s: (s.session_id, s.turn)):
        if s.instance is None:
            continue
        if s.session_id in last and last[s.session_id] != s.instance:
            changes.append((s.session_id, s.sent))
        last[s.session_id] = s.instance
    return len(changes), changes


def summarise(served: list[ReplayedRequest], requests: list[TraceRequest], wall_s: float, speedup: float = 1.0) -> dict:
    """Every number of the replay, in the trace's own seconds (wall seconds times `speedup`)."""
    ok = [s for s in served if s.done is not None and s.error is None]
    ttft = [(s.first - s.sent) * speedup for s in ok if s.first is not None]
    tpot = [(s.done - s.first) * speedup / (s.completion_tokens - 1) for s in ok
            if s.first is not None and s.completion_tokens > 1]
    prompts = sum(s.prompt_tokens for s in ok)
    intra, any_session = apc_bounds(ok, requests)
    per_instance: dict[str, list[float]] = {}
    for s in ok:
        if s.first is not None and s.instance:
            per_instance.setdefault(s.instance, []).append((s.first - s.sent) * speedup)
    instance_p90 = {i: quantile(v, 0.9) for i, v in sorted(per_instance.items())}
    span = trace_span_s(requests)
    changes, _ = instance_changes(ok)
    return {
        "requests": len(requests), "answered": len(ok), "failed": len(served) - len(ok),
        "not_sent": len(requests) - len(served), "speedup": speedup,
        "ttft_s": _stats(ttft), "tpot_s": _stats(tpot), "e2e_s": _stats([(s.done - s.sent) * speedup for s in ok]),
        "apc": round(sum(s.cached_tokens for s in ok) / prompts, 4) if prompts else None,
        "apc_upper_bound_intra_session": round(intra / prompts, 4) if prompts else None,
        "apc_upper_bound_any_session": round(any_session / prompts, 4) if prompts else None,
        "instance_ttft_p90_s": {"instances": len(instance_p90),
                                "median": round(median(instance_p90.values()), 4) if instance_p90 else None,
                                "max": round(max(instance_p90.values()), 4) if instance_p90 else None,
                                "each": {i: round(v, 4) for i, v in instance_p90.items()}},
        "instance_changes_per_request": round(changes / len(ok), 4) if ok else None,
        "wall_s": round(wall_s, 3), "trace_span_s": round(span, 3),
        "amplification": round(wall_s * speedup / span, 3) if span else None,
        "errors": sorted({s.error for s in served if s.error})[:5],
    }
