"""`modelpool status`: what each alias is doing, why, since when, and what the controller will do next.

The facts come from the read models (routing, instances, workers, the
controller's commands in flight); the live ones from the bus: each worker's
last heartbeat (an instance's load, capacity and health) and the controller's
outlook (what its leader will do next, and when, if nothing changes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from shared.bus.jetstream import connect_once
from shared.bus.subjects import Subjects
from shared.bus.telemetry import TelemetryBus
from shared.eventlog.db import create_engine
from shared.projections.projector import load_position, load_rows
from shared.projections.readmodels import CONTROL, INSTANCES, ROUTING, WORKERS
from shared.projections.rows import as_json
from shared.settings import Settings

LIVE_TIMEOUT_S = 3.0


async def read_live(bus: TelemetryBus) -> dict[str, Any]:
    """Each worker's last heartbeat and each alias's outlook, as the bus keeps them."""
    heartbeats = await bus.heartbeats()
    outlooks = await bus.outlooks()
    return {
        "heartbeats": {w: hb.model_dump(mode="json") for w, hb in heartbeats.items()},
        "outlooks": {a: o.model_dump(mode="json") for a, o in outlooks.items()},
    }


async def load_live(settings: Settings) -> dict[str, Any]:
    """Heartbeats and outlooks from the bus; empty, with the reason, when the bus cannot be reached."""
    try:
        nc = await connect_once(settings.nats_url, name="modelpool-status", timeout_s=LIVE_TIMEOUT_S,
                                credentials=settings.nats_credentials)
    except ConnectionError as exc:
        return {"error": str(exc)}
    try:
        # A reader: binds to the buckets there are, declares none (it may run with a gateway's credentials).
        bus = TelemetryBus(nc, nc.jetstream(), Subjects(settings.namespace), declares=False)
        return await read_live(bus)
    finally:
        await nc.close()


async def read_status(engine: AsyncEngine, namespace: str) -> dict[str, Any]:
    """The read models an operator asks about: workers, aliases, the controller's commands, instances."""
    async with engine.connect() as conn:
        workers, aliases = await load_rows(conn, WORKERS), await load_rows(conn, ROUTING)
        control, instances = await load_rows(conn, CONTROL), await load_rows(conn, INSTANCES)
        return {
            "namespace": namespace,
            "position": await load_position(conn, ROUTING.name),
            "workers": [as_json(workers[k]) for k in sorted(workers)],
            "aliases": [as_json(aliases[k]) for k in sorted(aliases)],
            "control": {alias: as_json(row) for alias, row in control.items()},
            "instances": [as_json(r) for r in sorted(instances.values(),
                                                     key=lambda r: (r.alias, r.backend_type.value, r.instance_id))],
        }


async def load_status(settings: Settings) -> dict[str, Any]:
    engine = create_engine(settings, pool_size=1)
    try:
        status = await read_status(engine, settings.namespace)
    finally:
        await engine.dispose()
    status["live"] = await load_live(settings)
    return status


def _seconds(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if abs(seconds) >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def ago(value: datetime | str | None, now: datetime) -> str:
    if value is None:
        return "-"
    when = datetime.fromisoformat(value) if isinstance(value, str) else value
    return _seconds((now - when).total_seconds()) + " ago"


def due_in(value: str | None, now: datetime) -> str:
    if not value:
        return ""
    seconds = (datetime.fromisoformat(value) - now).total_seconds()
    return " now" if seconds <= 0 else f" in {_seconds(seconds)}"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def render(status: dict[str, Any], now: datetime | None = None) -> str:
    now = now or datetime.now(timezone.utc)
    live = status["live"]
    heartbeats = live.get("heartbeats", {})
    outlooks = live.get("outlooks", {})
    statuses = {s["instance_id"]: s for hb in heartbeats.values() for s in hb["instances"]}
    out = [f"namespace {status['namespace']}, projections at log position {status['position']}"]
    if "error" in live:
        out.append(f"live facts unavailable: {live['error']}")
    out += ["", "WORKERS"]
    out.append(
        table(
            ["worker", "host", "status", "heard", "gpu GB", "slots", "engines"],
            [[w["worker_id"], w["host"], w["status"],
              ago(heartbeats[w["worker_id"]]["at"], now) if w["worker_id"] in heartbeats else "never",
              w["gpu_memory_gb"], w["slots"], ",".join(w["engines"])] for w in status["workers"]],
        )
        if status["workers"]
        else "  (none registered)"
    )
    out += ["", "ALIASES"]
    if not status["aliases"]:
        out.append("  (none configured)")
    for a in status["aliases"]:
        control = status["control"].get(a["alias"]) or {}
        targets = ", ".join(f"{k}={v}" for k, v in sorted((a["targets"] or {}).items())) or "-"
        out.append(f"{a['alias']}: {a['state']} since {ago(a['switched_at'] or a['updated_at'], now)}, "
                   f"{a['mix_weight']:.0%} of traffic to vLLM, targets {targets}")
        if a["switch_reason"]:
            out.append(f"  why: {a['switch_reason']}")
        hold = control.get("operator") or {}
        if hold.get("paused"):
            out.append(f"  paused by {hold['paused']}: the controller leaves this alias as it is until resumed")
        for backend, floor in sorted((hold.get("min_replicas") or {}).items()):
            out.append(f"  {backend} min_replicas pinned to {floor} by an operator")
        pending = control.get("pending") or {}
        if pending:
            out.append("  in flight: " + ", ".join(f"{c['action']} {c['instance_id']}" for c in pending.values()))
        outlook = outlooks.get(a["alias"])
        if outlook is None:
            out.append("  next: no controller is deciding (no outlook from an autoscaler in the last 2 minutes)")
        else:
            steps = outlook["next"] or [{"what": "nothing planned while the load stays as it is", "at": None}]
            for step in steps:
                out.append(f"  next: {step['what']}{due_in(step['at'], now)}")
            out.append(f"  decided by {outlook['leader']} ({outlook['policy']}), {ago(outlook['at'], now)}")
    out += ["", "INSTANCES"]
    rows = []
    for i in status["instances"]:
        live_status = statuses.get(i["instance_id"]) or {}
        capacity = live_status.get("capacity") or i["capacity"]
        rows.append([
            i["instance_id"], i["alias"], i["backend_type"],
            i["engine"] + (" (simulated)" if i["engine"] == "simulator" else ""),
            i["worker_id"], i["state"], i["sleep_level"],
            live_status.get("inflight_requests", "-"), capacity,
            ("yes" if live_status.get("healthy") else "no") if live_status else "-",
            ago(i["updated_at"], now), i["endpoint"],
        ])
    out.append(
        table(["instance", "alias", "backend", "engine", "worker", "state", "sleep", "inflight", "capacity", "healthy",
                "since", "endpoint"], rows)
        if rows
        else "  (none)"
    )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool status", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    status = asyncio.run(load_status(Settings.load(discover=True)))
    if args.json:
        print(json.dumps(status, default=str, indent=2))
    else:
        print(render(status))
    return 0
