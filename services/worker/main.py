"""`modelpool worker`: register this machine, execute its instance commands, report facts."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import shutil
import socket

from services.runtime import ServiceContext, run_service
from services.worker.engines import EngineLauncher, EngineOptions
from services.worker.service import Worker
from shared.bus.jetstream import Consumer
from shared.contracts.backends import EngineKind
from shared.contracts.commands import InstanceCommand
from shared.contracts.messages import Contract, Envelope

LOAD_REPORT_INTERVAL_S = 2.0


def available_engines() -> list[EngineKind]:
    """Engines this machine can run: the simulator always, the others when installed."""
    engines = [EngineKind.SIMULATOR]
    if importlib.util.find_spec("llama_cpp") is not None:
        engines.append(EngineKind.LLAMA_CPP)
    if shutil.which("vllm") is not None:
        engines.append(EngineKind.VLLM)
    return engines


def default_worker_id() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:64] or "worker"


async def serve(ctx: ServiceContext) -> None:
    settings = ctx.settings
    worker = Worker(
        worker_id=settings.worker_id or default_worker_id(),
        store=ctx.store,
        launcher=EngineLauncher(EngineOptions(sim_speedup=settings.worker_sim_speedup,
                                              health_timeout_s=settings.worker_health_timeout_s)),
        telemetry=ctx.telemetry,
        gpu_memory_gb=settings.worker_gpu_memory_gb,
        slots=settings.worker_slots,
        health_timeout_s=settings.worker_health_timeout_s,
    )
    await worker.register(available_engines())
    await worker.reconcile()

    async def on_command(envelope: Envelope, command: Contract) -> None:
        assert isinstance(command, InstanceCommand)
        await worker.handle(envelope, command)

    consumer = Consumer(
        ctx.js,
        ctx.subjects,
        stream=ctx.subjects.commands_stream,
        durable=f"worker-{worker.worker_id}",
        filter_subject=ctx.subjects.worker_commands(worker.worker_id),
        registry=ctx.commands,
        handler=on_command,
        telemetry=ctx.telemetry,
        # One at a time, in the order sent: a drain then a delete must not swap places.
        batch=1,
    )

    async def report_load() -> None:
        while not ctx.stop.is_set():
            try:
                await asyncio.wait_for(ctx.stop.wait(), LOAD_REPORT_INTERVAL_S)
            except asyncio.TimeoutError:
                await worker.report_load()

    try:
        await asyncio.gather(ctx.consume(consumer), report_load())
    finally:
        await worker.shutdown()


def main(argv: list[str]) -> int:
    return run_service("worker", serve)
