"""The answer on its way to the client: status and headers once, then bytes; nothing else.

A held stream's headers go out before any instance is chosen, with keep-alive
comments while it waits, so the client and any proxy see an answer begin; from
then on every error is an event inside the stream. An answer already under way
that is not a stream cannot carry an error: it is left unfinished, and the
server closes the connection.
"""

from __future__ import annotations

import orjson
from starlette.types import Send

from shared.openai_protocol import SSE_DONE, APIError

REQUEST_ID_HEADER = "x-request-id"
KEEPALIVE = b": keep-alive\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies such as nginx would otherwise buffer the keep-alives
]


def error_event(exc: APIError) -> bytes:
    """An OpenAI-style error inside a stream whose 200 has been sent, and the stream's end."""
    return b"data: " + orjson.dumps(exc.to_dict()) + b"\n\n" + SSE_DONE


class ClientStream:
    """The ASGI `send` of one request, and what has gone out through it."""

    def __init__(self, send: Send, request_id: str, stream: bool) -> None:
        self._send = send
        self.request_id = request_id
        self.stream = stream
        self.status: int | None = None

    @property
    def started(self) -> bool:
        return self.status is not None

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self._send({"type": "http.response.start", "status": status,
                          "headers": [*headers, (REQUEST_ID_HEADER.encode(), self.request_id.encode())]})
        self.status = status

    async def send(self, body: bytes, more: bool = True) -> None:
        await self._send({"type": "http.response.body", "body": body, "more_body": more})

    async def hold(self) -> None:
        """A stream about to wait for an instance to start: its headers now, keep-alives after."""
        if self.stream and not self.started:
            await self.start(200, SSE_HEADERS)

    async def keepalive(self, comment: bytes = KEEPALIVE) -> None:
        """A comment line on a held stream whose headers are out (`: keep-alive`, or where a cold start stands)."""
        if self.started:
            await self.send(comment)

    async def end_with(self, exc: APIError) -> None:
        """End a stream whose 200 is out with an error event."""
        await self.send(error_event(exc), more=False)

    async def refuse(self, exc: APIError) -> None:
        if self.started:
            if self.stream:
                await self.end_with(exc)
            return
        headers = [(b"content-type", b"application/json"),
                   *((k.lower().encode(), v.encode()) for k, v in exc.headers.items())]
        await self.start(exc.status, headers)
        await self.send(orjson.dumps(exc.to_dict()), more=False)
