"""The GPU memory a worker offers: a number, or `auto` read off nvidia-smi (a script standing in for it here,
saying what a machine with two 80 GB GPUs says, or something broken)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.worker.gpus import gpus
from shared.contracts.config import ConfigError
from shared.settings import Settings


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
    """Put an `nvidia-smi` printing `output` (exiting with `status`) first on the PATH."""
    def install(output: str, status: int = 0) -> None:
        script = tmp_path / "nvidia-smi"
        script.write_text(f"#!/bin/sh\nprintf '%s' '{output}'\nexit {status}\n")
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    return install


def test_a_number_is_taken_as_it_is_and_auto_is_accepted_as_a_setting():
    assert Settings.load({"MODELPOOL_WORKER_GPU_MEMORY_GB": "24"}).worker_gpu_memory_gb == 24.0
    assert Settings.load({"MODELPOOL_WORKER_GPU_MEMORY_GB": "auto"}).worker_gpu_memory_gb == "auto"
    with pytest.raises(ConfigError, match="worker_gpu_memory_gb"):
        Settings.load({"MODELPOOL_WORKER_GPU_MEMORY_GB": "lots"})
    assert gpus(24.0) == (24.0, 1)
    assert Settings.load({"MODELPOOL_WORKER_GPUS": "4"}).worker_gpus == 4
    with pytest.raises(ConfigError, match="worker_gpus"):
        Settings.load({"MODELPOOL_WORKER_GPUS": "0"})


def test_auto_sums_what_the_gpus_hold(nvidia_smi):
    nvidia_smi("81920\n81920\n")  # MiB per GPU, as --format=csv,noheader,nounits prints it
    assert gpus("auto") == (160.0, 2)


@pytest.mark.parametrize("output, status, says", [
    ("", 0, "no GPU"),
    ("[N/A]\n", 0, "not a memory size"),
    ("NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver", 9, "failed (9)"),
])
def test_auto_that_cannot_be_read_is_a_configuration_error_naming_the_variable(nvidia_smi, output, status, says):
    nvidia_smi(output, status)
    with pytest.raises(ConfigError, match="worker_gpu_memory_gb") as raised:
        gpus("auto")
    assert says in raised.value.message and raised.value.source == "environment variable MODELPOOL_WORKER_GPU_MEMORY_GB"


def test_a_worker_without_nvidia_smi_stops_before_connecting_saying_why(tmp_path):
    env = {"PATH": str(tmp_path), "MODELPOOL_WORKER_GPU_MEMORY_GB": "auto",
           "NATS_URL": "nats://127.0.0.1:1", "DATABASE_URL": "postgresql://127.0.0.1:1/none"}
    done = subprocess.run([sys.executable, "-m", "services.cli", "worker"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 2
    assert "configuration error: worker_gpu_memory_gb" in done.stderr and "nvidia-smi" in done.stderr
