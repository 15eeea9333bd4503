"""What the benchmarks that run services as processes share: a child process, its readiness, a scratch namespace's end."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
from sqlalchemy import text

from services.cluster.supervisor import Child, stop
from shared.bus.jetstream import connect
from shared.bus.subjects import Subjects
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.config import AliasConfig
from shared.contracts.events import AliasConfigured, InstanceStateChanged, RoutingStateChanged, event_registry
from shared.contracts.messages import Envelope
from shared.contracts.states import InstanceState, RoutingState
from shared.eventlog.db import create_engine, migrate_async
from shared.eventlog.store import make_store
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


class BenchService(Child):
    """A service a benchmark runs: a supervised child (`services/cluster/supervisor.py`) run from the repository's
    root with the benchmark's environment over ours, logging to `<log_dir>/<name>.log`."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(name, argv, {**os.environ, **(env or {})}, log_path=log_dir / f"{name}.log",
                         death_signal=None, cwd=ROOT)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for {self.name}")

    def stop(self) -> None:
        stop([self], timeout_s=15.0)


async def wait_ready(url: str, process: BenchService, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if process.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{process.name} did not start:\n{process.log_path.read_text()[-3000:]}")
            await asyncio.sleep(0.2)


async def drop_namespace(settings: Settings) -> None:
    db = create_engine(settings, pool_size=1)
    async with db.begin() as conn:
        await conn.execute(text(f'DROP SCHEMA IF EXISTS "{settings.namespace}" CASCADE'))
    await db.dispose()
    nc = await connect(settings.nats_url, name="bench-gateway")
    for stream in Subjects(settings.namespace).all_streams:
        try:
            await nc.jetstream().delete_stream(stream)
        except Exception:  # never created
            pass
    await nc.close()


Engines = dict[str, tuple[str, str | None]]
"""Instance id -> (engine URL, internal URL or None)."""


async def record_running(settings: Settings, aliases: list[tuple[AliasConfig, Engines, int | None]]) -> None:
    """What the controller and the workers would record: each alias configured, its vLLM instances
    running with the capacity their engines report, and the alias VLLM_PRIMARY."""
    await migrate_async(settings)
    db = create_engine(settings, pool_size=1)
    store = make_store(db, event_registry(), settings.namespace)
    for config, engines, capacity in aliases:
        alias = config.alias
        await store.append(f"alias:{alias}", [Envelope.wrap(AliasConfigured(alias=alias, config=config))])
        for instance, (url, internal) in engines.items():
            for before, after in ((InstanceState.ABSENT, InstanceState.STARTING),
                                  (InstanceState.STARTING, InstanceState.RUNNING)):
                await store.append(f"instance:{instance}", [Envelope.wrap(InstanceStateChanged(
                    instance_id=instance, alias=alias, backend_type=BackendType.VLLM, engine=EngineKind.SIMULATOR,
                    worker_id="w1", from_state=before, to_state=after, reason="bench", endpoint=url, internal_endpoint=internal,
                    capacity=capacity))])
        await store.append(f"alias:{alias}", [Envelope.wrap(RoutingStateChanged(
            alias=alias, from_state=RoutingState.COLD, to_state=RoutingState.VLLM_PRIMARY, reason="bench",
            mix_weight=1.0, policy="bench"))])
    await db.dispose()
