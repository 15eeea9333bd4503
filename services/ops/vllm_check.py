"""`modelpool vllm-check`: the worker's vLLM adapter against a real `vllm serve`, on a machine with a GPU.

It drives one engine through what the pool does to a vLLM instance, with the
worker's own code (`EngineLauncher`, `EngineProcess`): start it (sleep mode on,
its share of the GPU), answer, sleep at level 1, wake, answer, sleep at level 2,
wake (weights woken, reloaded, KV cache woken), answer, stop. Each answer is
greedy (temperature 0), so the three must be the same text: a wake that left the
weights empty would change it. Every step is timed; the result is one JSON line.

Without a GPU (`nvidia-smi`) or without `vllm` on the PATH it says which is
missing and exits 2: it never stands in a simulator for the real engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from services.worker.engines import EngineLauncher, EngineOptions, EngineProcess
from services.worker.gpus import gpus
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.commands import StartInstance

PROMPT = "List the first five prime numbers, separated by commas."


def missing(vllm_binary: str) -> str | None:
    """What this machine lacks to run the check, or None."""
    if shutil.which("nvidia-smi") is None:
        return "no GPU here: nvidia-smi is not on the PATH"
    if shutil.which(vllm_binary) is None:
        return f"no vLLM here: {vllm_binary!r} is not on the PATH (pip install vllm)"
    return None


async def answer(process: EngineProcess, alias: str) -> str:
    response = await process.client.post("/v1/chat/completions", timeout=120.0, json={
        "model": alias, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32, "temperature": 0})
    if response.status_code != 200:
        raise RuntimeError(f"chat answered {response.status_code}: {response.text[:300]}")
    return str(response.json()["choices"][0]["message"]["content"])


async def check(args: argparse.Namespace) -> dict[str, Any]:
    memory_gb, count = gpus("auto")
    per_gpu_gb = memory_gb / count
    spec = StartInstance(instance_id="vllm-check-1", alias="vllm-check", backend_type=BackendType.VLLM,
                         worker_id="vllm-check", engine=EngineKind.VLLM, model_name=args.model, model_path=args.model,
                         gpu_memory_gb=args.gpu_memory_gb or round(per_gpu_gb * 0.5, 1),
                         max_model_len=args.max_model_len)
    options = EngineOptions(log_dir=Path(args.log_dir), vllm_binary=args.vllm, gpu_memory_per_gpu_gb=per_gpu_gb)
    timings: dict[str, float] = {}
    answers: dict[str, str] = {}

    async def timed(step: str, call: Any) -> Any:
        began = time.perf_counter()
        result = await call
        timings[f"{step}_s"] = round(time.perf_counter() - began, 3)
        print(f"[vllm-check] {step}: {timings[f'{step}_s']:.2f} s", file=sys.stderr)
        return result

    process = await EngineLauncher(options, marker="vllm-check").launch(spec)
    try:
        await timed("start", process.wait_healthy(args.start_timeout_s))
        capacity = await process.read_capacity()
        answers["fresh"] = await timed("first_answer", answer(process, spec.alias))
        for level in (1, 2):
            await timed(f"sleep_l{level}", process.sleep(level))
            await timed(f"wake_l{level}", process.wake())
            answers[f"after_l{level}"] = await timed(f"answer_after_l{level}", answer(process, spec.alias))
    except Exception:
        print(f"[vllm-check] the engine's last lines:\n{process.log_tail(40)}", file=sys.stderr)
        raise
    finally:
        await timed("stop", process.stop())
    same = answers["after_l1"] == answers["fresh"] == answers["after_l2"]
    return {"engine": "vllm (real)", "model": args.model, "gpus": count, "gpu_memory_gb": memory_gb,
            "instance_gpu_memory_gb": spec.gpu_memory_gb, "capacity": capacity, **timings,
            "same_answer_after_each_wake": same, "answers": answers}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool vllm-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B", help="model to serve (a hub id or a local path)")
    parser.add_argument("--vllm", default="vllm", help="the vllm executable")
    parser.add_argument("--gpu-memory-gb", type=float, help="the instance's GPU memory (default: half of one GPU)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--start-timeout-s", type=float, default=900.0)
    parser.add_argument("--log-dir", default=tempfile.mkdtemp(prefix="modelpool-vllm-check-"))
    args = parser.parse_args(argv)
    if (lacking := missing(args.vllm)) is not None:
        print(f"modelpool vllm-check: {lacking}; this check runs only against a real vLLM on a GPU", file=sys.stderr)
        return 2
    result = asyncio.run(check(args))
    print(json.dumps(result))
    return 0 if result["same_answer_after_each_wake"] else 1
