"""What the public endpoint checks before a request reaches admission: its key, its size, its shape.

The gateway reads only what it needs to route (`model`, `stream`,
`stream_options`) and that the body is a request at all (`messages` or
`prompt`); every other field passes through as the client sent it, so `n`,
`tools`, `response_format`, `logprobs`, image parts and vendor extras reach the
engine, which accepts them or answers its own 400. Every refusal is an OpenAI
error body with its status.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from routing.fairness import DEFAULT_TENANCY, PRIORITIES, Tenancy
from services.gateway.quotas import KeyLimits
from shared.contracts.config import TenantKey
from shared.openai_protocol import APIError, bad_request, internal_error, not_found_model

log = logging.getLogger(__name__)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="modelpool"'})


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds the gateway's limit of {limit} bytes", type="invalid_request_error",
                    code="request_too_large")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, as its key says: its tenant (for the fair queue) and its limits (`quotas.py`)."""

    tenancy: Tenancy
    limits: KeyLimits


OPEN_CALLER = Caller(DEFAULT_TENANCY, KeyLimits())


class Keys:
    """The API keys the public endpoint accepts, each with its tenant and limits; none configured: the endpoint is
    open, to one caller."""

    def __init__(self, keys: Mapping[str, Caller], open_caller: Caller = OPEN_CALLER) -> None:
        self._keys = tuple((key.encode(), caller) for key, caller in keys.items())
        self._open = open_caller

    @classmethod
    def of(cls, keys: Mapping[str, TenantKey], sessions_per_minute: int | None = None) -> "Keys":
        return cls({key: Caller(Tenancy(k.tenant, k.weight, PRIORITIES[k.priority]),
                                KeyLimits.of(k, sessions_per_minute)) for key, k in keys.items()},
                   Caller(DEFAULT_TENANCY, KeyLimits(sessions_per_minute=sessions_per_minute)))

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, request: Request) -> Caller:
        """The caller the request's key names; 401 unless it carries an accepted one (compared in constant time)."""
        if not self._keys:
            return self._open
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized("missing API key: send `Authorization: Bearer <key>`")
        given = token.strip().encode()
        # Every key is compared, so the time taken does not tell which one came close.
        matches = [hmac.compare_digest(given, key) for key, _ in self._keys]
        if not any(matches):
            raise unauthorized("invalid API key")
        return self._keys[matches.index(True)][1]


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The whole body, refused with 413 as soon as it is known to exceed `limit` (before it is read whole), and
    with 408 if it has not arrived whole within `timeout_s` of the headers: a slow client holds no buffer long."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        # The rest of the body may still come: the connection closes, not to read it as a next request.
        raise APIError(408, f"the request body did not arrive whole within {timeout_s:g} s",
                       type="invalid_request_error", code="body_timeout", headers={"Connection": "close"}) from None
    return b"".join(chunks)


@dataclass(frozen=True, slots=True)
class Routed:
    """What the gateway reads of a request body; the rest goes to the engine untouched."""

    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool


def parse_request(raw: bytes, path: str) -> Routed:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required: the name of a model listed at /v1/models", param="model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("`stream` must be true or false", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("`stream_options` must be an object", param="stream_options")
        if not stream:
            raise bad_request("`stream_options` is only allowed when `stream` is true", param="stream_options")
    if path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("`messages` must be a non-empty list of message objects", param="messages")
    elif body.get("prompt") is None:
        raise bad_request("`prompt` is required", param="prompt")
    return Routed(body, model, bool(stream), bool(options and options.get("include_usage") is True))


async def accept(request: Request, path: str, keys: Keys, limit: int, known: Callable[[str], bool],
                 full: Callable[[Caller], APIError | None] = lambda caller: None,
                 body_timeout_s: float | None = None) -> tuple[Routed, Caller]:
    """The edge stage: the request's key (and so its caller), size and shape, and a model the gateway serves;
    else an `APIError`. When `full` refuses the caller (every alias it may use has a full queue), the body is
    never read."""
    caller = keys.check(request)
    if (refusal := full(caller)) is not None:
        raise refusal
    routed = parse_request(await read_body(request, limit, body_timeout_s), path)
    if not known(routed.model):
        raise not_found_model(routed.model)
    return routed, caller


async def http_error(_: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (no such path, wrong method) in the OpenAI shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error = APIError(404, "no such endpoint; the API is at /v1 (chat/completions, completions, models)",
                         type="invalid_request_error", code="not_found")
    elif exc.status_code == 405:
        error = APIError(405, f"method not allowed here: {exc.detail}", type="invalid_request_error",
                         code="method_not_allowed", headers=dict(exc.headers or {}))
    else:
        error = APIError(exc.status_code, str(exc.detail), type="invalid_request_error")
    return error_response(error)


def gateway_failure(request_id: str | None = None) -> APIError:
    """A failure of the gateway's own, as the client is told: no exception or address of ours, only what to quote
    (the gateway's log has the rest)."""
    at = f" (request {request_id})" if request_id else ""
    return internal_error(f"the gateway failed to serve this request{at}; its log says why")


async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected gateway failure", exc_info=exc)
    return error_response(gateway_failure())
