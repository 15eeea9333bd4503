"""vLLM's sleep-mode endpoints on the simulated engine (`VLLM_SERVER_DEV_MODE=1`): `/sleep`, `/wake_up`, `/is_sleeping`.

They follow vLLM's documented behaviour, awkward parts included: a sleep
waits for the requests under way, a sleep call while asleep is ignored
whatever its level, and a request to an engine that sleeps or wakes is refused
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
        async with lock:
            if not _transition(lifecycle.begin_sleep, level):
                # vLLM's executor ignores a sleep call while asleep ("already sleeping"), whatever
                # the level: going from level 1 to level 2 takes a wake-up first.
                log.warning("%s is already sleeping at level %d; sleep(level=%d) ignored",
                            server.engine, lifecycle.level, level)
                return Response(status_code=200)
            await server.driver.drained()
            await asyncio.sleep(lifecycle.sleep_delay() / config.speedup)
            server.driver.reset()
            lifecycle.asleep()
        log.info("%s asleep at level %d", server.engine, level)
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        async with lock:
            delay = _transition(lifecycle.begin_wake)
            if delay is None:
                return Response(status_code=200)
            await asyncio.sleep(delay / config.speedup)
            lifecycle.awake()
        log.info("%s awake", server.engine)
        return Response(status_code=200)

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": lifecycle.is_sleeping})

    return [
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake_up", wake_up, methods=["POST"]),
        Route("/is_sleeping", is_sleeping, methods=["GET"]),
    ]
