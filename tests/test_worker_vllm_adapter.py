"""The worker's vLLM adapter against vLLM's documented API: the command line a real `vllm serve` gets, and the
exact calls of a sleep and of a wake from either level (recorded by a transport standing in for the server).
The same calls against the simulated vLLM, which refuses to answer with weights never reloaded, are in
tests/test_worker.py and tests/engines_simulated/test_sim_engine_sleep.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.worker.engines import EngineError, EngineOptions, EngineProcess, engine_argv
from services.worker.status import StatusTracker
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.commands import StartInstance


def vllm_start(gpu_memory_gb: float = 12, tensor_parallel_size: int = 1, **engine_args: str | float) -> StartInstance:
    return StartInstance(instance_id="big-1", alias="big", backend_type=BackendType.VLLM, worker_id="w1",
                         engine=EngineKind.VLLM, model_name="Qwen/Qwen3-8B", model_path="/models/qwen3-8b",
                         gpu_memory_gb=gpu_memory_gb, tensor_parallel_size=tensor_parallel_size,
                         max_model_len=8192, engine_args=engine_args)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_vllm_is_given_its_share_of_a_gpu_so_instances_placed_side_by_side_fit(tmp_path: Path) -> None:
    options = EngineOptions(log_dir=tmp_path, gpu_memory_per_gpu_gb=24)
    argv, env = engine_argv(vllm_start(12), 8000, options)
    assert argv[:3] == ["vllm", "serve", "/models/qwen3-8b"]
    assert flag(argv, "--gpu-memory-utilization") == "0.5000"  # two such instances on one 24 GB GPU
    assert "--enable-sleep-mode" in argv and env == {"VLLM_SERVER_DEV_MODE": "1"}
    # ... whose development endpoints (sleep, wake, collective RPC) only the worker's signed calls reach.
    assert flag(argv, "--middleware") == "services.engines.vllm_guard.SignedDevEndpoints"
    assert flag(argv, "--max-model-len") == "8192" and flag(argv, "--served-model-name") == "big"

    argv, _ = engine_argv(vllm_start(36, tensor_parallel_size=2), 8000, options)
    assert flag(argv, "--gpu-memory-utilization") == "0.7500"  # 18 GB on each of two GPUs
    assert flag(argv, "--tensor-parallel-size") == "2"

    argv, _ = engine_argv(vllm_start(12, **{"gpu-memory-utilization": 0.3}), 8000, options)
    assert argv.count("--gpu-memory-utilization") == 1 and flag(argv, "--gpu-memory-utilization") == "0.3"

    argv, _ = engine_argv(vllm_start(12), 8000, EngineOptions(log_dir=tmp_path))
    assert "--gpu-memory-utilization" not in argv  # a worker that offers no GPU memory says nothing

    with pytest.raises(EngineError, match="does not fit GPUs of 24 GB"):
        engine_argv(vllm_start(30), 8000, options)


class RecordingVllm:
    """Answers every call 200 (or `fail` for one path) and keeps them in order."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def __call__(self, request: httpx.Request) -> httpx.Response:
        query = f"?{request.url.query.decode()}" if request.url.query else ""
        body = f" {json.loads(request.content)}" if request.content else ""
        self.calls.append(f"{request.method} {request.url.path}{query}{body}")
        return httpx.Response(500 if request.url.path == self.fail else 200, text="engine said no")


def engine(transport: RecordingVllm, tmp_path: Path) -> EngineProcess:
    client = httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(transport))
    return EngineProcess("big-1", BackendType.VLLM, EngineKind.VLLM, "http://vllm:8000", None, process=None,  # type: ignore[arg-type]
                         client=client, log_path=tmp_path / "log", log_start=0, tracker=StatusTracker(0.0))


async def test_a_sleep_waits_for_requests_under_way_and_a_level_2_wake_reloads_the_weights(tmp_path: Path) -> None:
    vllm = RecordingVllm()
    process = engine(vllm, tmp_path)
    await process.sleep(1)
    await process.wake()
    await process.sleep(2)
    await process.wake()
    assert vllm.calls == [
        "POST /sleep?level=1&mode=wait",
        "POST /wake_up",  # level 1: the weights come back from CPU memory
        "POST /sleep?level=2&mode=wait",
        "POST /wake_up?tags=weights",  # level 2, as vLLM's sleep-mode guide wakes it
        "POST /collective_rpc {'method': 'reload_weights'}",
        "POST /wake_up?tags=kv_cache",
    ]
    assert process.sleep_level == 0


async def test_a_reload_the_engine_refuses_fails_the_wake_saying_which_call(tmp_path: Path) -> None:
    vllm = RecordingVllm(fail="/collective_rpc")
    process = engine(vllm, tmp_path)
    await process.sleep(2)
    with pytest.raises(EngineError, match="POST /collective_rpc answered 500: engine said no"):
        await process.wake()
    assert vllm.calls[-1].startswith("POST /collective_rpc")  # the KV cache is not woken over empty weights
    assert process.sleep_level == 2  # still known to need the reload


def test_the_real_vllm_check_says_what_this_machine_lacks_and_fails(tmp_path: Path) -> None:
    """`modelpool vllm-check` never stands a simulator in for the real engine: no GPU, or no vLLM, is exit 2."""
    fake_smi = tmp_path / "nvidia-smi"
    fake_smi.write_text("#!/bin/sh\necho 24576\n")
    fake_smi.chmod(0o755)
    for path, says in ((str(tmp_path / "empty"), "no GPU here"), (str(tmp_path), "no vLLM here")):
        done = subprocess.run([sys.executable, "-m", "services.cli", "vllm-check", "--vllm", "no-such-vllm"],
                              capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": path})
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert done.stdout == ""
