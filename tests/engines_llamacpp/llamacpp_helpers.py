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
    _server: Any
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def start_server(**overrides: Any) -> RunningServer:
    import uvicorn

    from services.engines.llamacpp.engine import LlamaEngine
    from services.engines.llamacpp.http_app import build_app
    from services.engines.llamacpp.settings import EngineSettings

    values: dict[str, Any] = {"threads": THREADS, "n_seq_max": 8, "n_ctx": 8 * 1024}
    values.update(overrides)
    engine = LlamaEngine(EngineSettings.load(values, env={}))
    app = build_app(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not (server.started and engine.ready):
        if engine.load_error:
            raise RuntimeError(engine.load_error)
        if time.time() > deadline:
            raise TimeoutError("engine did not start")
        time.sleep(0.05)
    alias = app.app.state.api.model_alias  # type: ignore[attr-defined]
    return RunningServer(f"http://127.0.0.1:{port}", engine, alias, server, thread)


def chat(alias: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"model": alias, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}
