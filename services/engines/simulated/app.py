"""The simulated engine's HTTP server: the OpenAI API over the decode model, with vLLM's admin routes
(`vllm_admin.py`) or llama-server's (`llama_server.py`) as its profile has them.

Everything a client can see follows the real engine's protocol; nothing pretends
to be real inference: `/v1/models` says `engine: simulated-...` and
`simulated: true`, every response carries the `x-modelpool-engine` header, and
completions carry the engine name as `system_fingerprint`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import sys
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive

from services.engines.simulated import shaping, synthetic
from services.engines.simulated.config import EngineConfig
from services.engines.simulated.driver import Generation, RealTimeDriver
from services.engines.simulated.lifecycle import EngineState, Lifecycle
from services.engines.simulated.llama_server import llama_server_routes
from services.engines.simulated.metrics import EngineSnapshot, EngineStats, render_llamacpp, render_vllm
from services.engines.simulated.shaping import Shape
from services.engines.simulated.streams import ChoicesStream, TokenStream, chat_frames, completion_frames
from services.engines.simulated.vllm_admin import vllm_admin_routes
from shared.client_gone import client_gone
from shared.engine_asgi import EngineHeader, TraceRequests
from shared.openai_protocol import (
    APIError,
    ChatCompletionRequest,
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
    now_s,
    service_unavailable,
    validation_error,
)
from shared.telemetry import Telemetry
from simulation.prefix_cache import block_hashes

log = logging.getLogger(__name__)

class EngineServer:
    """State of one simulated engine; its bound methods are the HTTP routes."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = config.engine_name
        self.stats = EngineStats()
        self.lifecycle = Lifecycle(config)
        self.driver = RealTimeDriver(config, self.stats)
        self.filler = synthetic.FillerText.build()
        self._loader: asyncio.Task[None] | None = None
        self._next_id = 0
        self.telemetry: Telemetry | None = None
        """Set when spans are exported (`otlp_traces_endpoint`)."""

    # ------------------------------------------------------------ start/stop

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.driver.start()
        delay = self.config.startup_s / self.config.speedup
        if self.config.profile == "vllm":
            # vLLM binds its port only once the model is loaded; uvicorn binds after lifespan start-up.
            await asyncio.sleep(delay)
            self._loaded()
        else:
            self._loader = asyncio.ensure_future(self._load(delay))
        log.info("%s engine for %s ready to bind", self.engine, self.config.model)
        try:
            yield
        finally:
            if self._loader is not None:
                self._loader.cancel()
            await self.driver.stop()
            if self.telemetry is not None:
                self.telemetry.shutdown()  # the last spans go out

    async def _load(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._loaded()

    def _loaded(self) -> None:
        if self.config.fail_start:
            self._fail_start()
        self.lifecycle.loaded()

    def _fail_start(self) -> None:
        """End the process as an engine whose start failed: one clear line, then exit code 1.

        `os._exit` rather than an exception: uvicorn turns a failed lifespan into exit
        code 3 and a traceback, and the llama.cpp profile loads after it has bound its
        port, where no exception reaches uvicorn at all. So an engine told to fail
        must run in its own process (as `modelpool engine sim` does).
        """
        sys.stdout.flush()
        sys.stderr.write(f"modelpool: SIMULATED {self.config.profile} engine was told to fail its start "
                         f"(fail_start); exiting with code 1\n")
        sys.stderr.flush()
        os._exit(1)

    # ------------------------------------------------------------ helpers

    def require_serving(self) -> None:
        state = self.lifecycle.state
        if state is EngineState.AWAKE and not self.lifecycle.reloading:
            if self.lifecycle.weights_lost:
                # A real vLLM would answer with text computed from empty weights; refusing makes a wake that
                # skipped the reload visible.
                raise APIError(500, "the weights were discarded by sleep level 2 and never loaded again: a real vLLM "
                               "would answer garbage (POST /collective_rpc {\"method\": \"reload_weights\"} after "
                               "waking the weights)", type="api_error", code="weights_not_loaded")
            return
        if state is EngineState.LOADING:
            raise APIError(503, "Loading model", type="unavailable_error", code=503)
        if state is EngineState.DRAINING:
            raise service_unavailable(
                f"engine is going to sleep (level {self.lifecycle.level}); request refused", code="engine_sleeping")
        if state is EngineState.WAKING or self.lifecycle.reloading:
            raise service_unavailable("engine is waking up; retry shortly", code="engine_waking")
        raise service_unavailable(
            f"engine is sleeping (level {self.lifecycle.level}); POST /wake_up before sending requests",
            code="engine_sleeping")

    def _check_model(self, model: str) -> None:
        if model != self.config.model:
            raise not_found_model(model)

    async def _parse(self, request: Request, model_cls: type[BaseModel]) -> Any:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise bad_request("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        try:
            return model_cls.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None

    def _generation(self, tokens: list[str] | list[int], limit: int | None, seed: int | None,
                    ignore_eos: bool, param: str, index: int = 0,
                    shape_for: Callable[[int], Shape | None] | None = None) -> tuple[Generation, Shape | None]:
        """One sequence of the answer (`index` of the `n` asked for) and, when the request asks for JSON or a
        tool call, its shape: then the answer is exactly the shape's tokens, cut only by the limits."""
        config = self.config
        prompt_tokens = len(tokens)
        if prompt_tokens == 0:
            raise bad_request("the prompt is empty", param=param)
        max_len = config.max_model_len
        if prompt_tokens >= max_len or (limit is not None and prompt_tokens + limit > max_len):
            asked = prompt_tokens + (limit or 0)
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens. However, you requested {asked} "
                f"tokens ({prompt_tokens} in the {param}, {limit or 0} in the completion). "
                f"Please reduce the length of the {param} or completion.",
                param=param, code="context_length_exceeded")
        room = max_len - prompt_tokens
        text_seed = synthetic.stable_seed(config.seed, seed, prompt_tokens, *tokens[-32:])
        if index:
            text_seed = synthetic.stable_seed(text_seed, index)
        shape = shape_for(text_seed) if shape_for else None
        natural = len(shape.tokens) if shape else synthetic.natural_length(text_seed, config.natural_output_tokens)
        if shape:
            decode, reason = min(natural, room, limit or natural), "stop"
            if decode < natural:
                reason = "length"
        elif limit is None:
            decode, reason = (natural, "stop") if natural <= room else (room, "length")
        elif ignore_eos or limit <= natural:
            decode, reason = limit, "length"
        else:
            decode, reason = natural, "stop"
        hashes = self.block_hashes(tokens) if config.enable_prefix_caching else ()
        self._next_id += 1
        return Generation(
            request_id=f"sim-{self._next_id}", prompt_tokens=prompt_tokens, decode_length=decode,
            stop_reason=reason, text_seed=text_seed, prefix_hashes=hashes,
        ), shape

    def block_hashes(self, tokens: list[str] | list[int]) -> tuple[int, ...]:
        """The prompt's chained block hashes, the keys of the prefix cache."""
        ids = tokens if tokens and isinstance(tokens[0], int) else [zlib.crc32(t.encode()) for t in tokens]  # type: ignore[union-attr]
        return block_hashes(ids, self.config.block_size)  # type: ignore[arg-type]

    def prompt_of(self, endpoint: str, body: dict[str, Any]) -> list[str] | list[int]:
        """The prompt's tokens as the public route `endpoint` would see them (for the internal port's KV export)."""
        if endpoint == "/v1/chat/completions":
            return _chat_tokens(ChatCompletionRequest.model_validate(body))
        if endpoint == "/v1/completions":
            return _completion_tokens(CompletionRequest.model_validate(body).prompt_text())
        raise bad_request("endpoint must be /v1/chat/completions or /v1/completions", param="endpoint")

    def _submit(self, gen: Generation) -> None:
        try:
            self.driver.submit(gen)
        except ValueError as exc:  # more KV than the engine has: never servable
            raise bad_request(str(exc), code="context_length_exceeded") from None
        except RuntimeError as exc:
            raise internal_error(f"simulated engine failure: {exc}") from None

    def _raise_if_aborted(self, gen: Generation) -> None:
        if gen.finish_reason == "abort":  # the client is still here, so the engine gave up on it
            why = f"its decode loop failed: {self.driver.failure!r}" if self.driver.failure else "it was put to sleep"
            raise internal_error(f"simulated engine aborted the request: {why}")

    def usage(self, gen: Generation) -> Usage:
        return self.usage_of([gen])

    def usage_of(self, gens: list[Generation]) -> Usage:
        """The prompt once (the sequences share it), and every sequence's tokens."""
        cached = gens[0].cached_tokens if self.config.enable_prefix_caching else None
        return Usage.of(gens[0].prompt_tokens, sum(g.emitted for g in gens), cached)

    async def cancel_on_disconnect(self, receive: Receive, *gens: Generation) -> None:
        """Cancel the answer's sequences when the client leaves before they are done (finished ones stay)."""
        await client_gone(receive)
        for gen in gens:
            self.driver.cancel(gen)

    async def _until_finished(self, request: Request, gen: Generation) -> None:
        watcher = asyncio.ensure_future(self.cancel_on_disconnect(request.receive, gen))
        try:
            while gen.finish_reason is None:
                await self.driver.wait(gen)
        finally:
            watcher.cancel()
            if gen.finish_reason is None:
                self.driver.cancel(gen)

    # ------------------------------------------------------------ OpenAI routes

    async def chat_completions(self, request: Request) -> Response | TokenStream | ChoicesStream:
        self.require_serving()
        req: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        self._check_model(req.model)
        extra = req.model_extra or {}
        k = shaping.top_logprobs(extra)
        tokens = _chat_tokens(req)
        choices = [self._generation(tokens, req.output_limit(), req.seed, _ignore_eos(req), "messages", index,
                                    lambda seed: shaping.shape_of(extra, req.messages, self.filler, seed))
                   for index in range(req.n)]
        for gen, _ in choices:
            self._submit(gen)
        rid, created = new_id("chatcmpl"), now_s()
        if req.stream:
            if req.n == 1 and choices[0][1] is None and k is None:  # plain text: the pre-encoded fast path
                frames = chat_frames(rid, created, req.model, self.engine)
                return TokenStream(self, choices[0][0], frames, req.include_usage_in_stream())
            return ChoicesStream(self, choices, k, rid, created, req.model, req.include_usage_in_stream())
        try:
            for gen, _ in choices:
                await self._until_finished(request, gen)
                self._raise_if_aborted(gen)
        finally:
            for gen, _ in choices:
                if gen.finish_reason is None:
                    self.driver.cancel(gen)
        return _json_bytes(orjson.dumps({
            "id": rid, "object": "chat.completion", "created": created, "model": req.model,
            "choices": [self._choice(index, gen, shape, k) for index, (gen, shape) in enumerate(choices)],
            "usage": self.usage_of([gen for gen, _ in choices]).model_dump(exclude_none=True),
            "system_fingerprint": self.engine,
        }))

    def token_text(self, gen: Generation, shape: Shape | None, position: int) -> str:
        return shape.tokens[position] if shape else self.filler.token(gen.text_seed, position).decode()

    def _choice(self, index: int, gen: Generation, shape: Shape | None, k: int | None) -> dict[str, Any]:
        """One whole choice of a chat answer: text, or a tool call; with log-probabilities if asked."""
        emitted = gen.emitted
        text = "".join(shape.tokens[:emitted]) if shape else self.filler.text(gen.text_seed, emitted)
        finish = gen.finish_reason
        if shape and shape.tool_name:
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [{
                "id": shape.call_id, "type": "function", "function": {"name": shape.tool_name, "arguments": text}}]}
            finish = "tool_calls" if finish == "stop" else finish
        else:
            message = {"role": "assistant", "content": text}
        logprobs = None
        if k is not None:
            logprobs = {"content": [shaping.logprob_entry(self.token_text(gen, shape, i), gen.text_seed, i, k, self.filler)
                                    for i in range(emitted)]}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    async def completions(self, request: Request) -> Response | TokenStream:
        self.require_serving()
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        self._check_model(req.model)
        prompt = req.prompt_text()
        tokens = _completion_tokens(prompt)
        if req.n != 1:
            raise bad_request("the simulated engine answers n > 1 on /v1/chat/completions only", param="n")
        gen, _ = self._generation(tokens, req.output_limit(), req.seed, _ignore_eos(req), "prompt")
        self._submit(gen)
        rid, created = new_id("cmpl"), now_s()
        echo = prompt if req.echo and isinstance(prompt, str) else None
        if req.stream:
            frames = completion_frames(rid, created, req.model, self.engine, echo)
            return TokenStream(self, gen, frames, req.include_usage_in_stream())
        await self._until_finished(request, gen)
        self._raise_if_aborted(gen)
        text = (echo or "") + self.filler.text(gen.text_seed, gen.emitted)
        body = CompletionResponse(
            id=rid, created=created, model=req.model,
            choices=[CompletionChoice(text=text, finish_reason=gen.finish_reason)],
            usage=self.usage(gen), system_fingerprint=self.engine,
        )
        return _json(body)

    async def models(self, request: Request) -> Response:
        if self.lifecycle.state is EngineState.LOADING:
            self.require_serving()
        card = ModelCard(
            id=self.config.model, owned_by="vllm" if self.config.profile == "vllm" else "llamacpp",
            engine=self.engine, simulated=True, max_model_len=self.config.max_model_len,
        )
        return _json(ModelList(data=[card]))

    # ------------------------------------------------------------ engine routes

    async def health(self, request: Request) -> Response:
        if self.config.profile == "vllm":
            return Response(status_code=200)
        if self.lifecycle.state is EngineState.LOADING:
            self.require_serving()
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        render = render_vllm if self.config.profile == "vllm" else render_llamacpp
        return Response(render(self.stats, self.snapshot()), media_type="text/plain; version=0.0.4")

    def snapshot(self) -> EngineSnapshot:
        driver, memory = self.driver, self.lifecycle.memory()
        return EngineSnapshot(
            model=self.config.model, engine=self.engine,
            running=driver.running, waiting=driver.waiting, deferred=len(driver.deferred),
            kv_used_tokens=driver.system.memory_used, kv_total_tokens=self.config.kv_tokens,
            preemptions=driver.counter("preemptions"),
            prefix_cache_queries=driver.counter("prefix_cache_queries"),
            prefix_cache_hits=driver.counter("prefix_cache_hits"),
            sleep_state=self.lifecycle.sleep_state_label(),
            gpu_bytes=memory.gpu_bytes, cpu_bytes=memory.cpu_bytes,
            lifecycle_state=self.lifecycle.state.value, speedup=self.config.speedup,
            cache_config=self.config.cache_config_info(),
        )

    async def status(self, request: Request) -> Response:
        """modelpool's own view of the simulator: state, memory and scheduler counters."""
        snap = self.snapshot()
        return JSONResponse({
            "engine": self.engine, "simulated": True, "model": self.config.model,
            "state": snap.lifecycle_state, "sleep_level": self.lifecycle.level,
            "is_sleeping": self.lifecycle.is_sleeping,
            "memory": {"gpu_bytes": snap.gpu_bytes, "cpu_bytes": snap.cpu_bytes},
            "kv_cache": {"used_tokens": snap.kv_used_tokens, "total_tokens": snap.kv_total_tokens},
            "requests": {"running": snap.running, "waiting": snap.waiting, "deferred": snap.deferred},
            "speedup": self.config.speedup,
            "batches": self.stats.steps,
            "scheduled_wall_s": self.stats.scheduled_wall_s,
            "actual_wall_s": self.stats.actual_wall_s,
            "schedule_resets": self.stats.schedule_resets,
        })

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": f"{self.engine} (modelpool)", "simulated": True})

    # ------------------------------------------------------------ app

    def routes(self) -> list[Route]:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/sim/status", self.status, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
        ]
        return routes + (vllm_admin_routes(self) if self.config.profile == "vllm" else llama_server_routes(self))


def _chat_tokens(req: ChatCompletionRequest) -> list[str]:
    return synthetic.chat_pieces([(m.role, m.content) for m in req.messages])


def _completion_tokens(prompt: str | list[int]) -> list[str] | list[int]:
    return synthetic.pieces(prompt) if isinstance(prompt, str) else list(prompt)


def _ignore_eos(req: BaseModel) -> bool:
    """vLLM's `ignore_eos` sampling extension: generate exactly max_tokens."""
    return bool((req.model_extra or {}).get("ignore_eos", False))


def _json(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def _json_bytes(body: bytes) -> Response:
    return Response(body, media_type="application/json")


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                   type="invalid_request_error", code=exc.status_code)
    return JSONResponse(err.to_dict(), status_code=exc.status_code)


def create_app(config: EngineConfig) -> Starlette:
    """The ASGI app of one simulated engine (the server state lives in the closure, not globally)."""
    server = EngineServer(config)
    middleware = [Middleware(EngineHeader, engine=server.engine)]
    if config.otlp_traces_endpoint:
        server.telemetry = Telemetry(server.engine, otlp_endpoint=config.otlp_traces_endpoint)
        middleware.append(Middleware(TraceRequests, telemetry=server.telemetry, engine=server.engine))
    app = Starlette(
        routes=server.routes(),
        lifespan=server.lifespan,
        middleware=middleware,
        exception_handlers={APIError: _api_error, HTTPException: _http_error},
    )
    for path in config.middleware:  # as vLLM's `--middleware` adds them: the class, given the app alone
        module, name = path.rsplit(".", 1)
        app.add_middleware(getattr(importlib.import_module(module), name))
    app.state.server = server
    return app
