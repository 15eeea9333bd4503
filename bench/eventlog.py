"""Event log and bus benchmark: append throughput, projection rebuild speed, append-to-delivery latency.

    .venv/bin/python bench/eventlog.py [--rebuild-events 1000000] [--deliver-rate 1000] [--deliver-seconds 10]

Runs against DATABASE_URL / NATS_URL (default: the local servers) in a scratch
namespace that is dropped afterwards. The relay runs as its own process
(`modelpool relay`), as it does in a deployment. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import nats
from sqlalchemy import text
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.bus.jetstream import connect, ensure_streams  # noqa: E402
from shared.bus.subjects import Subjects  # noqa: E402
from shared.contracts.events import InstanceLoadReported, SessionBound, event_registry  # noqa: E402
from shared.contracts.messages import Envelope  # noqa: E402
from shared.eventlog.db import create_engine, migrate_async  # noqa: E402
from shared.eventlog.store import make_store  # noqa: E402
from shared.projections.projector import rebuild  # noqa: E402
from shared.settings import Settings  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def load_event(instance: str, n: int) -> Envelope:
    return Envelope.wrap(InstanceLoadReported(instance_id=instance, alias="bench", inflight=n % 17, capacity=16))


async def bench_append(store, seconds: float, writers: int, batch: int) -> float:
    """Durable appends (each one committed) from `writers` concurrent writers; events per second."""
    count = 0
    deadline = time.perf_counter() + seconds

    async def writer(w: int) -> None:
        nonlocal count
        n = 0
        while time.perf_counter() < deadline:
            events = [load_event(f"bench-{batch}-{w}", n + k) for k in range(batch)]
            await store.append(f"instance:bench-{batch}-{w}", events)
            n += batch
            count += batch

    start = time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(writers)))
    return count / (time.perf_counter() - start)


async def fill_log(engine, n: int) -> None:
    """Bulk-load `n` realistic events with COPY: instance lifecycles, load reports, sessions, routing."""
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    raw_conn = await engine.connect()
    raw = (await raw_conn.get_raw_connection()).driver_connection
    states = ["STARTING", "RUNNING", "DRAINING", "DELETING", "ABSENT"]
    chunk = 50_000
    version: dict[str, int] = {}
    with tqdm(total=n, desc="filling the log", unit="ev", file=sys.stderr) as bar:
        for start in range(0, n, chunk):
            records = []
            for i in range(start, min(n, start + chunk)):
                kind = i % 10
                if kind < 5:  # instance lifecycle, 5 transitions per instance
                    inst = i // 10
                    step = (i // 2) % 5
                    stream = f"instance:i{inst}"
                    type_name = "InstanceStateChanged"
                    payload = {"instance_id": f"i{inst}", "alias": f"alias-{inst % 50}", "backend_type": "vllm",
                               "engine": "simulator", "worker_id": f"w{inst % 20}",
                               "from_state": (["ABSENT"] + states)[step], "to_state": states[step], "reason": "bench",
                               "sleep_level": 0, "capacity": 16, "endpoint": "http://h:1", "command_id": None}
                elif kind < 8:
                    stream = f"instance:load{i % 5000}"
                    type_name = "InstanceLoadReported"
                    payload = {"instance_id": f"load{i % 5000}", "alias": f"alias-{i % 50}", "inflight": i % 13, "capacity": 16}
                elif kind == 8:
                    stream = f"session:s{i % 100_000}"
                    type_name = "SessionBound"
                    payload = {"session_id": f"s{i % 100_000}", "alias": f"alias-{i % 50}", "instance_id": f"i{i % 777}"}
                else:
                    stream = f"alias:alias-{i % 50}"
                    type_name = "ScalingTargetsChanged"
                    payload = {"alias": f"alias-{i % 50}", "targets": {"llama.cpp": i % 4, "vllm": i % 3},
                               "reason": "bench", "policy": "bench", "metrics": None, "inputs": {}}
                v = version[stream] = version.get(stream, 0) + 1
                records.append((uuid.uuid4(), stream, v, type_name, 1, t0 + timedelta(milliseconds=i), None, None,
                                json.dumps(payload), "{}"))
            await raw.copy_records_to_table(
                "events", records=records,
                columns=["id", "stream_id", "stream_version", "type", "version", "occurred_at", "causation_id",
                         "correlation_id", "payload", "headers"],
            )
            bar.update(len(records))
    await raw_conn.close()


async def bench_delivery(settings: Settings, store, rate: float, seconds: float) -> tuple[list[float], list[float], float]:
    """Append at `rate` events/s while a subscriber measures append-to-receipt latency through the relay."""
    env = {**os.environ, "DATABASE_URL": settings.database_url, "NATS_URL": settings.nats_url,
           "MODELPOOL_NAMESPACE": settings.namespace}
    # Only the events appended from here on are measured: start the relay at the head.
    async with store.engine.begin() as conn:
        await conn.execute(text(
            "INSERT INTO tracking (name, position) SELECT 'relay', coalesce(max(position), 0) FROM events"
            " ON CONFLICT (name) DO UPDATE SET position = EXCLUDED.position"))
    relay = subprocess.Popen([sys.executable, "-m", "services.cli", "relay"], env=env, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    appended_at: dict[str, float] = {}
    committed: dict[str, float] = {}
    received: dict[str, float] = {}
    nc = await nats.connect(settings.nats_url)

    async def on_msg(msg) -> None:
        received[msg.headers["Nats-Msg-Id"]] = time.perf_counter()

    await nc.subscribe(Subjects(settings.namespace).all_events, cb=on_msg)
    await asyncio.sleep(3.0)  # let the relay start
    total = int(rate * seconds)

    async def append_one(n: int) -> None:
        event = Envelope.wrap(SessionBound(session_id=f"d{n}", alias="bench", instance_id="i1"))
        # Timed from the call: the group commit's wait and the commit itself count too.
        appended_at[str(event.id)] = time.perf_counter()
        await store.append(f"session:d{n}", [event])
        committed[str(event.id)] = time.perf_counter()

    # Open loop: each event is appended at its own time, however long earlier appends take,
    # as independent producers would.
    start = time.perf_counter()
    tasks = []
    while len(tasks) < total:
        # Start every append that is due by now: a timer that wakes late is made up
        # for at once, so the offered rate holds whatever the sleep granularity.
        due = min(total, int((time.perf_counter() - start) * rate) + 1)
        tasks += [asyncio.create_task(append_one(n)) for n in range(len(tasks), due)]
        await asyncio.sleep(0.0005)
    await asyncio.gather(*tasks)
    achieved = total / (time.perf_counter() - start)
    deadline = time.perf_counter() + 10
    while len(received) < total and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
    await nc.close()
    os.killpg(relay.pid, signal.SIGTERM)
    relay.wait(timeout=30)
    missing = total - len(set(received) & set(appended_at))
    if missing:
        raise SystemExit(f"{missing} events were not delivered")
    from_call = [(received[k] - appended_at[k]) * 1000 for k in appended_at]
    # The commit is acknowledged to the caller just after it happens; a receipt
    # can therefore come first, by a hair: clamp those to zero.
    from_commit = [max(0.0, (received[k] - committed[k]) * 1000) for k in committed]
    return from_call, from_commit, achieved


def plot_latencies(from_commit: list[float], from_call: list[float], rate: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for values, label in ((from_commit, "append committed -> received"), (from_call, "append called -> received")):
        ordered = sorted(max(v, 0.01) for v in values)
        ax.plot(ordered, [i / len(ordered) for i in range(1, len(ordered) + 1)],
                label=f"{label} (p50 {percentile(values, 50):.1f} ms, p99 {percentile(values, 99):.1f} ms)")
    ax.axvline(20, linestyle=":", color="grey", label="p99 target 20 ms")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("share of events")
    ax.set_title(f"Event delivery through the relay at {rate:.0f} events/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild-events", type=int, default=1_000_000)
    parser.add_argument("--append-seconds", type=float, default=8.0)
    parser.add_argument("--deliver-rate", type=float, default=1000.0)
    parser.add_argument("--deliver-seconds", type=float, default=10.0)
    parser.add_argument("--plot", type=Path, help="write the append-to-delivery latency distribution here (PNG)")
    args = parser.parse_args()

    base = Settings.load()
    if not os.environ.get("DATABASE_URL"):
        base = Settings.load(database_url="postgresql://127.0.0.1:5432/test")
    settings = Settings.load({}, database_url=base.database_url, nats_url=base.nats_url,
                             namespace=f"bench_{secrets.token_hex(4)}")
    await migrate_async(settings)
    engine = create_engine(settings, pool_size=16)
    store = make_store(engine, event_registry(), settings.namespace)
    nc = await connect(settings.nats_url, name="bench")
    subjects = Subjects(settings.namespace)
    await ensure_streams(nc.jetstream(), subjects)
    results: dict[str, float] = {}
    try:
        # Delivery first, on a quiet log: the write-heavy phases leave the server flushing for a while.
        print(f"append-to-delivery at {args.deliver_rate:.0f} events/s ...", file=sys.stderr)
        from_call, from_commit, achieved = await bench_delivery(settings, store, args.deliver_rate, args.deliver_seconds)
        results["deliver_rate_achieved"] = round(achieved)
        # Committed (the append acknowledged) -> a subscriber has it: the bus path.
        results["deliver_p50_ms"] = round(percentile(from_commit, 50), 2)
        results["deliver_p99_ms"] = round(percentile(from_commit, 99), 2)
        # append() called -> a subscriber has it: the write and the bus path together.
        results["append_to_receipt_p50_ms"] = round(percentile(from_call, 50), 2)
        results["append_to_receipt_p99_ms"] = round(percentile(from_call, 99), 2)
        if args.plot:
            plot_latencies(from_commit, from_call, achieved, args.plot)

        print("appending single events ...", file=sys.stderr)
        results["append_events_per_s"] = round(await bench_append(store, args.append_seconds, writers=8, batch=1))
        print("appending batches of 100 ...", file=sys.stderr)
        results["append_batch_events_per_s"] = round(await bench_append(store, args.append_seconds, writers=4, batch=100))

        existing = await store.head_position()
        await fill_log(engine, max(0, args.rebuild_events - existing))
        async with engine.begin() as conn:
            # What autovacuum does after a bulk load; without statistics the planner
            # cannot know an index walk beats a sort.
            await conn.execute(text("ANALYZE events"))
            total = (await conn.execute(text("SELECT count(*) FROM events"))).scalar_one()
        start = time.perf_counter()
        rows, _, count = await rebuild(store)
        elapsed = time.perf_counter() - start
        results["rebuild_events"] = count
        results["rebuild_seconds"] = round(elapsed, 2)
        results["rebuild_events_per_s"] = round(count / elapsed)
        results["rebuild_rows"] = sum(len(r) for r in rows.values())
        assert count == total
    finally:
        await nc.jetstream().delete_stream(subjects.events_stream)
        await nc.jetstream().delete_stream(subjects.commands_stream)
        await nc.jetstream().delete_stream(subjects.dlq_stream)
        await nc.close()
        async with engine.begin() as conn:
            await conn.execute(text(f'DROP SCHEMA "{settings.namespace}" CASCADE'))
        await engine.dispose()
    results["targets_met"] = results["rebuild_events_per_s"] >= 100_000 and results["deliver_p99_ms"] <= 20
    print(json.dumps(results))


if __name__ == "__main__":
    asyncio.run(main())
