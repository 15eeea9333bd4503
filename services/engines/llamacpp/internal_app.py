"""The engine's internal port: KV export and import for session moves (seed 004), never served publicly.

POST /kv/export  {"session": "...", "endpoint": "/v1/chat/completions", "request": {...}}
                 -> that session's cached sequence sharing the longest prefix with the request's prompt, as a
                    signed KV frame (shared/kv_frames.py); 404 `no_cached_prefix` when it has none. Only the
                    named session's: another conversation is never exported because its opening matches.
POST /kv/import  a KV frame signed with the cluster secret, from an engine of the same model ->
                 {"n_tokens", "bytes", "seq_id"}; the sequence is parked like a finished request of the frame's
                 session, so the session's next turn reuses it. The signature is checked before the frame is
                 parsed: nothing unsigned or altered reaches llama.cpp.

Every call is signed with the cluster secret (shared/internal_auth.py; unsigned or replayed: 401), and bodies
have limits (413): 1 MiB for an export's request, a whole sequence's KV for an import. The public app
(http_app.py) has no such routes: a KV state is the content of someone's conversation, and importing one writes
into the cache.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from shared import kv_frames
from shared.engine_asgi import error_response
from shared.internal_auth import DEFAULT_BODY_LIMIT, SignedOnly, Verifier
from shared.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    internal_error,
    service_unavailable,
)

from . import ENGINE_NAME
from .engine import KVBusy, LlamaEngine, SequenceState
from .http_app import EngineAPI
from .llama_backend import DecodeError

PROMPT_BUILDERS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
FRAME_BYTES_PER_CELL = 64
"""Beyond the K and V a cell holds: its position and sequence ids in the state, its token in the header."""


def model_fingerprint(engine: LlamaEngine) -> str:
    """What an imported state must have been exported from: the same model file, and the same sequence
    layout (llama.cpp's sequence state records one KV stream per sequence id and refuses another count)."""
    path = engine.model_path
    backend = engine.backend
    assert backend is not None
    return f"{path.name}:{path.stat().st_size}:{backend.config.n_seq_max}x{backend.n_ctx_seq}"


def max_frame_bytes(engine: LlamaEngine) -> int:
    """The largest KV frame a sequence of this engine can make: what an import may send."""
    backend = engine.backend
    if backend is None:
        return DEFAULT_BODY_LIMIT  # still loading: imports are refused anyway
    return backend.n_ctx_seq * (backend.kv_bytes_per_token() + FRAME_BYTES_PER_CELL) + DEFAULT_BODY_LIMIT


class InternalAPI:
    def __init__(self, api: EngineAPI, secret: bytes) -> None:
        self.api = api
        self.engine = api.engine
        self.secret = secret

    def _serving(self) -> None:
        if not self.engine.ready:
            raise service_unavailable("model is loading", code="loading")

    def _prompt(self, payload: Any) -> list[int]:
        if not isinstance(payload, dict) or not isinstance(payload.get("request"), dict):
            raise bad_request('the body must be {"session": ..., "endpoint": ..., "request": {...}}')
        endpoint = payload.get("endpoint")
        model = PROMPT_BUILDERS.get(endpoint)  # type: ignore[arg-type]
        if model is None:
            raise bad_request(f"endpoint must be one of {sorted(PROMPT_BUILDERS)}", param="endpoint")
        try:
            body = model.model_validate(payload["request"])
        except Exception as exc:
            raise bad_request(f"the request is not a valid {endpoint} body: {exc}", param="request") from None
        build = self.api.chat_prompt if model is ChatCompletionRequest else self.api.completion_prompt
        return build(body)  # type: ignore[arg-type]

    async def export(self, request: Request) -> Response:
        try:
            self._serving()
            try:
                payload = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise bad_request(f"the body is not valid JSON: {exc}") from None
            prompt = self._prompt(payload)
            session = payload.get("session")
            if not isinstance(session, str) or not session:
                raise bad_request("name the session whose KV to export", param="session")
            try:
                found = await asyncio.wrap_future(self.engine.export_kv(prompt, session))
            except (DecodeError, RuntimeError) as exc:
                raise internal_error(f"the KV export failed: {exc}") from None
            if found is None:
                raise APIError(404, "this session has no cached sequence sharing a prefix with this prompt",
                               type="not_found_error", code="no_cached_prefix")
        except APIError as err:
            return error_response(err)
        header = {"engine": ENGINE_NAME, "model": model_fingerprint(self.engine), "session": found.session,
                  "n_tokens": len(found.tokens), "tokens": found.tokens, "bytes": len(found.state)}
        return Response(kv_frames.encode(header, found.state, key=self.secret), media_type=kv_frames.MEDIA_TYPE)

    async def import_(self, request: Request) -> Response:
        try:
            self._serving()
            try:
                header, state = kv_frames.decode(await request.body(), engine=ENGINE_NAME,
                                                 model=model_fingerprint(self.engine), key=self.secret)
            except kv_frames.Incompatible as exc:
                raise APIError(409, str(exc), type="invalid_request_error", code="incompatible_kv") from None
            except kv_frames.BadFrame as exc:
                raise bad_request(str(exc), code="bad_kv_frame") from None
            tokens, session = header.get("tokens"), header.get("session")
            if (not isinstance(tokens, list) or len(tokens) != header["n_tokens"] or not state
                    or not all(isinstance(t, int) for t in tokens) or not isinstance(session, str)):
                raise bad_request("the KV frame must carry its session, its n_tokens tokens and a state",
                                  code="bad_kv_frame")
            try:
                seq_id = await asyncio.wrap_future(self.engine.import_kv(SequenceState(tokens, state, session)))
            except KVBusy as exc:
                raise service_unavailable(f"cannot import now: {exc}", code="kv_busy") from None
            except ValueError as exc:
                raise bad_request(str(exc), code="incompatible_kv") from None
            except (DecodeError, RuntimeError) as exc:
                raise APIError(409, str(exc), type="invalid_request_error", code="incompatible_kv") from None
        except APIError as err:
            return error_response(err)
        return JSONResponse({"n_tokens": len(tokens), "bytes": len(state), "seq_id": seq_id})


def build_internal_app(engine: LlamaEngine, *, secret: bytes | None, model_alias: str | None = None) -> SignedOnly:
    """The internal port's app (every call but /health signed with `secret`; without one, every call is refused);
    the public app (which starts and stops the engine) runs beside it."""
    api = EngineAPI(engine, model_alias=model_alias)
    internal = InternalAPI(api, secret or b"")
    app = Starlette(routes=[
        Route("/health", api.health, methods=["GET"]),
        Route("/kv/export", internal.export, methods=["POST"]),
        Route("/kv/import", internal.import_, methods=["POST"]),
    ])
    return SignedOnly(app, Verifier(secret), limits={"/kv/import": lambda: max_frame_bytes(engine)})
