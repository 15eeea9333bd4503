"""The simulated engine's streamed answers: pre-encoded SSE frames and the two streamers that write them.

A stream is written straight to ASGI `send`, one write per batch of ready tokens,
from frames encoded once per stream (every token event is head + word + tail), so
thousands of streams cost the engine little beside the decode model. `TokenStream`
serves one choice, `ChoicesStream` several (`n`, logprobs); both cancel their
sequences when the client leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from services.engines.simulated import shaping
from services.engines.simulated.driver import Generation
from services.engines.simulated.shaping import Shape
from shared.engine_asgi import RAW_SEND_KEY
from shared.openai_protocol import (
    SSE_DONE,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    Usage,
    sse,
)

if TYPE_CHECKING:
    from services.engines.simulated.app import EngineServer

_TOKEN_MARK = "@@modelpool-token@@"


@dataclass(frozen=True)
class StreamFrames:
    """Pre-encoded SSE bytes of one stream: every token event is head + word + tail."""

    opening: bytes
    head: bytes
    tail: bytes
    closing: Callable[[str, Usage | None], bytes]


def _split_template(chunk: BaseModel) -> tuple[bytes, bytes]:
    head, tail = sse(chunk).split(_TOKEN_MARK.encode())
    return head, tail


def chat_frames(rid: str, created: int, model: str, fingerprint: str) -> StreamFrames:
    def chunk(delta: ChatDelta | None = None, finish: str | None = None, usage: Usage | None = None,
              choices: bool = True) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=rid, created=created, model=model,
            choices=[ChatChunkChoice(delta=delta or ChatDelta(), finish_reason=finish)] if choices else [],
            usage=usage, system_fingerprint=fingerprint,
        )

    head, tail = _split_template(chunk(ChatDelta(content=_TOKEN_MARK)))

    def closing(reason: str, usage: Usage | None) -> bytes:
        out = sse(chunk(finish=reason))
        if usage is not None:
            out += sse(chunk(usage=usage, choices=False))
        return out + SSE_DONE

    return StreamFrames(sse(chunk(ChatDelta(role="assistant", content=""))), head, tail, closing)


def completion_frames(rid: str, created: int, model: str, fingerprint: str, echo: str | None) -> StreamFrames:
    def chunk(text: str = "", finish: str | None = None, usage: Usage | None = None,
              choices: bool = True) -> CompletionResponse:
        return CompletionResponse(
            id=rid, created=created, model=model,
            choices=[CompletionChoice(text=text, finish_reason=finish)] if choices else [],
            usage=usage, system_fingerprint=fingerprint,
        )

    head, tail = _split_template(chunk(_TOKEN_MARK))

    def closing(reason: str, usage: Usage | None) -> bytes:
        out = sse(chunk(finish=reason))
        if usage is not None:
            out += sse(chunk(usage=usage, choices=False))
        return out + SSE_DONE

    return StreamFrames(sse(chunk(echo)) if echo else b"", head, tail, closing)


class TokenStream:
    """SSE response written straight to ASGI `send`, one write per batch of ready tokens.

    A second, idle task waits for the client's disconnect and cancels the
    request in the decode system, which frees its KV memory at once.
    """

    raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    def __init__(self, server: "EngineServer", gen: Generation, frames: StreamFrames, include_usage: bool):
        self._server = server
        self._gen = gen
        self._frames = frames
        self._include_usage = include_usage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server, gen, frames = self._server, self._gen, self._frames
        driver = server.driver
        token = server.filler.token
        head, tail, seed = frames.head, frames.tail, gen.text_seed
        watcher = asyncio.ensure_future(server.cancel_on_disconnect(receive, gen))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            # Body chunks skip the framework's per-message wrappers (they only watch the start message).
            send = scope.get(RAW_SEND_KEY, send)
            if frames.opening:
                await send({"type": "http.response.body", "body": frames.opening, "more_body": True})
            sent = 0
            while True:
                if gen.emitted == sent and gen.finish_reason is None:
                    await driver.wait(gen)
                ready = gen.emitted
                body = b"".join([head + token(seed, i) + tail for i in range(sent, ready)]) if ready > sent else b""
                sent = ready
                reason = gen.finish_reason
                if reason is None:
                    if body:
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                    continue
                if reason != "abort":
                    usage = server.usage(gen) if self._include_usage else None
                    body += frames.closing(reason, usage)
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
        finally:
            watcher.cancel()
            if gen.finish_reason is None:
                driver.cancel(gen)


class ChoicesStream:
    """The SSE answer of `n` sequences, a tool call, a JSON answer, or one with log-probabilities.

    Each token is its own chunk, built whole (the fast path's pre-encoded frames
    hold one plain-text choice only). A tool call streams as vLLM streams it: the
    call's id and name with the first piece of its arguments, then the rest.
    """

    raw_headers = TokenStream.raw_headers

    def __init__(self, server: "EngineServer", choices: list[tuple[Generation, Shape | None]], k: int | None,
                 rid: str, created: int, model: str, include_usage: bool) -> None:
        self._server = server
        self._choices = choices
        self._k = k
        self._head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                      "system_fingerprint": server.engine}
        self._include_usage = include_usage

    def _chunk(self, index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return b"data: " + orjson.dumps({**self._head, "choices": [choice]}) + b"\n\n"

    def _token(self, index: int, gen: Generation, shape: Shape | None, position: int) -> bytes:
        text = self._server.token_text(gen, shape, position)
        if shape and shape.tool_name:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if position == 0:
                call = {"index": 0, "id": shape.call_id, "type": "function",
                        "function": {"name": shape.tool_name, "arguments": text}}
            delta: dict[str, Any] = {"tool_calls": [call]}
        else:
            delta = {"content": text}
        logprobs = None
        if self._k is not None:
            logprobs = {"content": [shaping.logprob_entry(text, gen.text_seed, position, self._k, self._server.filler)]}
        return self._chunk(index, delta, logprobs=logprobs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server, choices = self._server, self._choices
        gens = [gen for gen, _ in choices]
        watcher = asyncio.ensure_future(server.cancel_on_disconnect(receive, *gens))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            send = scope.get(RAW_SEND_KEY, send)
            opening = b"".join(self._chunk(i, {"role": "assistant", "content": None if shape and shape.tool_name else ""})
                               for i, (_, shape) in enumerate(choices))
            await send({"type": "http.response.body", "body": opening, "more_body": True})
            sent = [0] * len(choices)
            closed = [False] * len(choices)
            while True:
                waiting = [g for i, g in enumerate(gens) if g.emitted == sent[i] and g.finish_reason is None]
                if len(waiting) == len([c for c in closed if not c]) and waiting:
                    await server.driver.wait(waiting[0])
                body = b""
                for i, (gen, shape) in enumerate(choices):
                    ready = gen.emitted
                    body += b"".join(self._token(i, gen, shape, position) for position in range(sent[i], ready))
                    sent[i] = ready
                    if gen.finish_reason == "abort":  # the engine gave up: the stream ends unfinished
                        await send({"type": "http.response.body", "body": body, "more_body": False})
                        return
                    if gen.finish_reason is not None and not closed[i]:
                        finish = "tool_calls" if shape and shape.tool_name and gen.finish_reason == "stop" else gen.finish_reason
                        body += self._chunk(i, {}, finish)
                        closed[i] = True
                if all(closed):
                    if self._include_usage:
                        usage = server.usage_of(gens).model_dump(exclude_none=True)
                        body += b"data: " + orjson.dumps({**self._head, "choices": [], "usage": usage}) + b"\n\n"
                    await send({"type": "http.response.body", "body": body + SSE_DONE, "more_body": False})
                    return
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            watcher.cancel()
            for gen in gens:
                if gen.finish_reason is None:
                    server.driver.cancel(gen)
