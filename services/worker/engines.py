"""Running engine processes on this machine and talking to them over HTTP.

One `EngineProcess` per instance: the real llama.cpp engine, the real
`vllm serve` (sleep mode on), or the simulator standing in for either. Control
goes through each engine's documented HTTP API — `/health`, `/metrics`,
`/v1/models`, llama.cpp's `/slots`, and vLLM's sleep mode (`EngineProcess.sleep`,
`wake`) — so the worker drives a simulated vLLM exactly as it would drive a real
one. Each engine's stdout and stderr go to a log file of its instance, whose
last lines say why an engine died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import orjson

from services.engines.llama_server.binary import LlamaServerMissing, llama_server_binary
from services.engines.llamacpp.model_files import default_model_path
from services.processes import RUN_MARKER, processes_with_marker, spawn_async
from services.worker.status import METRIC_NAMES, EngineStatus, Scrape, StatusTracker, parse_scrape
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.commands import StartInstance
from shared.internal_auth import SECRET_ENV, sign
from shared.net import free_ports

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 2.0
"""For the worker's reads of an engine's state: one that takes longer is reported as not answering."""
ADMIN_TIMEOUT_S = 120.0
"""For one sleep-mode call: a level-2 wake reloads the weights from disk."""


class EngineError(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineOptions:
    """How this worker launches engines (worker-level settings, not per instance)."""

    log_dir: Path
    """Each engine's stdout and stderr go to `<log_dir>/<instance_id>.log`."""
    host: str = "127.0.0.1"
    sim_speedup: float = 1.0
    sim_startup_s: float | None = None
    llama_threads: int | None = None
    vllm_binary: str = "vllm"
    gpu_memory_per_gpu_gb: float | None = None
    """Memory of each of this worker's GPUs: a vLLM instance is given its share of one as
    `--gpu-memory-utilization`, so instances placed side by side fit. None: vLLM's own default."""
    cluster_secret: bytes | None = None
    """Given to engines with an internal port: what signs the KV they move (shared/internal_auth.py)."""


ENGINE_ENVIRONMENT = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH",
                      "PYTHONUNBUFFERED", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "HF_HOME",
                      "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MODELPOOL_CACHE_DIR",
                      "MODELPOOL_LLAMA_SERVER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME", RUN_MARKER)
ENGINE_ENVIRONMENT_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "VLLM_", "MODELPOOL_LLAMACPP_", "MODELPOOL_SIM_")
"""What an engine inherits from its worker, and nothing else: no database URL, API key or admin token reaches a
process that runs a model (whose code, for vLLM with `trust-remote-code`, may come from a model repository).
Each is what an engine or its libraries read: locale, paths, GPU and thread selection, model caches, the engines'
own settings, tracing's endpoint, and `modelpool up`'s run marker (by which it sweeps what it started)."""


def engine_environment(environ: Mapping[str, str], secret: bytes | None) -> dict[str, str]:
    """The worker's environment scrubbed to `ENGINE_ENVIRONMENT`, with the cluster secret where there is one."""
    env = {k: v for k, v in environ.items() if k in ENGINE_ENVIRONMENT or k.startswith(ENGINE_ENVIRONMENT_PREFIXES)}
    if secret is not None:
        env[SECRET_ENV] = secret.decode()
    return env


def default_log_dir(worker_id: str) -> Path:
    return Path(tempfile.gettempdir()) / f"modelpool-worker-{worker_id}"


def engine_argv(spec: StartInstance, port: int, options: EngineOptions,
                internal_port: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line (and extra environment) that starts the engine for `spec`.

    `internal_port`, for engines that can export and import a session's KV
    (`has_internal_port`), is where the gateway moves it; it binds the
    worker's host like the public port, and is recorded apart from it.

    Engines are told not to log a line per HTTP request: the worker reads their
    /metrics every second, and their log is kept for its last lines, which must
    say why an engine died.
    """
    argv, env = _base_argv(spec, port, options)
    if internal_port is not None and has_internal_port(spec.engine):
        internal = ["--internal-host", options.host, "--internal-port", str(internal_port)]
        if spec.engine is EngineKind.LLAMA_SERVER:  # the C++ server under modelpool's KV port (its child)
            argv = [*MODELPOOL_ENGINE, "llama-server", "--binary", argv[0], *internal, "--", *argv[1:]]
        else:
            argv += internal
    return argv + engine_flags(spec.engine_args), env


MODELPOOL_ENGINE = (sys.executable, "-m", "services.cli", "engine")
DEV_ENDPOINT_GUARD = "services.engines.vllm_guard.SignedDevEndpoints"
"""vLLM's `--middleware` that admits only signed calls to its development endpoints (sleep, wake, collective RPC)."""


def safe_name(instance_id: str) -> str:
    """`instance_id` as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", instance_id)


def has_internal_port(engine: EngineKind) -> bool:
    """Whether the engine serves KV export and import (llama-server through its slot files; vLLM has no such
    API: a moved session recomputes)."""
    return engine in (EngineKind.LLAMA_CPP, EngineKind.LLAMA_SERVER, EngineKind.SIMULATOR)


def engine_flags(args: dict[str, str | int | float | bool]) -> list[str]:
    """The alias's own engine arguments as flags: `{startup-s: 10, enforce-eager: true}` ->
    `--startup-s 10 --enforce-eager` (a false flag is left out)."""
    flags: list[str] = []
    for name, value in args.items():
        if value is True:
            flags.append(f"--{name}")
        elif value is not False:
            flags += [f"--{name}", str(value)]
    return flags


def _base_argv(spec: StartInstance, port: int, options: EngineOptions) -> tuple[list[str], dict[str, str]]:
    env: dict[str, str] = {}
    modelpool = list(MODELPOOL_ENGINE)
    if spec.engine is EngineKind.SIMULATOR:
        argv = modelpool + ["sim", "--profile", spec.backend_type.value, "--host", options.host, "--port", str(port),
                            "--model", spec.alias, "--speedup", str(options.sim_speedup)]
        if options.sim_startup_s is not None:
            argv += ["--startup-s", str(options.sim_startup_s)]
        if spec.max_model_len:
            argv += ["--max-model-len", str(spec.max_model_len)]
        if spec.backend_type is BackendType.VLLM:  # the same development endpoints as a real vLLM's, guarded alike
            argv += ["--middleware", DEV_ENDPOINT_GUARD]
        return argv, env
    if spec.engine is EngineKind.LLAMA_CPP:
        argv = modelpool + ["llama.cpp", "--host", options.host, "--port", str(port), "--model-alias", spec.alias,
                            "--log-level", "warning"]
        if spec.model_path and spec.model_path != "default":
            argv += ["--model", spec.model_path]
        if options.llama_threads:
            argv += ["--threads", str(options.llama_threads)]
        return argv, env
    if spec.engine is EngineKind.LLAMA_SERVER:
        return llama_server_argv(spec, port, options), env
    # The real vLLM server. Its sleep endpoints are only mounted in dev mode, and then open to anyone who
    # reaches the port: the guard loaded into it lets only calls signed with the cluster secret (the worker's) in.
    env["VLLM_SERVER_DEV_MODE"] = "1"
    argv = [options.vllm_binary, "serve", spec.model_path, "--host", options.host, "--port", str(port),
            "--served-model-name", spec.alias, "--enable-sleep-mode", "--disable-uvicorn-access-log",
            "--tensor-parallel-size", str(spec.tensor_parallel_size), "--middleware", DEV_ENDPOINT_GUARD]
    if spec.max_model_len:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if options.gpu_memory_per_gpu_gb and "gpu-memory-utilization" not in spec.engine_args:
        argv += ["--gpu-memory-utilization", f"{gpu_memory_utilization(spec, options.gpu_memory_per_gpu_gb):.4f}"]
    return argv, env


LLAMA_SERVER_DEFAULTS: dict[str, str | int | float | bool] = {"parallel": 8, "ctx-size": 16384}
"""As modelpool's own engine runs by default: 8 sequence slots of 2048 tokens each. The alias's `engine_args`
override them (`{parallel: 4}`)."""


def llama_server_argv(spec: StartInstance, port: int, options: EngineOptions) -> list[str]:
    """llama.cpp's C++ server: continuous batching over `--parallel` slots, its Prometheus `/metrics` and
    `/slots` on, slots saved to and restored from the instance's own directory."""
    model = spec.model_path if spec.model_path and spec.model_path != "default" else str(default_model_path())
    try:
        binary = llama_server_binary()
    except LlamaServerMissing as exc:
        raise EngineError(str(exc)) from None
    argv = [str(binary), "--model", model, "--host", options.host, "--port", str(port),
            "--alias", spec.alias, "--cont-batching", "--metrics", "--slots", "--no-webui",
            "--slot-save-path", str(slot_dir(spec, options))]
    if options.llama_threads:
        argv += ["--threads", str(options.llama_threads)]
    return argv + engine_flags({k: v for k, v in LLAMA_SERVER_DEFAULTS.items() if k not in spec.engine_args})


def slot_dir(spec: StartInstance, options: EngineOptions) -> Path:
    """Where a llama-server instance saves and restores its slots (created before it starts: it must exist)."""
    return options.log_dir / f"{safe_name(spec.instance_id)}.slots"


def gpu_memory_utilization(spec: StartInstance, per_gpu_gb: float) -> float:
    """The share of each of its GPUs a vLLM instance may take: its configured memory spread over its
    tensor-parallel ranks, over one GPU's memory. vLLM's default (0.9 of the whole GPU) would let the
    first of two instances placed on one GPU take the memory of both."""
    share = spec.gpu_memory_gb / spec.tensor_parallel_size / per_gpu_gb
    if not 0 < share <= 1:
        raise EngineError(f"{spec.instance_id} takes {spec.gpu_memory_gb:g} GB over {spec.tensor_parallel_size} "
                          f"GPU(s), which does not fit GPUs of {per_gpu_gb:g} GB")
    return share


@dataclass
class EngineProcess:
    instance_id: str
    backend_type: BackendType
    engine: EngineKind
    endpoint: str
    internal_endpoint: str | None
    process: asyncio.subprocess.Process
    client: httpx.AsyncClient = field(repr=False)
    log_path: Path
    log_start: int
    """Where this process's output starts in its log file (an instance restarted after ERROR appends)."""
    tracker: StatusTracker = field(repr=False)
    secret: bytes | None = field(default=None, repr=False)
    """The cluster secret, signing calls to vLLM's development endpoints."""
    capacity: int | None = None
    stop_requested: bool = False
    """The worker stopped it: its exit is no failure."""
    sleep_level: int = 0
    """The level it was put to sleep at (0: awake). An engine outlives no worker (`kill_leftover_engines`),
    so this is known whenever it is needed: a level-2 wake reloads the weights."""

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    @property
    def exit_code(self) -> int | None:
        return self.process.returncode

    async def wait_exit(self) -> int:
        return await self.process.wait()

    async def wait_healthy(self, timeout_s: float, loading: Callable[[], Awaitable[None]] | None = None) -> None:
        """Until `/health` answers 200; `loading` is called once at its first other answer (the engine is up and
        loads its model: llama.cpp's 503 `loading`)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        port = int(self.endpoint.rsplit(":", 1)[1])
        while True:
            if not self.alive:
                raise EngineError(f"engine exited with code {self.exit_code} while starting")
            with contextlib.suppress(httpx.HTTPError):
                status = (await self.client.get("/health", timeout=2.0)).status_code
                # The port was free when it was chosen, not necessarily when the engine
                # bound it: make sure the answer came from our engine, not a stranger.
                if (status == 200 or loading is not None) and listens_elsewhere(self.process.pid, port):
                    raise EngineError(f"port {port} was taken by another process before the engine could bind it")
                if status == 200:
                    return
                if loading is not None:
                    await loading()
                    loading = None
            if asyncio.get_running_loop().time() > deadline:
                raise EngineError(f"engine not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)

    async def answers(self, timeout_s: float = READ_TIMEOUT_S) -> bool:
        """Whether the engine answers `/health` now (any answer: a 503 while it loads is an answer)."""
        try:
            await self.client.get("/health", timeout=timeout_s)
        except (httpx.HTTPError, RuntimeError):  # RuntimeError: the client was closed as the engine stopped
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the engine and everything it started, at once (a hung engine would not heed SIGTERM)."""
        self.stop_requested = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    async def sleep(self, level: int) -> None:
        """vLLM's `POST /sleep?level=N`, told to let requests under way finish (`mode=wait`): its default,
        `abort`, would cut off a request routed in just before the sleep. The controller sleeps only idle
        instances, so the wait is short."""
        await self._admin("POST", "/sleep", params={"level": level, "mode": "wait"})
        self.sleep_level = level

    async def wake(self) -> None:
        """vLLM's `POST /wake_up`. Level 2 discarded the weights, and a plain wake-up only remaps their memory,
        empty: the engine would answer garbage. So, as vLLM's sleep-mode guide does it, the weights' memory is
        woken, the weights loaded again in place (`reload_weights`), then the KV cache woken."""
        if self.sleep_level == 2:
            await self._admin("POST", "/wake_up", params={"tags": "weights"})
            await self._admin("POST", "/collective_rpc", json={"method": "reload_weights"})
            await self._admin("POST", "/wake_up", params={"tags": "kv_cache"})
        else:
            await self._admin("POST", "/wake_up")
        self.sleep_level = 0

    async def _admin(self, method: str, path: str, params: dict[str, Any] | None = None,
                     json: dict[str, Any] | None = None) -> None:
        """A call to vLLM's development endpoints, signed with the cluster secret (its guard refuses others)."""
        target = f"{path}?{urlencode(params)}" if params else path
        body = orjson.dumps(json) if json is not None else b""
        headers = {"content-type": "application/json"} if json is not None else {}
        if self.secret is not None:
            headers.update(sign(self.secret, method, target, body))
        response = await self.client.request(method, target, content=body, headers=headers, timeout=ADMIN_TIMEOUT_S)
        if response.status_code != 200:
            raise EngineError(f"{method} {target} answered {response.status_code}: {response.text[:200]}")

    async def inflight(self) -> int:
        """Requests running or waiting, read from the engine's Prometheus metrics."""
        return (await self._scrape()).inflight

    async def read_status(self) -> EngineStatus:
        return self.tracker.observe(await self._scrape(), datetime.now(timezone.utc))

    async def read_capacity(self) -> int:
        """Concurrent requests the engine takes, asked once: it is fixed for the process's life.

        llama.cpp: its sequence slots, as `/slots` lists them. vLLM: how many
        requests of `max_model_len` tokens its KV cache holds at once, from
        `vllm:cache_config_info` (num_gpu_blocks x block_size) and `/v1/models`.
        """
        if self.capacity is not None:
            return self.capacity
        try:
            if self.backend_type is BackendType.LLAMA_CPP:
                body = (await self._get("/slots")).json()
                slots = body["slots"] if isinstance(body, dict) else body  # modelpool's engine wraps the list
                capacity = len(slots)
            else:
                kv_tokens = (await self._scrape()).kv_cache_tokens
                if kv_tokens is None:
                    raise EngineError("/metrics has no vllm:cache_config_info with num_gpu_blocks and block_size")
                max_model_len = int((await self._get("/v1/models")).json()["data"][0]["max_model_len"])
                capacity = kv_tokens // max_model_len
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"cannot read the engine's capacity: {exc!r}") from exc
        if capacity <= 0:
            raise EngineError(f"the engine reports a capacity of {capacity}")
        self.capacity = capacity
        return capacity

    async def _scrape(self) -> Scrape:
        text = (await self._get("/metrics")).text
        return parse_scrape(text, METRIC_NAMES[self.backend_type], asyncio.get_running_loop().time())

    async def _get(self, path: str) -> httpx.Response:
        response = await self.client.get(path, timeout=READ_TIMEOUT_S)
        if response.status_code != 200:
            raise EngineError(f"GET {path} answered {response.status_code}: {response.text[:200]}")
        return response

    def log_tail(self, max_lines: int = 20, max_bytes: int = 4096) -> str:
        """The last lines this process wrote to its log."""
        try:
            with open(self.log_path, "rb") as log_file:
                end = log_file.seek(0, os.SEEK_END)
                start = max(self.log_start, end - max_bytes)
                log_file.seek(start)
                lines = log_file.read(end - start).decode(errors="replace").splitlines()
        except OSError as exc:
            return f"(cannot read {self.log_path}: {exc.strerror})"
        if start > self.log_start and len(lines) > 1:
            lines = lines[1:]  # the first one is cut
        return "\n".join(lines[-max_lines:])

    async def stop(self, grace_s: float = 10.0) -> None:
        self.stop_requested = True
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), grace_s)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                await self.process.wait()
        # Closed last: a call still in flight fails as a connection error, and a later
        # one finds the process gone, rather than meeting a closed client.
        await self.client.aclose()


def listens_elsewhere(pid: int, port: int) -> bool:
    """Whether the socket listening on `port` belongs to a process outside `pid`'s process group (Linux).

    False when it cannot be told (no /proc): the health answer is then taken as it is.
    """
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(fields[9])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    if not inodes:
        return False
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != group:
                continue
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return False
        except (OSError, ProcessLookupError):
            continue
    return True


ENGINE_MARKER = "MODELPOOL_ENGINE_OF"
"""Set in every engine's environment to `<namespace>/<worker id>`: a restarted worker finds its predecessor's engines by it."""


def leftover_engines(marker: str) -> list[int]:
    """Pids of processes carrying `ENGINE_MARKER=marker`: engines started under this mark, and what they started."""
    return processes_with_marker(f"{ENGINE_MARKER}={marker}")


def kill_leftover_engines(marker: str) -> list[int]:
    """Kill the engines an earlier life of this worker left running (it was SIGKILLed, say); their pids.

    Whatever they served is recorded ERROR by the worker's reconcile; nothing is adopted.
    """
    pids = leftover_engines(marker)
    for pid in pids:
        log.warning("killing engine process %d left by an earlier run of this worker", pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return pids


class EngineLauncher:
    """Starts engine processes for a worker; each in its own process group, marked as this worker's."""

    def __init__(self, options: EngineOptions, marker: str = "") -> None:
        self.options = options
        self.marker = marker

    async def launch(self, spec: StartInstance) -> EngineProcess:
        port, *internal = free_ports(2 if has_internal_port(spec.engine) else 1, self.options.host)
        internal_port = internal[0] if internal else None
        argv, extra_env = engine_argv(spec, port, self.options, internal_port)
        log.info("starting %s engine for %s: %s", spec.engine.value, spec.instance_id, " ".join(argv))
        log_path = self.options.log_dir / f"{safe_name(spec.instance_id)}.log"
        try:
            self.options.log_dir.mkdir(parents=True, exist_ok=True)
            if spec.engine is EngineKind.LLAMA_SERVER:
                slot_dir(spec, self.options).mkdir(exist_ok=True)
            with open(log_path, "ab") as log_file:
                log_file.write(f"--- {datetime.now(timezone.utc).isoformat()} modelpool worker: {' '.join(argv)}\n".encode())
                log_file.flush()
                log_start = log_file.tell()
                # SIGTERM when the worker dies, even by SIGKILL: an engine (and its GPU memory) must not outlive
                # a crashed worker with nobody left who knows it exists.
                env = {**engine_environment(os.environ, self.options.cluster_secret), **extra_env,
                       ENGINE_MARKER: self.marker}
                process = await spawn_async(argv, output=log_file, env=env)
        except OSError as exc:
            raise EngineError(f"cannot start {argv[0]}: {exc.strerror} ({exc.filename or log_path})") from exc
        endpoint = f"http://{self.options.host}:{port}"
        internal = f"http://{self.options.host}:{internal_port}" if internal_port is not None else None
        return EngineProcess(spec.instance_id, spec.backend_type, spec.engine, endpoint, internal, process,
                             httpx.AsyncClient(base_url=endpoint), log_path, log_start,
                             StatusTracker(asyncio.get_running_loop().time()), secret=self.options.cluster_secret)
