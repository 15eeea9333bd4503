"""Engines start with a scrubbed environment: the worker's database URL, API keys and admin token never reach a
process that runs a model; what an engine needs (its own settings, the cluster secret) does."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.engines import EngineLauncher, EngineOptions, engine_environment
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.commands import StartInstance
from shared.internal_auth import SECRET_ENV

pytestmark = pytest.mark.processes

WORKER_ENVIRONMENT = {
    "PATH": "/usr/bin", "HOME": "/home/w", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "CUDA_VISIBLE_DEVICES": "0",
    "MODELPOOL_SIM_ENGINE_SPEEDUP": "50", "MODELPOOL_LLAMACPP_THREADS": "2", "MODELPOOL_UP_RUN": "run-1",
    "DATABASE_URL": "postgresql://modelpool:hunter2@db:5432/modelpool", "NATS_URL": "nats://u:p@nats:4222",
    "MODELPOOL_ADMIN_TOKEN": "admin-token-0123456789", "MODELPOOL_API_KEYS": "sk-a,sk-b",
    "OPENAI_API_KEY": "sk-upstream", "AWS_SECRET_ACCESS_KEY": "aws", "HF_TOKEN": "hf_secret",
    "MODELPOOL_CLUSTER_SECRET_FILE": "/credentials/cluster-secret", "OTEL_EXPORTER_OTLP_HEADERS": "auth=token",
}


def test_the_engine_environment_keeps_what_engines_need_and_nothing_secret() -> None:
    env = engine_environment(WORKER_ENVIRONMENT, b"c" * 40)
    assert env == {"PATH": "/usr/bin", "HOME": "/home/w", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                   "CUDA_VISIBLE_DEVICES": "0", "MODELPOOL_SIM_ENGINE_SPEEDUP": "50",
                   "MODELPOOL_LLAMACPP_THREADS": "2", "MODELPOOL_UP_RUN": "run-1", SECRET_ENV: "c" * 40}
    assert SECRET_ENV not in engine_environment(WORKER_ENVIRONMENT, None)


async def test_a_launched_engine_process_holds_no_secret_of_the_worker(tmp_path: Path, monkeypatch) -> None:
    for key, value in WORKER_ENVIRONMENT.items():
        if key not in ("PATH", "HOME", "MODELPOOL_CLUSTER_SECRET_FILE"):
            monkeypatch.setenv(key, value)
    launcher = EngineLauncher(EngineOptions(log_dir=tmp_path, sim_speedup=200, cluster_secret=b"c" * 40), "w1-marker")
    spec = StartInstance(instance_id="v1", alias="a", backend_type=BackendType.VLLM, worker_id="w1",
                         engine=EngineKind.SIMULATOR, model_name="q", model_path="/m/q", gpu_memory_gb=12)
    process = await launcher.launch(spec)
    try:
        await process.wait_healthy(30)
        raw = Path(f"/proc/{process.process.pid}/environ").read_bytes()
        env = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    finally:
        await process.stop(grace_s=5)
    inherited = set(WORKER_ENVIRONMENT) & set(env)
    assert inherited <= {"PATH", "HOME", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "MODELPOOL_SIM_ENGINE_SPEEDUP",
                         "MODELPOOL_LLAMACPP_THREADS", "MODELPOOL_UP_RUN"}, inherited
    for secret in ("hunter2", "admin-token-0123456789", "sk-upstream", "hf_secret", "sk-a,sk-b"):
        assert secret not in raw.decode(), secret
    assert env[SECRET_ENV] == "c" * 40 and env["MODELPOOL_SIM_ENGINE_SPEEDUP"] == "50"
