"""Helpers for the llama.cpp engine tests: start a real engine behind real HTTP."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

THREADS = 1  # robust when the CI cores are shared: llama.cpp threads spin at barriers


@dataclass
class RunningServer:
    url: str
    engine: Any
    alias: str
    _servers: list[tuple[Any, threading.Thread]]
    internal_url: str | None = None

    def stop(self) -> None:
        for server, _ in self._servers:
            server.should_exit = True
        for _, thread in self._servers:
            thread.join(timeout=30)


def _serve(app: Any, lifespan: str) -> tuple[Any, threading.Thread, int]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return server, thread, sock.getsockname()[1]


def start_server(*, internal: bool = False, **overrides: Any) -> RunningServer:
    """An engine on its public port and, with `internal`, its internal port (KV export and import)."""
    from services.engines.llamacpp.engine import LlamaEngine
    from services.engines.llamacpp.http_app import build_app
    from services.engines.llamacpp.internal_app import build_internal_app
    from services.engines.llamacpp.settings import EngineSettings

    values: dict[str, Any] = {"threads": THREADS, "n_seq_max": 8, "n_ctx": 8 * 1024}
    values.update(overrides)
    engine = LlamaEngine(EngineSettings.load(values, env={}))
    app = build_app(engine)
    server, thread, port = _serve(app, "on")
    servers = [(server, thread)]
    internal_url = None
    if internal:
        from helpers import CLUSTER_KEY

        side, side_thread, side_port = _serve(build_internal_app(engine, secret=CLUSTER_KEY), "off")
        servers.append((side, side_thread))
        internal_url = f"http://127.0.0.1:{side_port}"
    deadline = time.time() + 60
    while not (all(s.started for s, _ in servers) and engine.ready):
        if engine.load_error:
            raise RuntimeError(engine.load_error)
        if time.time() > deadline:
            raise TimeoutError("engine did not start")
        time.sleep(0.05)
    alias = app.app.state.api.model_alias  # type: ignore[attr-defined]
    return RunningServer(f"http://127.0.0.1:{port}", engine, alias, servers, internal_url)


def chat(alias: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"model": alias, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}
