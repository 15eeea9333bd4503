"""ASGI middleware shared by the engines' HTTP edges."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.openai_protocol import ENGINE_HEADER

RAW_SEND_KEY = "modelpool.raw_send"
"""Scope key of the server's own `send`, for streams that write body chunks past the wrappers."""


class EngineHeader:
    """Stamp every response with the engine that served it, so a simulated run is never taken for a real one."""

    def __init__(self, app: ASGIApp, engine: str) -> None:
        self.app = app
        self.header = (ENGINE_HEADER.encode(), engine.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = self.header
        scope[RAW_SEND_KEY] = send

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        await self.app(scope, receive, stamped)
