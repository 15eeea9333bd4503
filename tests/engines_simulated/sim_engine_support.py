"""Helpers: simulated engines served over real HTTP by uvicorn in a background thread."""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from services.engines.simulated.app import EngineServer, create_app
from services.engines.simulated.config import EngineConfig

# Small, fast defaults: 4 ms batches, instant lifecycle unless a test asks otherwise.
FAST: dict[str, Any] = {
    "startup_s": 0.0,
    "sleep_l1_s": 0.0,
    "sleep_l2_s": 0.0,
    "wake_l1_s": 0.0,
    "wake_l2_s": 0.0,
    "d_0": 0.004,
    "d_1": 0.000001,
    "model": "sim-test",
}


@dataclass
class RunningEngine:
    url: str
    config: EngineConfig
    server: EngineServer
    _uvicorn: Any
    _thread: threading.Thread

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: `name{labels}` -> value, plus `name` for single series."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
            out.setdefault(re.sub(r"\{.*\}", "", key), float(value))
        return out

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/sim/status", timeout=5).json()


def start_engine(profile: str = "vllm", wait: bool = True, **overrides: Any) -> RunningEngine:
    import uvicorn

    values = {**FAST, **overrides}
    config = EngineConfig.resolve(profile, env={}, **values)  # type: ignore[arg-type]
    app = create_app(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    if wait:
        deadline = time.time() + 30
        while not server.started:
            if time.time() > deadline or not thread.is_alive():
                raise TimeoutError("simulated engine did not start")
            time.sleep(0.01)
    return RunningEngine(f"http://127.0.0.1:{port}", config, app.state.server, server, thread)


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def chat(url: str, *, stream: bool = False, max_tokens: int = 4, timeout: float = 20, **extra: Any) -> httpx.Response:
    """One chat completion over plain HTTP (the body is read, streams included)."""
    body = {"model": "sim-test", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "stream": stream, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
