"""A llama-server instance's internal port: KV export and import for session moves, over the server's own slot
save and restore (`POST /slots/{id}?action=save|restore`, files in its `--slot-save-path`).

The same API as modelpool's engine (services/engines/llamacpp/internal_app.py), so the gateway moves a session
between two llama-server instances as between two of its own:

POST /kv/export  {"session": "...", "endpoint": "/v1/chat/completions", "request": {...}}
                 -> the idle slot whose cache is the request's own conversation: all of the slot's tokens but at
                    most `MAX_UNSHARED_TAIL` (the last reply's end, which the next prompt may tokenize otherwise)
                    begin the request's prompt (as the server builds it: `/apply-template`, then `/tokenize`);
                    as a signed KV frame whose blob is the server's slot file; 404 `no_cached_prefix` when none is.
POST /kv/import  a signed frame from a llama-server of the same model file and slot layout -> restored into an
                 idle slot (one that never served first); the server's next request with that prefix picks the
                 slot by prompt similarity, as it does for its own cache. 409 `incompatible_kv`, 400
                 `bad_kv_frame`, 503 `kv_busy` (every slot decoding).

llama-server's slots know no sessions, so the export cannot take a session's slot by name, as modelpool's engine
does; it takes a slot only when the request already holds (nearly) everything the slot holds, so a move never
carries another conversation. Only idle slots are saved or restored: the server refuses to touch a slot that is
processing. Every call is signed with the cluster secret (shared/internal_auth.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.engines.llamacpp.kv_cache import common_prefix_len
from shared import kv_frames
from shared.engine_asgi import error_response
from shared.internal_auth import SignedOnly, Verifier
from shared.openai_protocol import APIError, bad_request, service_unavailable

ENGINE_NAME = "llama-server"
MIN_SHARED_TOKENS = 8
"""A shorter shared prefix (the chat template's opening) is not worth a move."""
MAX_UNSHARED_TAIL = 16
"""Tokens at the end of a slot's cache the request's prompt may lack: the last reply's end, which the next turn's
template may render or tokenize differently. Any more and the slot holds a conversation the request does not."""
SLOT_FILE_MAGIC = 0x67677371  # 'ggsq': llama_state_seq_save_file
SLOT_FILE_HEAD = struct.Struct("<III")  # magic, version, token count


def slot_file_tokens(blob: bytes) -> list[int]:
    """The tokens a slot file says its KV holds. This llama.cpp's server writes its token list with a
    header of its own, [-1, version, n], before the n tokens."""
    if len(blob) < SLOT_FILE_HEAD.size:
        raise ValueError("the slot file is shorter than its header")
    magic, _version, count = SLOT_FILE_HEAD.unpack_from(blob)
    if magic != SLOT_FILE_MAGIC or len(blob) < SLOT_FILE_HEAD.size + 4 * count:
        raise ValueError("not a llama.cpp sequence state file")
    tokens = list(struct.unpack_from(f"<{count}i", blob, SLOT_FILE_HEAD.size))
    if len(tokens) >= 3 and tokens[0] == -1:
        tokens = tokens[3 : 3 + tokens[2]]
    return tokens


class LlamaServerKV:
    def __init__(self, engine_url: str, slot_dir: Path, fingerprint: str, secret: bytes) -> None:
        self.engine = httpx.AsyncClient(base_url=engine_url, timeout=30.0)
        self.slot_dir = slot_dir
        self.fingerprint = fingerprint
        self.secret = secret
        self._lock = asyncio.Lock()  # one save or restore at a time: slots are picked from one view

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await self.engine.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise service_unavailable(f"llama-server did not answer {path}: {exc!r}", code="engine_unreachable") from None
        if response.status_code != 200:
            raise APIError(502 if response.status_code >= 500 else 409, f"llama-server answered {path} with "
                           f"{response.status_code}: {response.text[:300]}", type="api_error", code="slot_call_failed")
        return response.json()

    async def _prompt_tokens(self, payload: Any) -> list[int]:
        if not isinstance(payload, dict) or not isinstance(payload.get("request"), dict):
            raise bad_request('the body must be {"session": ..., "endpoint": ..., "request": {...}}')
        request, endpoint = payload["request"], payload.get("endpoint")
        if endpoint == "/v1/chat/completions" and isinstance(request.get("messages"), list):
            prompt = (await self._call("POST", "/apply-template", json={"messages": request["messages"]}))["prompt"]
        elif endpoint == "/v1/completions" and isinstance(request.get("prompt"), str):
            prompt = request["prompt"]
        else:
            raise bad_request("endpoint must be /v1/chat/completions (with messages) or /v1/completions (with a "
                              "prompt string)", param="endpoint")
        return list((await self._call("POST", "/tokenize", json={"content": prompt, "add_special": True}))["tokens"])

    async def _idle_slots(self) -> list[dict[str, Any]]:
        return [s for s in await self._call("GET", "/slots") if not s.get("is_processing")]

    async def export(self, request: Request) -> Response:
        try:
            try:
                payload = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise bad_request(f"the body is not valid JSON: {exc}") from None
            prompt = await self._prompt_tokens(payload)
            session = payload.get("session")
            if not isinstance(session, str) or not session:
                raise bad_request("name the session whose KV to export", param="session")
            best: tuple[int, list[int], bytes] | None = None
            async with self._lock:
                for slot in await self._idle_slots():
                    if not slot.get("n_prompt_tokens"):
                        continue  # never served: nothing cached
                    name = f"export-{uuid.uuid4().hex}.bin"
                    await self._call("POST", f"/slots/{slot['id']}", params={"action": "save"}, json={"filename": name})
                    path = self.slot_dir / name
                    try:
                        blob = path.read_bytes()
                    finally:
                        path.unlink(missing_ok=True)
                    try:
                        tokens = slot_file_tokens(blob)
                    except ValueError:
                        continue  # not a file this code reads: that slot is not offered
                    shared = common_prefix_len(tokens, prompt)
                    own = len(tokens) - shared <= MAX_UNSHARED_TAIL
                    if own and shared >= MIN_SHARED_TOKENS and (best is None or shared > best[0]):
                        best = (shared, tokens, blob)
            if best is None:
                raise APIError(404, "no idle slot holds this request's conversation", type="not_found_error",
                               code="no_cached_prefix")
        except APIError as err:
            return error_response(err)
        _, tokens, blob = best
        header = {"engine": ENGINE_NAME, "model": self.fingerprint, "session": session, "n_tokens": len(tokens),
                  "tokens": tokens, "bytes": len(blob)}
        return Response(kv_frames.encode(header, blob, key=self.secret), media_type=kv_frames.MEDIA_TYPE)

    async def import_(self, request: Request) -> Response:
        try:
            try:
                header, blob = kv_frames.decode(await request.body(), engine=ENGINE_NAME, model=self.fingerprint,
                                                key=self.secret)
                slot_file_tokens(blob)
            except kv_frames.Incompatible as exc:
                raise APIError(409, str(exc), type="invalid_request_error", code="incompatible_kv") from None
            except (kv_frames.BadFrame, ValueError) as exc:
                raise bad_request(str(exc), code="bad_kv_frame") from None
            async with self._lock:
                idle = await self._idle_slots()
                if not idle:
                    raise service_unavailable("every slot is decoding: nothing to restore into", code="kv_busy")
                # A slot that never served first, else the one whose own cache is smallest.
                slot = min(idle, key=lambda s: (s.get("n_prompt_tokens") or 0, s["id"]))
                name = f"import-{uuid.uuid4().hex}.bin"
                path = self.slot_dir / name
                path.write_bytes(blob)
                try:
                    await self._call("POST", f"/slots/{slot['id']}", params={"action": "restore"},
                                     json={"filename": name})
                finally:
                    path.unlink(missing_ok=True)
        except APIError as err:
            return error_response(err)
        return JSONResponse({"n_tokens": header["n_tokens"], "bytes": len(blob), "seq_id": slot["id"]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})


def build_kv_app(kv: LlamaServerKV, *, max_frame_bytes: int) -> SignedOnly:
    """The internal port (every call but /health signed; an import's frame within `max_frame_bytes`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await kv.engine.aclose()

    app = Starlette(routes=[
        Route("/health", kv.health, methods=["GET"]),
        Route("/kv/export", kv.export, methods=["POST"]),
        Route("/kv/import", kv.import_, methods=["POST"]),
    ], lifespan=lifespan)
    return SignedOnly(app, Verifier(kv.secret or None), limits={"/kv/import": lambda: max_frame_bytes})
