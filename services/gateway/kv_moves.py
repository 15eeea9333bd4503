"""A moved session's KV, carried from its old host to the new one over the engines' internal ports.

EAR (seed 004) moves a session off a hot host; without its KV the new host
recomputes the whole context, the very prefill the move meant to avoid
queueing behind. Engines that can (llama.cpp, and the simulator's model of a
KV link) export the cached sequence the request's prompt continues and import
it on the target; the request then finds its prefix cached there. vLLM has no
such API: its moved sessions recompute. Every failure falls back to recompute:
the request is served either way, only later.

Both calls are signed with the cluster secret (shared/internal_auth.py), and
the export names the session: an engine hands out only that session's KV. A
gateway without the secret moves nothing (its sessions recompute, recorded so).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from shared.internal_auth import sign
from shared.kv_frames import MEDIA_TYPE
from shared.projections.rows import InstanceRow


@dataclass(frozen=True, slots=True)
class KVMove:
    """What a move did: recorded in `SessionMigrated.metrics`."""

    moved: bool
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    detail: str = ""
    """Why nothing moved (for the log)."""

    def metrics(self) -> dict[str, float]:
        return {"kv_moved": float(self.moved), "kv_tokens": float(self.tokens), "kv_bytes": float(self.bytes),
                "kv_move_s": round(self.seconds, 6)}


def session_tag(session_id: str) -> str:
    """What engines know a session by (`x-modelpool-session`, a KV frame's `session`): a digest of the gateway's
    session key, which may hold any text a client sent (its `user`), fit for a header."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:32]


class KVMover:
    """Moves sessions' KV between engines, each call signed with the cluster secret."""

    def __init__(self, client: aiohttp.ClientSession, secret: bytes | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.secret = secret
        self.clock = clock

    async def move(self, source: InstanceRow | None, target: InstanceRow, session: str, endpoint: str,
                   payload: bytes, timeout_s: float) -> KVMove:
        """Export from `source` the KV of `session` that the request `payload` (for `endpoint`) continues; import
        it into `target`."""
        src = source.internal_endpoint if source else None
        dst = target.internal_endpoint
        if not src or not dst:
            if source is None:
                detail = "the old host is gone"
            elif not src:
                detail = f"{source.instance_id} ({source.engine.value}) exports no KV"
            else:
                detail = f"{target.instance_id} ({target.engine.value}) imports no KV"
            return KVMove(False, detail=f"{detail}: the new host recomputes")
        if self.secret is None:
            return KVMove(False, detail="this gateway has no cluster secret to sign KV moves: the new host recomputes")
        start = self.clock()
        try:
            async with asyncio.timeout(timeout_s):
                body = (b'{"session":' + orjson.dumps(session_tag(session)) + b',"endpoint":' + orjson.dumps(endpoint)
                        + b',"request":' + payload + b"}")
                async with self.client.post(f"{src}/kv/export", data=body, headers={
                        "content-type": "application/json", **sign(self.secret, "POST", "/kv/export", body)}) as r:
                    if r.status != 200:
                        return KVMove(False, seconds=self.clock() - start,
                                      detail=f"export: {r.status} {(await r.text())[:300]}")
                    frame = await r.read()
                async with self.client.post(f"{dst}/kv/import", data=frame, headers={
                        "content-type": MEDIA_TYPE, **sign(self.secret, "POST", "/kv/import", frame)}) as r:
                    if r.status != 200:
                        return KVMove(False, seconds=self.clock() - start,
                                      detail=f"import: {r.status} {(await r.text())[:300]}")
                    done = await r.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return KVMove(False, seconds=self.clock() - start, detail=f"{type(exc).__name__}: {exc}")
        return KVMove(True, int(done["n_tokens"]), int(done["bytes"]), self.clock() - start)
