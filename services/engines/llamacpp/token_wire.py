"""A request's engine events on their way to the HTTP edge, and its token chunks written straight to the socket.

Why the direct write: llama.cpp's threads use every core, so each token's turn of
the event loop (a wake-up, a GIL hand-off, a task switch, an ASGI send) takes CPU
from the decode itself — about 190 µs of the edge thread per token, where
llama-server's HTTP thread spends about 30. Once a stream's head is out, the decode
thread writes each token's chunk to the client's socket itself: one non-blocking
write, no wake-up. Everything else (the first event, the finish, errors, usage,
`[DONE]`) still goes through the loop.

Order on the wire is the order of events: the loop hands a stream over only when
every event it was given is written and its transport holds nothing unsent
(`go_direct`), the decode thread writes under the same lock the hand-over takes,
and the finish travels through the loop after the last direct write. A write the
kernel cannot take whole (a slow reader) hands the stream back to the loop with
the rest, which the transport buffers under its flow control, so a slow client
never blocks the decode thread; a write the peer refused ends the stream as a
disconnect. The socket is written through a duplicate descriptor, closed only under
the lock, so a descriptor number the server reuses for another connection is never
written to.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import orjson

from .metrics import EngineMetrics
from .requests import EngineEvent, TokenEvent


def plain_chunked_transport(send: Any, scope: dict[str, Any]) -> asyncio.Transport | None:
    """The TCP transport under uvicorn's `send` of an HTTP/1.1 chunked response without TLS, else None.

    ASGI does not expose the transport; uvicorn's httptools cycle holds it (and knows the body is chunked) once the
    response head is sent. Any other server, or a framing this module does not write, keeps the stream on the loop.
    """
    cycle = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if (
        transport is None
        or getattr(cycle, "chunked_encoding", None) is not True
        or scope.get("http_version") != "1.1"
        or transport.get_extra_info("sslcontext") is not None
        or transport.get_extra_info("socket") is None
    ):
        return None
    return transport


class EventRelay:
    """One request's events between the engine and the edge: the engine's sink (on the decode thread) puts them on
    the loop for the edge to take with `next`, or, once the edge hands the stream over, writes token chunks onto the
    socket."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: EngineMetrics) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[EngineEvent | None] = asyncio.Queue()
        self._metrics = metrics
        self._lock = threading.Lock()
        self._unread = 0
        """Events handed to the loop that the edge has not taken yet."""
        self._fd: int | None = None
        """Our own descriptor of the client's socket while the decode thread writes the token chunks."""
        self._transport: asyncio.Transport | None = None
        self._before = self._after = b""
        self._closed = False

    # -- the decode thread -----------------------------------------------------------------
    def __call__(self, event: EngineEvent) -> None:
        with self._lock:
            if self._fd is not None and type(event) is TokenEvent:
                if event.text:
                    self._write(event.text)
                return
            self._unread += 1
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def _write(self, text: str) -> None:
        body = self._before + orjson.dumps(text) + self._after
        data = b"%x\r\n%b\r\n" % (len(body), body)
        fd = self._fd
        assert fd is not None
        try:
            written = os.write(fd, data)
        except BlockingIOError:
            written = 0
        except OSError:  # the client reset or closed the connection: the stream ends as a disconnect
            self._close_fd()
            self._loop.call_soon_threadsafe(self._queue.put_nowait, None)
            return
        if written == len(data):
            self._metrics.stream_chunks_direct += 1
            return
        # The kernel's buffer is full: the transport takes the rest and what follows.
        self._close_fd()
        self._unread += 1  # until the transport has the rest, the stream stays on the loop
        self._loop.call_soon_threadsafe(self._write_rest, data[written:])

    def _write_rest(self, data: bytes) -> None:
        assert self._transport is not None
        try:
            if not self._transport.is_closing():  # a client gone meanwhile needs nothing more
                self._transport.write(data)
        finally:
            self._taken()

    # -- the event loop ---------------------------------------------------------------------
    async def next(self) -> EngineEvent | None:
        """The next event given to the loop, or None once the client is gone (`client_left`)."""
        event = await self._queue.get()
        if event is not None:
            self._taken()
        return event

    def client_left(self) -> None:
        self._queue.put_nowait(None)

    def _taken(self) -> None:
        with self._lock:
            self._unread -= 1

    def go_direct(self, transport: asyncio.Transport, chunk_before: bytes, chunk_after: bytes) -> bool:
        """Let the decode thread write the token chunks (`chunk_before` + the JSON string of the text +
        `chunk_after`, chunk-framed) from now on, if nothing given to the loop is still unwritten."""
        with self._lock:
            if self._fd is not None:
                return True
            if self._closed or self._unread or transport.is_closing() or transport.get_write_buffer_size():
                return False
            self._fd = os.dup(transport.get_extra_info("socket").fileno())
            self._transport, self._before, self._after = transport, chunk_before, chunk_after
            return True

    def close(self) -> None:
        """The stream is over: no more direct writes."""
        with self._lock:
            self._closed = True
            self._close_fd()

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
