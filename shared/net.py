"""Network helpers shared by the services, benchmarks and tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports nothing listens on right now: held open together while chosen, so
    the OS cannot hand out one of them twice (as it may to calls made one after another)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


App = tuple[object, str, int]
"""An ASGI app with the host and port it listens on."""


def serve_beside(public: App, internal: App | None, **options: object) -> None:
    """Serve an engine's public app and, when given, its internal app on a second port, in one process.

    The public server owns the process: it handles the signals and runs the
    lifespan (which starts and stops the engine); the internal one stops when it does.
    `options` go to both uvicorn servers (log_level, access_log, ...).
    """
    import asyncio
    import contextlib
    from collections.abc import Iterator

    import uvicorn

    app, host, port = public
    if internal is None:
        uvicorn.run(app, host=host, port=port, **options)  # type: ignore[arg-type]
        return

    class Follower(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        def install_signal_handlers(self) -> None:
            pass

    main = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **options))  # type: ignore[arg-type]
    side_app, side_host, side_port = internal
    side = Follower(uvicorn.Config(side_app, host=side_host, port=side_port, **{**options, "lifespan": "off"}))  # type: ignore[arg-type]

    async def both() -> None:
        side_task = asyncio.create_task(side.serve())
        try:
            await main.serve()
        finally:
            side.should_exit = True
            await side_task

    # On uvloop where it is installed (uvicorn[standard] ships it), the loop `uvicorn.run` above picks by itself.
    try:
        import uvloop
    except ImportError:
        loop_factory = None
    else:
        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(both())
