"""Guards a vLLM server's development endpoints: loaded into vLLM itself with `--middleware`.

vLLM serves its sleep-mode and other control endpoints (`/sleep`, `/wake_up`,
`/collective_rpc`, `/reset_prefix_cache`, ...) only with `VLLM_SERVER_DEV_MODE=1`,
and then to anyone who reaches its port, with no authentication (its `--api-key`
covers `/v1` only): on a worker's network, anyone could put an instance to sleep,
or call `collective_rpc` into its GPU workers. The worker needs them, so it starts
vLLM with `--middleware services.engines.vllm_guard.SignedDevEndpoints`: the
serving endpoints stay as vLLM serves them, and every other path must be signed
with the cluster secret, as the engines' internal ports are
(shared/internal_auth.py) — which only the worker does. The secret comes from the
engine's environment (`MODELPOOL_CLUSTER_SECRET`, which the worker sets); without
one, every control call is refused.

vLLM adds a middleware class given by import path with `app.add_middleware(cls)`:
the class takes the app alone. The simulated vLLM takes the same flag.
"""

from __future__ import annotations

import os

from starlette.types import ASGIApp, Receive, Scope, Send

from shared.internal_auth import SignedOnly, Verifier, secret_from_environment

SERVING_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", "/tokenize", "/detokenize", "/load"})
"""Served to whoever reaches the port, as vLLM serves them (with every `/v1/...` route but the LoRA loaders)."""
SIGNED_V1_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
"""`/v1` routes that change what the server runs: the worker's, like the development endpoints."""


def is_serving_path(path: str) -> bool:
    return path in SERVING_PATHS or (path.startswith("/v1/") and path not in SIGNED_V1_PATHS)


class SignedDevEndpoints:
    """Every path but the serving ones must be signed with the cluster secret (401 otherwise)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.signed = SignedOnly(app, Verifier(secret_from_environment(os.environ)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_serving_path(scope["path"]):
            await self.app(scope, receive, send)
        else:
            await self.signed(scope, receive, send)
