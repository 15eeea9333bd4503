"""The simulated engine's internal port: a session's KV moved between engines, as a model.

The same routes and frames as the llama.cpp engine's internal port
(shared/kv_frames.py), with nothing real inside: export names the prompt's
cached blocks (their chained hashes) and the bytes they would take; import
waits bytes / `kv_transfer_gb_s` (simulated time) and then holds those blocks
in the prefix cache, so the session's next turn on this engine hits them.
A real vLLM has no such API (a moved session recomputes there); the model
stands for a KV connector between engines.

As on the real engines' ports, every call is signed with the cluster secret and
every frame too (shared/internal_auth.py). An export names only the request's
own prompt blocks, so it never carries another session's KV.
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
from shared.internal_auth import SignedOnly, Verifier
from shared.openai_protocol import APIError, bad_request

from .app import EngineServer, _api_error

GB = 1e9


def _model(server: EngineServer) -> str:
    c = server.config
    return f"{c.model}:{c.kv_bytes_per_token}:{c.block_size}"


class KVTransfer:
    def __init__(self, server: EngineServer, secret: bytes) -> None:
        self.server = server
        self.config = server.config
        self.secret = secret

    def _cache(self) -> Any:
        self.server.require_serving()
        cache = self.server.driver.system.prefix_cache
        if cache is None:
            raise APIError(409, "this engine runs without prefix caching: it keeps no KV to move",
                           type="invalid_request_error", code="no_prefix_cache")
        return cache

    async def export(self, request: Request) -> Response:
        cache = self._cache()
        try:
            payload = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"the body is not valid JSON: {exc}") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("request"), dict):
            raise bad_request('the body must be {"session": ..., "endpoint": ..., "request": {...}}')
        session = payload.get("session")
        if not isinstance(session, str) or not session:
            raise bad_request("name the session whose KV to export", param="session")
        try:
            tokens = self.server.prompt_of(str(payload.get("endpoint")), payload["request"])
        except ValueError as exc:  # pydantic's ValidationError is one
            raise bad_request(f"the request is not a valid body: {exc}", param="request") from None
        hashes = self.server.block_hashes(tokens)
        cached = list(hashes[: cache.match(hashes)])
        if not cached:
            raise APIError(404, "no cached blocks share a prefix with this prompt", type="not_found_error",
                           code="no_cached_prefix")
        n_tokens = len(cached) * self.config.block_size
        header = {"engine": self.server.engine, "model": _model(self.server), "session": session,
                  "n_tokens": n_tokens, "block_hashes": cached, "bytes": n_tokens * self.config.kv_bytes_per_token}
        return Response(kv_frames.encode(header, key=self.secret), media_type=kv_frames.MEDIA_TYPE)

    async def import_(self, request: Request) -> Response:
        cache = self._cache()
        try:
            header, _ = kv_frames.decode(await request.body(), engine=self.server.engine, model=_model(self.server),
                                         key=self.secret)
        except kv_frames.Incompatible as exc:
            raise APIError(409, str(exc), type="invalid_request_error", code="incompatible_kv") from None
        except kv_frames.BadFrame as exc:
            raise bad_request(str(exc), code="bad_kv_frame") from None
        hashes = header.get("block_hashes")
        if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
            raise bad_request("the KV frame must list its block hashes", code="bad_kv_frame")
        size = int(header["n_tokens"]) * self.config.kv_bytes_per_token
        await asyncio.sleep(size / (self.config.kv_transfer_gb_s * GB) / self.config.speedup)
        cache.insert(hashes)
        return JSONResponse({"n_tokens": header["n_tokens"], "bytes": size,
                             "transfer_s": size / (self.config.kv_transfer_gb_s * GB)})


def create_internal_app(server: EngineServer, *, secret: bytes | None) -> SignedOnly:
    """The internal port's app, over the same engine as the public app (`app.state.server`); every call but
    /health signed with `secret` (without one, every call is refused)."""
    transfer = KVTransfer(server, secret or b"")
    app = Starlette(
        routes=[Route("/health", server.health, methods=["GET"]),
                Route("/kv/export", transfer.export, methods=["POST"]),
                Route("/kv/import", transfer.import_, methods=["POST"])],
        exception_handlers={APIError: _api_error},
    )
    return SignedOnly(app, Verifier(secret))
