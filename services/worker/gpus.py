"""The GPU memory a worker offers and over how many GPUs: configured, or (`auto`) what the machine's NVIDIA
GPUs hold together.

`auto` is for workers deployed where one configuration serves machines of several sizes (a DaemonSet over
GPU nodes): `nvidia-smi` reports each visible GPU's total memory, and the worker offers their sum. The count
gives each vLLM instance its share of one GPU (`--gpu-memory-utilization`).
"""

from __future__ import annotations

import subprocess

from shared.contracts.config import ConfigError

SOURCE = "environment variable MODELPOOL_WORKER_GPU_MEMORY_GB"
QUERY = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]


def gpus(configured: float | str, count: int | None = None) -> tuple[float, int]:
    """The GB offered and the GPUs they are spread over: `configured` as a number of GB on `count` GPUs (one
    unless told), or, for `auto`, the visible GPUs' total memory in GB (GiB, as nvidia-smi counts it) and
    their number; a `ConfigError` saying why when it cannot be read."""
    if configured != "auto":
        return float(configured), count or 1
    try:
        done = subprocess.run(QUERY, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise ConfigError("worker_gpu_memory_gb", "`auto` needs nvidia-smi, which is not on the PATH: "
                          "set the GB this worker offers instead", SOURCE) from None
    except subprocess.TimeoutExpired:
        raise ConfigError("worker_gpu_memory_gb", "`auto`: nvidia-smi did not answer within 30 s", SOURCE) from None
    if done.returncode != 0:
        raise ConfigError("worker_gpu_memory_gb", f"`auto`: nvidia-smi failed ({done.returncode}): "
                          f"{(done.stderr or done.stdout).strip()[:300]}", SOURCE)
    try:
        mib = [float(line) for line in done.stdout.split()]
    except ValueError:
        raise ConfigError("worker_gpu_memory_gb", f"`auto`: nvidia-smi reported {done.stdout.strip()[:300]!r}, "
                          "not a memory size per GPU", SOURCE) from None
    if not mib or any(m <= 0 for m in mib):
        raise ConfigError("worker_gpu_memory_gb", "`auto`: nvidia-smi reported no GPU with memory", SOURCE)
    return round(sum(mib) / 1024, 1), count or len(mib)
