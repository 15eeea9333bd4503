"""The OpenAI-compatible front door.

It reads the routing state and instance list (its live view of the read
models) and forwards each request to one serving instance of the alias, picked
by the routing state (seed 000 §12.4): fast only in FAST_ONLY / WARMING_VLLM /
DEGRADED_FAST, split by the mix weight in MIXED, vLLM first in VLLM_PRIMARY. A
request never crosses backends and a stream stays on its instance. It decides
nothing about states or replicas; that is the autoscaler's alone.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from shared.contracts.backends import BackendType, EngineKind, engine_label
from shared.openai_protocol import (
    ENGINE_HEADER,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    bad_request,
    not_found_model,
    service_unavailable,
    validation_error,
)
from shared.projections.live import LiveView
from shared.projections.readmodels import INSTANCES, ROUTING

log = logging.getLogger(__name__)

FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM


def backend_order(state: str, mix_weight: float, draw: float) -> list[BackendType]:
    """Which backend to try first, then which as fallback, for one request."""
    if state in ("FAST_ONLY", "WARMING_VLLM", "DEGRADED_FAST", "COLD"):
        return [FAST]
    if state == "MIXED":
        return [SLOW, FAST] if draw < mix_weight else [FAST, SLOW]
    return [SLOW, FAST]  # VLLM_PRIMARY: llama.cpp is the floor


def pick_instance(view: LiveView, alias: str, rng: random.Random) -> dict[str, Any]:
    routing = view[ROUTING].get(alias)
    if routing is None:
        raise not_found_model(alias)
    serving = [i for i in view[INSTANCES].values() if i["alias"] == alias and i["state"] == "RUNNING" and i["endpoint"]]
    for backend in backend_order(routing["state"], routing["mix_weight"], rng.random()):
        candidates = [i for i in serving if i["backend_type"] == backend.value]
        if candidates:
            return min(candidates, key=lambda i: (i["inflight"], i["instance_id"]))
    raise service_unavailable(
        f"alias `{alias}` has no serving instance (routing state {routing['state']}); try again shortly",
        code="no_instance",
    )


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)


def create_app(view: LiveView, client: httpx.AsyncClient, rng: random.Random | None = None) -> Starlette:
    rng = rng or random.Random()

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "position": view.position})

    async def models(_: Request) -> Response:
        cards = []
        for alias, row in sorted(view[ROUTING].items()):
            backends = (row.get("config") or {}).get("backends", {})
            engines = [
                engine_label(EngineKind((cfg or {}).get("engine") or name), BackendType(name)) for name, cfg in backends.items()
            ]
            cards.append(
                ModelCard(
                    id=alias, engine=",".join(engines) or None, simulated=any(e.startswith("simulated-") for e in engines),
                    max_model_len=(backends.get("vllm") or {}).get("max_model_len"),
                )
            )
        return JSONResponse(ModelList(data=cards).model_dump())

    async def forward(request: Request, model_cls: type, path: str) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(bad_request("request body is not valid JSON"))
        try:
            parsed = model_cls.model_validate(body)
        except ValidationError as exc:
            return error_response(validation_error(exc))
        try:
            instance = pick_instance(view, parsed.model, rng)
        except APIError as exc:
            return error_response(exc)
        headers = {"x-modelpool-instance": instance["instance_id"], "x-modelpool-backend": instance["backend_type"]}
        upstream = client.build_request("POST", f"{instance['endpoint']}{path}", json=body, timeout=None)
        try:
            response = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            return error_response(service_unavailable(f"instance {instance['instance_id']} unreachable: {exc}"))
        headers[ENGINE_HEADER] = response.headers.get(ENGINE_HEADER, instance["engine"])

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()  # client gone or stream done: the engine stops generating

        return StreamingResponse(
            relay(), status_code=response.status_code, headers=headers,
            media_type=response.headers.get("content-type", "application/json"),
        )

    async def chat(request: Request) -> Response:
        return await forward(request, ChatCompletionRequest, "/v1/chat/completions")

    async def completions(request: Request) -> Response:
        return await forward(request, CompletionRequest, "/v1/completions")

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )
