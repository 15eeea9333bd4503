"""vLLM's sleep-mode endpoints on the simulated engine (`VLLM_SERVER_DEV_MODE=1`): `/sleep`, `/wake_up`,
`/collective_rpc`, `/is_sleeping`.

They follow vLLM's documented behaviour, awkward parts included: a sleep aborts
the requests under way unless told `mode=wait`; a sleep call while asleep is
ignored whatever its level; `/wake_up` wakes the memory tags named (`?tags=weights`)
or all; weights discarded at level 2 stay garbage until `reload_weights` is called
through `/collective_rpc`; a request to an engine that sleeps or wakes is refused
with 503. Timing comes from the lifecycle model (`lifecycle.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.engines.simulated.lifecycle import LifecycleError
from shared.openai_protocol import APIError, bad_request

if TYPE_CHECKING:
    from services.engines.simulated.app import EngineServer

log = logging.getLogger(__name__)


def _transition(step: Callable[..., Any], *args: Any) -> Any:
    try:
        return step(*args)
    except LifecycleError as exc:
        raise APIError(409, str(exc), type="invalid_request_error", code="invalid_state") from None


SLEEP_MODES = ("abort", "wait")
"""vLLM's pause modes a sleep takes; its third, `keep` (freeze requests, resume them after the wake), is not
simulated and is refused saying so."""
COLLECTIVE_RPC_METHODS = ("reload_weights",)


def vllm_admin_routes(server: EngineServer) -> list[Route]:
    lifecycle, config = server.lifecycle, server.config
    lock = asyncio.Lock()

    async def sleep(request: Request) -> Response:
        raw = request.query_params.get("level", "1")
        try:
            level = int(raw)
        except ValueError:
            raise bad_request(f"sleep level must be 1 or 2, got {raw!r}", param="level") from None
        if level not in (1, 2):
            raise bad_request(f"sleep level must be 1 or 2, got {level}", param="level")
        mode = request.query_params.get("mode", "abort")
        if mode not in SLEEP_MODES:
            raise bad_request(f"sleep mode must be one of {', '.join(SLEEP_MODES)} in the simulated engine, "
                              f"got {mode!r}", param="mode")
        async with lock:
            if not _transition(lifecycle.begin_sleep, level):
                # vLLM's executor ignores a sleep call while asleep ("already sleeping"), whatever
                # the level: going from level 1 to level 2 takes a wake-up first.
                log.warning("%s is already sleeping at level %d; sleep(level=%d) ignored",
                            server.engine, lifecycle.level, level)
                return Response(status_code=200)
            if mode == "abort":
                aborted = server.driver.abort_all()
                if aborted:
                    log.warning("%s aborted %d requests under way to sleep (mode=abort)", server.engine, aborted)
            await server.driver.drained()
            await asyncio.sleep(lifecycle.sleep_delay() / config.speedup)
            server.driver.reset()
            lifecycle.asleep()
        log.info("%s asleep at level %d", server.engine, level)
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags")
        async with lock:
            delay = _transition(lifecycle.begin_wake, frozenset(tags) if tags else None)
            if delay is None:
                return Response(status_code=200)
            await asyncio.sleep(delay / config.speedup)
            lifecycle.awake()
        log.info("%s woke %s; %s", server.engine, ", ".join(tags) if tags else "every memory tag",
                 "asleep still: " + ", ".join(sorted(lifecycle.sleeping_tags)) if lifecycle.sleeping_tags else "awake")
        return Response(status_code=200)

    async def collective_rpc(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError as exc:
            raise bad_request(f"JSON decode error: {exc}") from None
        method = body.get("method") if isinstance(body, dict) else None
        if method is None:
            raise bad_request("Missing 'method' in request body", param="method")
        if method not in COLLECTIVE_RPC_METHODS:
            raise bad_request(f"the simulated engine runs only {', '.join(COLLECTIVE_RPC_METHODS)} through "
                              f"collective_rpc, not {method!r}", param="method")
        async with lock:
            delay = _transition(lifecycle.begin_reload)
            loaded = False
            try:
                await asyncio.sleep(delay / config.speedup)
                loaded = True
            finally:
                lifecycle.end_reload(loaded)
        log.info("%s reloaded its weights", server.engine)
        return JSONResponse({"results": [None]})  # reload_weights returns nothing, once per GPU worker

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": lifecycle.is_sleeping})

    return [
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake_up", wake_up, methods=["POST"]),
        Route("/collective_rpc", collective_rpc, methods=["POST"]),
        Route("/is_sleeping", is_sleeping, methods=["GET"]),
    ]
