"""`modelpool worker`: register this machine, execute its instance commands, report facts and heartbeats."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import re
import shutil
import socket
from collections import Counter
from pathlib import Path

from nats.js import JetStreamContext

from services.engines.llama_server import binary as llama_server
from services.runtime import ServiceContext, run_service
from services.worker.engines import EngineLauncher, EngineOptions, default_log_dir, kill_leftover_engines
from services.worker.gpus import gpus
from services.worker.service import Worker
from shared.bus.jetstream import Consumer
from shared.bus.subjects import Subjects
from shared.contracts.backends import EngineKind
from shared.contracts.commands import InstanceCommand
from shared.contracts.messages import Contract, Envelope, Registry
from shared.faults import retry_until_done
from shared.settings import Settings
from shared.telemetry import Telemetry

log = logging.getLogger(__name__)


def available_engines() -> list[EngineKind]:
    """Engines this machine can run: the simulator always, the others when installed."""
    engines = [EngineKind.SIMULATOR]
    if importlib.util.find_spec("llama_cpp") is not None:
        engines.append(EngineKind.LLAMA_CPP)
    if llama_server.available():
        engines.append(EngineKind.LLAMA_SERVER)
    if shutil.which("vllm") is not None:
        engines.append(EngineKind.VLLM)
    return engines


def default_worker_id() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:64] or "worker"


def command_consumer(worker: Worker, js: JetStreamContext, subjects: Subjects, commands: Registry,
                     telemetry: Telemetry) -> Consumer:
    """The worker's durable consumer of its instance commands."""

    async def on_command(envelope: Envelope, command: Contract) -> None:
        assert isinstance(command, InstanceCommand)
        await worker.handle(envelope, command)

    def instance_of(command: Contract) -> str:
        assert isinstance(command, InstanceCommand)
        return command.instance_id

    return Consumer(
        js,
        subjects,
        stream=subjects.commands_stream,
        durable=f"worker-{worker.worker_id}",
        filter_subject=subjects.worker_commands(worker.worker_id),
        registry=commands,
        handler=on_command,
        telemetry=telemetry,
        # One instance's commands one at a time, in the order sent (a drain before its
        # delete); different instances' side by side, so a long wake holds up no other start.
        batch=1,
        key_of=instance_of,
    )


async def serve(ctx: ServiceContext) -> None:
    settings = ctx.settings
    worker_id = settings.worker_id or default_worker_id()
    log_dir = Path(settings.worker_log_dir) if settings.worker_log_dir else default_log_dir(worker_id)
    marker = f"{settings.namespace}/{worker_id}"
    # Engines of an earlier life of this worker (SIGKILLed before it could stop them) hold memory and
    # ports; the log says what they served, and reconcile records it gone.
    kill_leftover_engines(marker)
    worker = Worker(
        worker_id=worker_id,
        store=ctx.store,
        launcher=EngineLauncher(EngineOptions(
            log_dir=log_dir, host=settings.worker_host, sim_speedup=settings.worker_sim_speedup,
            gpu_memory_per_gpu_gb=float(settings.worker_gpu_memory_gb) / (settings.worker_gpus or 1) or None,
            cluster_secret=settings.cluster_key),
            marker),
        telemetry=ctx.telemetry,
        gpu_memory_gb=float(settings.worker_gpu_memory_gb),
        slots=settings.worker_slots,
        health_timeout_s=settings.worker_health_timeout_s,
        hang_timeout_s=settings.worker_hang_timeout_s,
        report_interval_s=settings.worker_report_interval_s,
    )
    engines = available_engines()
    metrics = ctx.metrics
    metrics.add("modelpool_worker_instances", "This worker's instances by backend and state",
                lambda: dict(Counter((("backend", i.backend_type.value), ("state", i.state.value))
                                     for i in worker.instances.values())))
    metrics.add("modelpool_worker_heartbeats_total", "Heartbeats this worker sent, and those it could not",
                lambda: {(("outcome", "sent"),): worker.heartbeats_sent,
                         (("outcome", "missed"),): worker.heartbeats_missed}, kind="counter")
    await worker.register(engines)
    await retry_until_done(worker.reconcile, "reading this worker's instances from the log", log, ctx.stop)

    consumer = command_consumer(worker, ctx.js, ctx.subjects, ctx.commands, ctx.telemetry)
    try:
        await asyncio.gather(ctx.consume(consumer), worker.send_heartbeats(ctx.telemetry_bus, ctx.stop),
                             worker.keep_registered(engines, ctx.stop))
    finally:
        await worker.shutdown()


def main(argv: list[str]) -> int:
    settings = Settings.load()
    # `auto` is read off the GPUs once, before anything starts: a worker that cannot tell stops here, saying why.
    memory_gb, count = gpus(settings.worker_gpu_memory_gb, settings.worker_gpus)
    settings = settings.model_copy(update={"worker_gpu_memory_gb": memory_gb, "worker_gpus": count})
    return run_service("worker", serve, settings)
