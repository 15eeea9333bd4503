"""Running engine processes on this machine and talking to them over HTTP.

One `EngineProcess` per instance: the real llama.cpp engine, the real
`vllm serve` (sleep mode on), or the simulator standing in for either. Control
goes through each engine's documented HTTP API — `/health`, `/metrics`, and for
vLLM `POST /sleep?level=N`, `POST /wake_up`, `GET /is_sleeping` — so the worker
drives a simulated vLLM exactly as it would drive a real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
from dataclasses import dataclass, field

import httpx

from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.commands import StartInstance
from shared.net import free_port

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineOptions:
    """How this worker launches engines (worker-level settings, not per instance)."""

    host: str = "127.0.0.1"
    sim_speedup: float = 1.0
    sim_startup_s: float | None = None
    llama_threads: int | None = None
    vllm_binary: str = "vllm"
    health_timeout_s: float = 180.0


def engine_argv(spec: StartInstance, port: int, options: EngineOptions) -> tuple[list[str], dict[str, str]]:
    """The command line (and extra environment) that starts the engine for `spec`."""
    env: dict[str, str] = {}
    modelpool = [sys.executable, "-m", "services.cli", "engine"]
    if spec.engine is EngineKind.SIMULATOR:
        argv = modelpool + ["sim", "--profile", spec.backend_type.value, "--host", options.host, "--port", str(port),
                            "--model", spec.alias, "--speedup", str(options.sim_speedup)]
        if options.sim_startup_s is not None:
            argv += ["--startup-s", str(options.sim_startup_s)]
        if spec.max_model_len:
            argv += ["--max-model-len", str(spec.max_model_len)]
        return argv, env
    if spec.engine is EngineKind.LLAMA_CPP:
        argv = modelpool + ["llama.cpp", "--host", options.host, "--port", str(port), "--model-alias", spec.alias]
        if spec.model_path and spec.model_path != "default":
            argv += ["--model", spec.model_path]
        if options.llama_threads:
            argv += ["--threads", str(options.llama_threads)]
        return argv, env
    # The real vLLM server. Its sleep endpoints are only mounted in dev mode.
    env["VLLM_SERVER_DEV_MODE"] = "1"
    argv = [options.vllm_binary, "serve", spec.model_path, "--host", options.host, "--port", str(port),
            "--served-model-name", spec.alias, "--enable-sleep-mode",
            "--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.max_model_len:
        argv += ["--max-model-len", str(spec.max_model_len)]
    return argv, env


@dataclass
class EngineProcess:
    instance_id: str
    backend_type: BackendType
    engine: EngineKind
    endpoint: str
    process: asyncio.subprocess.Process
    client: httpx.AsyncClient = field(repr=False)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def wait_healthy(self, timeout_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if not self.alive:
                raise EngineError(f"engine exited with code {self.process.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError):
                if (await self.client.get("/health", timeout=2.0)).status_code == 200:
                    return
            if asyncio.get_running_loop().time() > deadline:
                raise EngineError(f"engine not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)

    async def sleep(self, level: int) -> None:
        response = await self.client.post("/sleep", params={"level": level}, timeout=120.0)
        if response.status_code != 200:
            raise EngineError(f"/sleep?level={level} answered {response.status_code}: {response.text[:200]}")

    async def wake(self) -> None:
        response = await self.client.post("/wake_up", timeout=120.0)
        if response.status_code != 200:
            raise EngineError(f"/wake_up answered {response.status_code}: {response.text[:200]}")

    async def inflight(self) -> int:
        """Requests running or waiting, read from the engine's Prometheus metrics."""
        text = (await self.client.get("/metrics", timeout=5.0)).text
        total = 0.0
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "llamacpp:requests_processing", "llamacpp:requests_deferred",
                     "modelpool_engine_requests_running", "modelpool_engine_requests_waiting"):
            for match in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE):
                total += float(match.group(1))
        return int(total)

    async def stop(self, grace_s: float = 10.0) -> None:
        await self.client.aclose()
        if not self.alive:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), grace_s)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the worker dies, even by SIGKILL.

    Without this an engine (and its GPU memory) would outlive a crashed worker
    with nobody left who knows it exists.
    """
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class EngineLauncher:
    """Starts engine processes for a worker; each in its own process group."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options

    async def launch(self, spec: StartInstance) -> EngineProcess:
        port = free_port(self.options.host)
        argv, extra_env = engine_argv(spec, port, self.options)
        log.info("starting %s engine for %s: %s", spec.engine.value, spec.instance_id, " ".join(argv))
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, env={**os.environ, **extra_env}, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                stdin=asyncio.subprocess.DEVNULL,
            )
        except OSError as exc:
            raise EngineError(f"cannot start {argv[0]}: {exc.strerror}") from exc
        endpoint = f"http://{self.options.host}:{port}"
        return EngineProcess(spec.instance_id, spec.backend_type, spec.engine, endpoint, process,
                             httpx.AsyncClient(base_url=endpoint))
