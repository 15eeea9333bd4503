"""The public endpoint's connections: how many it keeps, and how long a request's headers may take.

uvicorn bounds neither: a client that opens a connection and sends its
headers a byte at a time (slowloris) holds its connection, and its buffers,
for as long as it likes, and enough of them exhaust the gateway. So the
endpoint's HTTP protocol is uvicorn's httptools one with two bounds added:

- past `max_connections` open at once, a new connection is answered `503`
  (OpenAI error JSON) and closed before anything of it is read;
- a request whose headers are not whole `header_timeout_s` after the
  connection opened (or after its first byte, on a kept-alive connection) is
  answered `408` and its connection closed.

The body's time is bounded where it is read (`edge.read_body`), and its size
by `max_body_bytes`; uvicorn stops reading a connection whose unread body
passes 64 KiB, so what a slow client costs is bounded by these three.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shared.openai_protocol import APIError


def _response(error: APIError) -> bytes:
    body = orjson.dumps(error.to_dict())
    head = [b"HTTP/1.1 %d %s" % (error.status, HTTPStatus(error.status).phrase.encode()),
            b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
    head += [f"{name}: {value}".encode() for name, value in error.headers.items()]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class BoundedHttp(HttpToolsProtocol):
    """uvicorn's HTTP protocol with a bound on open connections and on the time a request's headers take."""

    max_connections = 4096
    header_timeout_s = 10.0

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(_response(APIError(
                503, f"the gateway has its {self.max_connections} connections open; retry shortly",
                type="service_unavailable_error", code="too_many_connections", headers={"Retry-After": "1"})))
            transport.close()
            return
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.write(_response(APIError(
                408, f"the request's headers did not arrive whole within {self.header_timeout_s:g} s",
                type="invalid_request_error", code="header_timeout")))
            self.transport.close()


def bounded_http(max_connections: int, header_timeout_s: float) -> type[BoundedHttp]:
    """The protocol class for one endpoint's bounds (uvicorn takes a class, and makes one per connection)."""
    return type("BoundedHttp", (BoundedHttp,), {"max_connections": max_connections,
                                                "header_timeout_s": header_timeout_s})
