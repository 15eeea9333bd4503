"""A request's engine events on their way to the HTTP edge, and its token chunks written straight to the socket.

Why the direct write: llama.cpp's threads use every core, so each token's turn of
the event loop (a wake-up, a GIL hand-off, a task switch, an ASGI send) takes CPU
from the decode itself — about 190 µs of the edge thread per token, where
llama-server's HTTP thread spends about 30. Once a stream's head is out, each
token's chunk is written to the client's socket directly: one non-blocking write,
no wake-up of the loop. Everything else (the first event, the finish, errors,
usage, `[DONE]`) still goes through the loop.

Who writes: the engine's `ChunkWriter` thread, which the decode thread hands each
event of a direct stream to. A write to a local client wakes it, and the kernel
may run the woken reader on the writer's CPU first: written from the decode
thread itself, each write held the decode up for it (108 µs median, 638 µs p90
per token at one stream, docs/benchmarks.md). llama-server's decode loop
likewise hands each token to its HTTP threads. Without a running
writer (an app served without its lifespan), the decode thread writes itself.

Order on the wire is the order of events: the loop hands a stream over only when
every event it was given is written and its transport holds nothing unsent
(`go_direct`); from then on every event of the stream passes through the writer's
queue, in order, until the writer has delivered the last of them, and the writer
writes under the same lock the hand-over takes; the finish travels through the
loop after the last direct write. A write the kernel cannot take whole (a slow
reader) hands the stream back to the loop with the rest, which the transport
buffers under its flow control, so a slow client never blocks a thread; a write
the peer refused ends the stream as a disconnect. The socket is written through a
duplicate descriptor, closed only under the lock, so a descriptor number the
server reuses for another connection is never written to.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from typing import Any

import orjson

from .metrics import EngineMetrics
from .requests import EngineEvent, TokenEvent

log = logging.getLogger(__name__)


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


class ChunkWriter:
    """The thread that delivers the events of streams handed over for direct writes (`EventRelay.go_direct`), in
    the order the decode thread gave them: token chunks onto the socket, the rest to the loop."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[EventRelay, EngineEvent] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        """Running while set."""

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llamacpp-chunk-writer", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Deliver everything queued, then stop: from now on whoever gives an event delivers it (the app stops the
        writer after the engine, whose decode thread gives none by then)."""
        with self._lock:  # every event `put` took is queued before the end mark
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._queue.put(None)
        thread.join()

    def put(self, relay: "EventRelay", event: EngineEvent) -> bool:
        """Queue `event` of `relay`; False when the writer is not running (the caller delivers it)."""
        with self._lock:
            if self._thread is None:
                return False
            self._queue.put((relay, event))
            return True

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            relay, event = item
            try:
                relay.deliver_queued(event)
            except Exception:  # one stream's failure never stops the others' writes
                log.exception("delivering a stream's event failed")


class EventRelay:
    """One request's events between the engine and the edge: the engine's sink (on the decode thread) puts them on
    the loop for the edge to take with `next`, or, once the edge hands the stream over, gives them to the writer,
    which writes token chunks onto the socket."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: EngineMetrics, writer: ChunkWriter | None = None) -> None:
        self._loop = loop
        self._writer = writer
        self._queued = 0
        """Events given to the writer that it has not delivered yet: until it has, later ones follow them there."""
        self._queue: asyncio.Queue[EngineEvent | None] = asyncio.Queue()
        self._metrics = metrics
        self._lock = threading.Lock()
        self._unread = 0
        """Events handed to the loop that the edge has not taken yet."""
        self._fd: int | None = None
        """Our own descriptor of the client's socket while the token chunks are written directly."""
        self._transport: asyncio.Transport | None = None
        self._before = self._after = b""
        self._closed = False

    # -- the decode thread -----------------------------------------------------------------
    def __call__(self, event: EngineEvent) -> None:
        with self._lock:
            if (self._fd is not None or self._queued) and self._writer is not None and self._writer.put(self, event):
                self._queued += 1
                return
            self._deliver(event)

    # -- the writer ---------------------------------------------------------------------------
    def deliver_queued(self, event: EngineEvent) -> None:
        """Deliver an event the decode thread gave the writer."""
        with self._lock:
            self._queued -= 1
            self._deliver(event)

    def _deliver(self, event: EngineEvent) -> None:
        """Under the lock (so two threads' events reach the loop in the order they were delivered): write a token's
        chunk when the stream is direct, else hand the event to the loop."""
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
        """Let the token chunks be written directly from now on (`chunk_before` + the JSON string of the text +
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
