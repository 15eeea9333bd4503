"""Token chunks written straight to the client's socket (`token_wire`), by the writer thread or, without one, by the
decode thread: on real TCP sockets and a real event loop, then through the real engine behind uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from llamacpp_helpers import RunningServer, chat
from services.engines.llamacpp.metrics import EngineMetrics
from services.engines.llamacpp.requests import FinishEvent, RequestState, TokenEvent
from services.engines.llamacpp import token_wire
from services.engines.llamacpp.token_wire import ChunkWriter, EventRelay, plain_chunked_transport

NO_EOG = {"0": -100, "2": -100}  # SmolLM2's end-of-generation tokens: answers of max_tokens
BEFORE, AFTER = b'data: {"t":', b"}\n\n"


def framed(text: str) -> bytes:
    body = BEFORE + json.dumps(text).encode() + AFTER
    return b"%x\r\n%b\r\n" % (len(body), body)


def unframe(data: bytes) -> list[str]:
    """The texts of a run of chunk-framed SSE events, in order; fails on anything malformed."""
    texts = []
    while data:
        size, rest = data.split(b"\r\n", 1)
        n = int(size, 16)
        body, data = rest[:n], rest[n:]
        assert data[:2] == b"\r\n"
        data = data[2:]
        assert body.startswith(BEFORE) and body.endswith(AFTER), body
        texts.append(json.loads(body[len(BEFORE):-len(AFTER)]))
    return texts


@pytest.fixture
def chunk_writer() -> Iterator[ChunkWriter]:
    """A running writer thread, stopped after the test."""
    running = ChunkWriter()
    running.start()
    yield running
    running.stop()


@pytest.fixture(params=["writer", "inline"])
def writer(request: pytest.FixtureRequest) -> ChunkWriter | None:
    """The engine's writer thread, or none (the decode thread writes itself): every wire test runs with both."""
    return request.getfixturevalue("chunk_writer") if request.param == "writer" else None


class Wire:
    """A real TCP connection: the server end under an asyncio transport, the client end a plain socket."""

    def __init__(self, transport: asyncio.Transport, client: socket.socket, writer: ChunkWriter | None) -> None:
        self.transport, self.client = transport, client
        self.metrics = EngineMetrics()
        self.relay = EventRelay(asyncio.get_running_loop(), self.metrics, writer)
        self.queue: asyncio.Queue = self.relay._queue  # what the loop was given, looked at without taking it

    async def settled(self) -> None:
        """Until the writer has delivered every event given to it (at once without a writer)."""
        deadline = time.monotonic() + 10
        while self.relay._queued:
            assert time.monotonic() < deadline, "the writer never delivered what it was given"
            await asyncio.sleep(0.005)

    def read_available(self, timeout: float = 0.5) -> bytes:
        self.client.settimeout(timeout)
        out = b""
        try:
            while chunk := self.client.recv(1 << 16):
                out += chunk
        except (TimeoutError, BlockingIOError):
            pass
        return out


@contextlib.asynccontextmanager
async def open_wire(writer: ChunkWriter | None, *, send_buffer: int | None = None) -> AsyncIterator[Wire]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server_side, _ = listener.accept()
    listener.close()
    if send_buffer is not None:
        server_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, send_buffer)
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, server_side)
    try:
        yield Wire(transport, client, writer)
    finally:
        transport.close()
        client.close()


async def take(wire: Wire) -> object:
    """What the edge does with an event from the queue: take it, and write a token's chunk through the transport."""
    event = await asyncio.wait_for(wire.relay.next(), 10)
    if isinstance(event, TokenEvent):
        wire.transport.write(framed(event.text))
    return event


def test_direct_writes_start_only_once_everything_given_to_the_loop_is_written(writer: ChunkWriter | None) -> None:
    async def main() -> None:
        async with open_wire(writer) as wire:
            wire.relay(TokenEvent("one", 1))
            assert not wire.relay.go_direct(wire.transport, BEFORE, AFTER), "an event is still on its way to the edge"
            assert await take(wire) == TokenEvent("one", 1)
            assert wire.relay.go_direct(wire.transport, BEFORE, AFTER)
            wire.relay(TokenEvent("two", 2))
            wire.relay(TokenEvent("", 3))  # nothing to say yet (a possible stop sequence): nothing written
            wire.relay(TokenEvent('"three"\n', 4))
            await wire.settled()
            assert wire.queue.empty(), "token events in direct mode never wake the loop"
            assert unframe(wire.read_available()) == ["one", "two", '"three"\n']
            assert wire.metrics.stream_chunks_direct == 2
            finish = FinishEvent(RequestState.COMPLETED, "stop", "", 5, 4, 0)
            wire.relay(finish)
            assert await take(wire) == finish, "the finish goes through the loop, after the last direct write"
            wire.relay.close()
            wire.relay(TokenEvent("late", 5))
            assert await take(wire) == TokenEvent("late", 5), "after close, nothing is written directly"
            assert not wire.relay.go_direct(wire.transport, BEFORE, AFTER), "a closed stream is never handed over again"

    asyncio.run(main())


def test_no_direct_writes_while_the_transport_holds_unsent_bytes(writer: ChunkWriter | None) -> None:
    async def main() -> None:
        async with open_wire(writer, send_buffer=4096) as wire:
            wire.transport.write(b"x" * (1 << 20))  # the client reads nothing: most of it stays in the transport
            assert wire.transport.get_write_buffer_size() > 0
            assert not wire.relay.go_direct(wire.transport, BEFORE, AFTER)

    asyncio.run(main())


def test_a_slow_reader_gets_every_chunk_in_order_and_never_holds_up_a_thread(writer: ChunkWriter | None) -> None:
    """The kernel's buffer fills: the write that does not fit hands the stream back to the loop, whose transport
    buffers the rest; the decode thread and the writer finish while the client has read nothing."""
    n = 3000

    async def main() -> None:
        async with open_wire(writer, send_buffer=4096) as wire:
            assert wire.relay.go_direct(wire.transport, BEFORE, AFTER)
            decode_thread = threading.Thread(target=lambda: [wire.relay(TokenEvent(f"t{i} ", i)) for i in range(n)])
            decode_thread.start()
            await asyncio.get_running_loop().run_in_executor(None, decode_thread.join, 30)
            assert not decode_thread.is_alive(), "a slow reader blocked the decode thread"
            await wire.settled()
            assert 0 < wire.metrics.stream_chunks_direct < n, "the stream went back to the loop when the kernel was full"
            received = b""
            deadline = time.monotonic() + 30
            while not received.endswith(framed(f"t{n - 1} ")) and time.monotonic() < deadline:
                # the edge takes each queued event, as it would, while the client finally reads
                received += await asyncio.get_running_loop().run_in_executor(None, wire.read_available, 0.05)
                while not wire.queue.empty():
                    await take(wire)
                    wire.relay.go_direct(wire.transport, BEFORE, AFTER)
            assert unframe(received) == [f"t{i} " for i in range(n)]

    asyncio.run(main())


def test_a_client_that_left_ends_the_stream_as_a_disconnect(writer: ChunkWriter | None) -> None:
    async def main() -> None:
        async with open_wire(writer) as wire:
            assert wire.relay.go_direct(wire.transport, BEFORE, AFTER)
            wire.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            wire.client.close()  # a reset: the next writes fail
            await asyncio.sleep(0.05)
            for i in range(3):
                wire.relay(TokenEvent(f"t{i}", i))  # never raises on the decode thread
            assert await asyncio.wait_for(wire.queue.get(), 5) is None, "the edge hears of it as a disconnect"
            later = [await asyncio.wait_for(wire.queue.get(), 5) for _ in range(2)]
            assert later == [TokenEvent("t1", 1), TokenEvent("t2", 2)], "after a failed write, events go to the loop"

    asyncio.run(main())


def test_the_descriptor_written_to_is_the_relay_s_own_and_closed_with_it(writer: ChunkWriter | None) -> None:
    """The relay writes through a duplicate of the socket's descriptor: when the server closes its own, the number
    may be reused for another connection, which a write must never reach."""

    async def main() -> None:
        async with open_wire(writer) as wire:
            assert wire.relay.go_direct(wire.transport, BEFORE, AFTER)
            own = wire.relay._fd
            assert own is not None and own != wire.transport.get_extra_info("socket").fileno()
            wire.relay.close()
            with pytest.raises(OSError):
                os.fstat(own)

    asyncio.run(main())


def test_with_a_writer_the_decode_thread_never_writes_and_the_finish_follows_the_last_chunk(
    monkeypatch: pytest.MonkeyPatch, chunk_writer: ChunkWriter
) -> None:
    """The writer does every direct write, in the order the decode thread gave the events; a finish given right
    after the tokens reaches the loop only once they are on the wire."""
    writing_threads: set[str] = set()
    real_write = os.write

    def recorded_write(fd: int, data: bytes) -> int:
        writing_threads.add(threading.current_thread().name)
        return real_write(fd, data)

    monkeypatch.setattr(token_wire.os, "write", recorded_write)

    async def main() -> None:
        async with open_wire(chunk_writer) as wire:
            assert wire.relay.go_direct(wire.transport, BEFORE, AFTER)
            finish = FinishEvent(RequestState.COMPLETED, "length", "", 5, 200, 0)

            def decode() -> None:
                for i in range(200):
                    wire.relay(TokenEvent(f"t{i} ", i + 1))
                wire.relay(finish)

            decode_thread = threading.Thread(target=decode, name="decode")
            decode_thread.start()
            decode_thread.join(10)
            assert await take(wire) == finish
            assert unframe(wire.read_available()) == [f"t{i} " for i in range(200)], "every chunk before the finish"
            assert writing_threads == {"llamacpp-chunk-writer"}

    asyncio.run(main())


class Hold:
    """An item that holds the writer up until released."""

    def __init__(self) -> None:
        self.reached, self.release = threading.Event(), threading.Event()

    def deliver_queued(self, event: object) -> None:
        self.reached.set()
        assert self.release.wait(10)


def test_events_after_a_hand_back_to_the_loop_wait_for_those_still_with_the_writer(chunk_writer: ChunkWriter) -> None:
    """A write the kernel cannot take whole hands the stream back to the loop while the writer still holds later
    events of it: an event the decode thread gives then goes behind them, not straight to the loop."""
    big = "x" * (1 << 18)  # more than the kernel's buffers hold: a partial write

    async def main() -> None:
        async with open_wire(chunk_writer, send_buffer=4096) as wire:
            assert wire.relay.go_direct(wire.transport, BEFORE, AFTER)
            first, second = Hold(), Hold()
            chunk_writer.put(first, TokenEvent("", 0))  # type: ignore[arg-type]
            wire.relay(TokenEvent(big, 1))
            chunk_writer.put(second, TokenEvent("", 0))  # type: ignore[arg-type]
            wire.relay(TokenEvent("t1", 2))
            first.release.set()
            assert await asyncio.get_running_loop().run_in_executor(None, second.reached.wait, 10)
            assert wire.relay._fd is None, "the partial write handed the stream back"
            wire.relay(TokenEvent("t2", 3))  # the decode thread, while "t1" is still with the writer
            second.release.set()
            await wire.settled()
            received = b""
            deadline = time.monotonic() + 30
            while not received.endswith(framed("t2")) and time.monotonic() < deadline:
                received += await asyncio.get_running_loop().run_in_executor(None, wire.read_available, 0.05)
                while not wire.queue.empty():
                    await take(wire)
            assert unframe(received) == [big, "t1", "t2"]

    asyncio.run(main())


def test_one_stream_s_failure_never_stops_the_writer_for_the_others(
    caplog: pytest.LogCaptureFixture, chunk_writer: ChunkWriter
) -> None:
    class Broken:
        def deliver_queued(self, event: object) -> None:
            raise RuntimeError("a broken stream")

    async def main() -> None:
        async with open_wire(chunk_writer) as wire:
            assert wire.relay.go_direct(wire.transport, BEFORE, AFTER)
            chunk_writer.put(Broken(), TokenEvent("", 0))  # type: ignore[arg-type]
            wire.relay(TokenEvent("still written", 1))
            await wire.settled()
            assert unframe(wire.read_available()) == ["still written"]

    asyncio.run(main())
    assert "a broken stream" in caplog.text


def test_a_stopped_writer_delivers_what_it_was_given_and_then_the_decode_thread_writes(chunk_writer: ChunkWriter) -> None:
    async def main() -> None:
        async with open_wire(chunk_writer) as wire:
            assert wire.relay.go_direct(wire.transport, BEFORE, AFTER)
            for i in range(50):
                wire.relay(TokenEvent(f"t{i} ", i + 1))
            chunk_writer.stop()  # the fixture's own stop then finds it stopped
            assert wire.relay._queued == 0, "the stop delivered everything queued"
            wire.relay(TokenEvent("after ", 51))  # written by the caller itself now
            assert unframe(wire.read_available()) == [f"t{i} " for i in range(50)] + ["after "]
            assert wire.metrics.stream_chunks_direct == 51

    asyncio.run(main())


def test_servers_other_than_uvicorn_s_chunked_http_1_1_keep_the_stream_on_the_loop() -> None:
    async def send(message: object) -> None:
        pass

    assert plain_chunked_transport(send, {"http_version": "1.1"}) is None

    class Cycle:
        chunked_encoding = False
        transport = object()

        async def send(self, message: object) -> None:
            pass

    assert plain_chunked_transport(Cycle().send, {"http_version": "1.1"}) is None


# -- through the real engine ---------------------------------------------------------------------------------------


def _chunks_direct(server: RunningServer) -> int:
    return server.engine.metrics.stream_chunks_direct


def test_a_stream_s_chunks_written_straight_to_its_socket_give_the_same_answer(server: RunningServer) -> None:
    body = chat(server.alias, "Name three colours.", max_tokens=24, cache_prompt=False)
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    before = _chunks_direct(server)
    lines = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert len({c["id"] for c in chunks}) == 1
    written = _chunks_direct(server) - before
    assert written >= whole["usage"]["completion_tokens"] // 2, f"only {written} chunks were written directly"


def test_a_client_that_reads_nothing_until_the_end_gets_the_whole_answer(server: RunningServer) -> None:
    body = chat(server.alias, "Tell me about the sea.", max_tokens=200, cache_prompt=False, logit_bias=NO_EOG)
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    completed = server.engine.metrics.completed
    payload = json.dumps({**body, "stream": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        client.connect((host, int(port)))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n%b" % (len(payload), payload))
        deadline = time.time() + 60
        while server.engine.metrics.completed == completed and time.time() < deadline:  # nothing read meanwhile
            time.sleep(0.05)
        assert server.engine.metrics.completed > completed, "a client that reads nothing held the engine up"
        client.settimeout(10)
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            chunk = client.recv(1 << 16)
            assert chunk, "the connection closed before the end of the answer"
            data += chunk
    head, _, chunked = data.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    events, rest = [], chunked
    while True:
        size, rest = rest.split(b"\r\n", 1)
        if int(size, 16) == 0:
            break
        events.append(rest[: int(size, 16)])
        rest = rest[int(size, 16) + 2:]
    sse = b"".join(events).decode().split("\n\n")
    assert sse[-2] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in sse[:-2])
    assert text == whole["choices"][0]["message"]["content"]
