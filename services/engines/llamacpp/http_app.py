"""The OpenAI-compatible HTTP edge of the llama.cpp engine (Starlette; SSE written by hand, a stream's later token
chunks straight onto its socket by a writer thread: `token_wire`).

Every response carries `x-modelpool-engine: llama.cpp`, and `/v1/models` says
the same, so the pool can never mistake this engine for the simulated one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.client_gone import client_gone
from shared.engine_asgi import RAW_SEND_KEY, EngineHeader, error_response
from shared.openai_protocol import (
    SESSION_TAG_HEADER,
    SSE_DONE,
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    bad_request,
    internal_error,
    new_id,
    not_found_model,
    request_timeout,
    service_unavailable,
    sse,
    too_many_requests,
    validation_error,
)

from . import ENGINE_NAME
from .chat_template import ChatTemplate
from .engine import LlamaEngine
from .model_files import DEFAULT_MODEL_ALIAS
from .requests import EngineEvent, FinishEvent, RequestState, SamplingParams, TokenEvent
from .scheduler import LengthLimitExceeded, QueueFull, effective_max_tokens
from .token_wire import ChunkWriter, EventRelay, plain_chunked_transport

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-modelpool-engine-request-id"
"""The engine's own request id (the key of /slots and /debug/steps)."""
TEXT_MARK = "modelpool-text-5f0c9e"
"""Stands for a token's text in the rendered chunk it is spliced into."""


def _one_choice(body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.n != 1:
        raise bad_request("the llama.cpp engine generates one choice per request (n = 1); send n requests",
                          param="n", code="unsupported_parameter")


class _Answer:
    """An admitted request's engine events as they come, until it finishes or its client leaves."""

    def __init__(self, engine: Any, request_id: int, relay: EventRelay, receive: Receive) -> None:
        self.engine, self.request_id, self.relay = engine, request_id, relay
        self.disconnected = asyncio.ensure_future(client_gone(receive))
        # The client's departure joins the engine's events: one plain `get` per token, no race set up each time.
        self.disconnected.add_done_callback(lambda _: relay.client_left())
        self.finished = False
        """The engine is done with the request (nothing to cancel)."""
        self.transport: asyncio.Transport | None = None
        """The client's socket, where the server lets token chunks be written onto it directly (`token_wire`)."""

    async def next(self) -> EngineEvent | None:
        """The next engine event, or None when the client went away first."""
        return await self.relay.next()

    def go_direct(self, chunk_before: bytes, chunk_after: bytes) -> None:
        """Hand the token chunks over to direct writes (`token_wire`), where the server and the stream allow."""
        if self.transport is not None:
            self.relay.go_direct(self.transport, chunk_before, chunk_after)

    def close(self) -> None:
        """Stop watching the client and writing to it; cancel the request in the engine unless it finished."""
        self.relay.close()
        self.disconnected.cancel()
        if not self.finished:
            self.engine.cancel(self.request_id)


class _SSEStream:
    """A hand-written SSE response that cancels the engine request when the client leaves."""

    def __init__(self, chunks: AsyncIterator[bytes], answer: _Answer) -> None:
        self._chunks = chunks
        self._answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                    (REQUEST_ID_HEADER.encode(), str(self._answer.request_id).encode()),
                ],
            }
        )
        # A token's body chunk skips the framework's per-message wrappers, which only watch the start message
        # (as the simulator's streams do).
        send = scope.get(RAW_SEND_KEY, send)
        self._answer.transport = plain_chunked_transport(send, scope)
        try:
            async for chunk in self._chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client is gone; closing the answer cancels the request
        finally:
            self._answer.close()


class EngineAPI:
    def __init__(self, engine: LlamaEngine, *, model_alias: str | None = None) -> None:
        self.engine = engine
        self.chunk_writer = ChunkWriter()
        """Writes the token chunks of streams handed over for direct writes (running while the app is)."""
        self.model_alias = model_alias or engine.settings.model_alias or self._alias_from_path()
        self.created = int(time.time())
        self._template: ChatTemplate | None = None

    def _alias_from_path(self) -> str:
        if self.engine.settings.model_path is None:
            return DEFAULT_MODEL_ALIAS
        return self.engine.model_path.stem

    def template(self) -> ChatTemplate:
        if self._template is None:
            backend = self.engine.backend
            assert backend is not None
            self._template = ChatTemplate(
                backend.chat_template(), bos_token=backend.token_text(backend.bos), eos_token=backend.token_text(backend.eos)
            )
        return self._template

    # -- routes ------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.engine.load_error:
            return error_response(service_unavailable(f"model failed to load: {self.engine.load_error}", code="load_failed"))
        if not self.engine.ready:
            return error_response(service_unavailable("model is loading", code="loading"))
        return JSONResponse({"status": "ok", "engine": ENGINE_NAME, "model": self.model_alias})

    async def models(self, request: Request) -> Response:
        card = ModelCard(
            id=self.model_alias,
            created=self.created,
            owned_by=ENGINE_NAME,
            engine=ENGINE_NAME,
            simulated=False,
            max_model_len=self.engine.backend.n_ctx_seq if self.engine.backend else self.engine.settings.ctx_per_seq,
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    async def metrics(self, request: Request) -> Response:
        text = self.engine.prometheus({"model": self.model_alias, "engine": ENGINE_NAME})
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def slots(self, request: Request) -> Response:
        return JSONResponse({"engine": ENGINE_NAME, "slots": self.engine.slots(), **self.engine.status()})

    async def steps(self, request: Request) -> Response:
        """The most recent decode steps' batch composition."""
        last = int(request.query_params.get("last", "50"))
        records = list(self.engine.step_log)[-last:] if last > 0 else []
        return JSONResponse(
            {
                "steps": [
                    {
                        "step_id": r.step_id,
                        "started_at": r.started_at,
                        "duration_ms": round(r.duration_s * 1000, 3),
                        "seqs": [{"seq_id": s, "request_id": q, "n_tokens": n, "kind": k} for s, q, n, k in r.seqs],
                    }
                    for r in records
                ]
            }
        )

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, self.chat_prompt, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, self.completion_prompt, chat=False)

    # -- shared request path -------------------------------------------------------
    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        _one_choice(body)
        for index, message in enumerate(body.messages):
            for part in message.content if isinstance(message.content, list) else ():
                if part.get("type") != "text":
                    # A text-only model: an image dropped silently would get a confident answer about nothing.
                    raise bad_request(f"this engine serves a text-only model; messages[{index}] has a "
                                      f"`{part.get('type')}` part, and only `text` parts are supported",
                                      param=f"messages[{index}].content", code="unsupported_content")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.template().render(messages, add_generation_prompt=body.add_generation_prompt,
                                          continue_final_message=body.continue_final_message)
        except Exception as exc:  # jinja raises on role orders the template refuses
            raise bad_request(f"the model's chat template rejected the messages: {exc}", param="messages") from exc
        return self._tokenize(text)

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        _one_choice(body)
        prompt = body.prompt_text()
        if isinstance(prompt, list):
            backend = self.engine.backend
            assert backend is not None
            bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < backend.n_vocab]
            if bad:
                raise bad_request(f"prompt token {bad[0]!r} is not in the vocabulary (0..{backend.n_vocab - 1})", param="prompt")
            return list(prompt)
        return self._tokenize(prompt)

    @staticmethod
    def _cache_prompt(body: Any) -> bool:
        """llama.cpp server's `cache_prompt` extension: false recomputes the whole prompt."""
        value = (body.model_extra or {}).get("cache_prompt", True)
        if not isinstance(value, bool):
            raise bad_request("cache_prompt must be true or false", param="cache_prompt")
        return value

    def _logit_bias(self, body: Any) -> tuple[tuple[int, float], ...]:
        raw = getattr(body, "logit_bias", None) or (body.model_extra or {}).get("logit_bias") or {}
        if not isinstance(raw, dict):
            raise bad_request("logit_bias must map token ids to numbers", param="logit_bias")
        n_vocab = self.engine.backend.n_vocab  # type: ignore[union-attr]
        out: list[tuple[int, float]] = []
        for key, value in raw.items():
            try:
                token, bias = int(key), float(value)
            except (TypeError, ValueError):
                raise bad_request(f"logit_bias entry {key!r}: {value!r} is not token id -> number", param="logit_bias") from None
            if not 0 <= token < n_vocab or not -100 <= bias <= 100:
                raise bad_request(
                    f"logit_bias entry {key!r}: token ids lie in 0..{n_vocab - 1} and biases in [-100, 100]",
                    param="logit_bias",
                )
            # OpenAI's -100 means "never": make it exact rather than merely unlikely.
            out.append((token, float("-inf") if bias <= -100 else bias))
        return tuple(out)

    def _tokenize(self, text: str) -> list[int]:
        backend = self.engine.backend
        assert backend is not None
        bos_text = backend.token_text(backend.bos) if backend.add_bos else ""
        # A template that writes BOS itself must not get a second one from the tokenizer.
        add_special = not (bos_text and text.startswith(bos_text))
        return backend.tokenize(text, add_special=add_special, parse_special=True)

    async def _serve(self, request: Request, model: type[BaseModel], build_prompt: Callable[[Any], list[int]], *, chat: bool) -> Response:
        """Admit the request, wait for its first event (so a request that fails before it gets its status), then
        answer it streamed or whole."""
        try:
            body, prompt, request_id, relay = await self._admit(request, model, build_prompt, chat=chat)
        except APIError as err:
            return error_response(err)
        answer = _Answer(self.engine, request_id, relay, request.receive)
        first = await answer.next()
        if first is None:
            answer.close()
            return Response(status_code=499)
        if isinstance(first, FinishEvent) and first.state != RequestState.COMPLETED:
            answer.finished = True
            answer.close()
            return error_response(self._finish_error(first))
        response_id, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
        if body.stream:
            return _SSEStream(self._chunks(answer, first, body, response_id, created, chat=chat), answer)  # type: ignore[return-value]
        return await self._whole(answer, first, body, prompt, response_id, created, chat=chat)

    async def _admit(self, request: Request, model: type[BaseModel], build_prompt: Callable[[Any], list[int]], *,
                     chat: bool) -> tuple[Any, list[int], int, EventRelay]:
        """Parse and check the request, and submit it to the engine: (body, prompt, request id, its events)."""
        try:
            payload = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(payload, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            body: Any = model.model_validate(payload)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        if body.model != self.model_alias:
            raise not_found_model(body.model)
        if not self.engine.ready:
            raise service_unavailable("model is loading", code="loading")
        prompt = build_prompt(body)
        s = self.engine.settings
        try:
            max_tokens = effective_max_tokens(
                len(prompt),
                body.output_limit(),
                max_input=s.max_input_tokens,
                max_output=s.max_output_tokens,
                ctx_per_seq=self.engine.backend.n_ctx_seq,  # type: ignore[union-attr]
            )
        except LengthLimitExceeded as exc:
            raise bad_request(str(exc), param=exc.param if chat or exc.param != "messages" else "prompt", code="context_length_exceeded") from exc
        sampling = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if not body.top_k or body.top_k < 0 else body.top_k,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            max_tokens=max_tokens,
            stop=tuple(body.stop_list()),
            logit_bias=self._logit_bias(body),
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
        )
        relay = EventRelay(asyncio.get_running_loop(), self.engine.metrics, self.chunk_writer)
        try:
            request_id = self.engine.submit(prompt, sampling, relay, reuse_prefix=self._cache_prompt(body),
                                            session=request.headers.get(SESSION_TAG_HEADER, ""))
        except QueueFull as exc:
            raise too_many_requests(str(exc), exc.retry_after_s) from exc
        return body, prompt, request_id, relay

    async def _chunks(self, answer: _Answer, first: EngineEvent, body: Any, response_id: str, created: int, *,
                      chat: bool) -> AsyncIterator[bytes]:
        """The streamed answer's SSE events, from the first engine event to `[DONE]` (none if the client left)."""
        render = self._chat_chunk if chat else self._completion_chunk
        if chat:
            yield sse(self._chat_chunk(response_id, created, ChatDelta(role="assistant", content=""), None))
        # Every token's event is the same chunk but for its text: rendered once, the text spliced in.
        before, after = sse(render(response_id, created, TEXT_MARK, None)).split(f'"{TEXT_MARK}"'.encode())
        event: EngineEvent | None = first
        while event is not None:
            if isinstance(event, TokenEvent):
                if event.text:
                    yield before + orjson.dumps(event.text) + after
                answer.go_direct(before, after)
            else:
                answer.finished = True
                if event.state != RequestState.COMPLETED:
                    yield sse(self._finish_error(event).to_dict())
                    break
                yield sse(render(response_id, created, event.text, event.finish_reason))
                if body.include_usage_in_stream():
                    usage = Usage.of(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
                    yield sse(self._usage_chunk(response_id, created, usage, chat))
                break
            event = await answer.next()
        if answer.finished:
            yield SSE_DONE

    async def _whole(self, answer: _Answer, first: EngineEvent, body: Any, prompt: list[int], response_id: str,
                     created: int, *, chat: bool) -> Response:
        """The answer in one JSON body, once the engine finished it (499 if the client left first)."""
        parts: list[str] = []
        event: EngineEvent | None = first
        while not isinstance(event, FinishEvent):
            if event is None:
                answer.close()
                return Response(status_code=499)
            parts.append(event.text)
            event = await answer.next()
        answer.finished = True
        answer.close()
        if event.state != RequestState.COMPLETED:
            return error_response(self._finish_error(event))
        parts.append(event.text)
        text = "".join(parts)
        usage = Usage.of(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
        reason = event.finish_reason or "stop"
        if chat:
            out: BaseModel = ChatCompletionResponse(
                id=response_id,
                created=created,
                model=self.model_alias,
                choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=reason)],  # type: ignore[arg-type]
                usage=usage,
                system_fingerprint=ENGINE_NAME,
            )
        else:
            if body.echo:
                text = self.engine.backend.detokenize(prompt) + text  # type: ignore[union-attr]
            out = CompletionResponse(
                id=response_id,
                created=created,
                model=self.model_alias,
                choices=[CompletionChoice(text=text, finish_reason=reason)],  # type: ignore[arg-type]
                usage=usage,
                system_fingerprint=ENGINE_NAME,
            )
        return Response(
            out.model_dump_json(exclude_none=True),
            media_type="application/json",
            headers={REQUEST_ID_HEADER: str(answer.request_id)},
        )

    def _finish_error(self, event: FinishEvent) -> APIError:
        if event.state == RequestState.TIMEOUT:
            return request_timeout(event.message or "the request timed out")
        return internal_error(event.message or f"the request ended in state {event.state}")

    def _chat_chunk(self, rid: str, created: int, delta: ChatDelta | str, reason: str | None) -> ChatCompletionChunk:
        if isinstance(delta, str):
            delta = ChatDelta(content=delta) if delta else ChatDelta()
        return ChatCompletionChunk(
            id=rid,
            created=created,
            model=self.model_alias,
            choices=[ChatChunkChoice(delta=delta, finish_reason=reason)],  # type: ignore[arg-type]
            system_fingerprint=ENGINE_NAME,
        )

    def _completion_chunk(self, rid: str, created: int, text: str, reason: str | None) -> CompletionResponse:
        return CompletionResponse(
            id=rid,
            created=created,
            model=self.model_alias,
            choices=[CompletionChoice(text=text, finish_reason=reason)],  # type: ignore[arg-type]
            system_fingerprint=ENGINE_NAME,
        )

    def _usage_chunk(self, rid: str, created: int, usage: Usage, chat: bool) -> BaseModel:
        if chat:
            return ChatCompletionChunk(id=rid, created=created, model=self.model_alias, choices=[], usage=usage, system_fingerprint=ENGINE_NAME)
        return CompletionResponse(id=rid, created=created, model=self.model_alias, choices=[], usage=usage, system_fingerprint=ENGINE_NAME)


def build_app(engine: LlamaEngine, *, model_alias: str | None = None, manage_engine: bool = True) -> ASGIApp:
    """The ASGI app. With `manage_engine`, the app starts the engine on startup and stops it on shutdown."""
    api = EngineAPI(engine, model_alias=model_alias)
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        api.chunk_writer.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.get_running_loop().run_in_executor(None, engine.stop)
            api.chunk_writer.stop()

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        return error_response(APIError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}", type=kind))

    async def crashed(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(internal_error(f"{type(exc).__name__}: {exc}"))

    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/slots", api.slots, methods=["GET"]),
        Route("/debug/steps", api.steps, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found, 500: crashed})
    app.state.api = api
    return EngineHeader(app, ENGINE_NAME)
