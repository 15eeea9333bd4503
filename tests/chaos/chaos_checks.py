"""What every chaos test checks after its fault: the pool healed, and nothing was lost or doubled."""

from __future__ import annotations

import asyncio

from services.cluster.chaos import ChaosPool


async def _well(chaos: ChaosPool) -> bool:
    return not chaos.unwell()


async def assert_healed(chaos: ChaosPool, aliases: list[str], replicas: int, *, lost_workers: int | None = 0) -> None:
    """Every service up and reaching its servers, fresh requests served, the log and its read models consistent,
    decisions reproducible, every warm alias back in FAST_ONLY with its instances, and `lost_workers` workers
    recorded lost (None: any number)."""
    assert chaos.pool is not None
    dead = [name for name, p in chaos.pool.processes.items() if not p.alive]
    assert not dead, f"services not running: {dead}\n{chaos.pool.logs()}"
    await chaos.wait_for("every service reaching Postgres and NATS", lambda: _well(chaos), 30)
    await chaos.warm(aliases, replicas)
    fresh = chaos.load(aliases, clients=2)
    await asyncio.sleep(3)
    report = await fresh.stop()
    counted = report.count(report.requests)
    assert counted["sent"] >= 4 and counted["failed"] == 0, counted

    consistent = await chaos.consistent()
    assert consistent["replay"] and consistent["verify_decisions"], consistent["output"]
    lost = await chaos.sql("SELECT count(*) AS n FROM events WHERE type = 'WorkerLost'")
    assert lost_workers is None or lost[0]["n"] == lost_workers, f"{lost[0]['n']} workers recorded lost"
