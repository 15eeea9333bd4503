"""`modelpool status`: workers, aliases, routing states and instances, from the read models."""

from __future__ import annotations

import argparse
import asyncio
import json
from datetime import datetime, timezone
from typing import Any

from shared.eventlog.db import create_engine
from shared.projections.projector import load_position, load_rows
from shared.projections.readmodels import INSTANCES, ROUTING, WORKERS
from shared.settings import Settings


async def load_status(settings: Settings) -> dict[str, Any]:
    engine = create_engine(settings, pool_size=1)
    try:
        async with engine.connect() as conn:
            return {
                "namespace": settings.namespace,
                "position": await load_position(conn, ROUTING.name),
                "workers": sorted((await load_rows(conn, WORKERS)).values(), key=lambda r: r["worker_id"]),
                "aliases": sorted((await load_rows(conn, ROUTING)).values(), key=lambda r: r["alias"]),
                "instances": sorted(
                    (await load_rows(conn, INSTANCES)).values(), key=lambda r: (r["alias"], r["backend_type"], r["instance_id"])
                ),
            }
    finally:
        await engine.dispose()


def _ago(value: datetime | None) -> str:
    if value is None:
        return "-"
    seconds = (datetime.now(timezone.utc) - value).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def render(status: dict[str, Any]) -> str:
    out = [f"namespace {status['namespace']}, projections at log position {status['position']}", ""]
    out.append("WORKERS")
    out.append(
        _table(
            ["worker", "host", "status", "gpu GB", "slots", "engines", "since"],
            [
                [w["worker_id"], w["host"], w["status"], w["gpu_memory_gb"], w["slots"], ",".join(w["engines"]), _ago(w["updated_at"])]
                for w in status["workers"]
            ],
        )
        if status["workers"]
        else "  (none registered)"
    )
    out += ["", "ALIASES"]
    out.append(
        _table(
            ["alias", "routing", "vLLM share", "targets", "cooldown until", "switched", "reason"],
            [
                [
                    a["alias"],
                    a["state"],
                    f"{a['mix_weight']:.0%}",
                    ",".join(f"{k}={v}" for k, v in (a["targets"] or {}).items()) or "-",
                    a["cooldown_until"].isoformat(timespec="seconds") if a["cooldown_until"] else "-",
                    _ago(a["switched_at"]),
                    a["switch_reason"],
                ]
                for a in status["aliases"]
            ],
        )
        if status["aliases"]
        else "  (none configured)"
    )
    out += ["", "INSTANCES"]
    out.append(
        _table(
            ["instance", "alias", "backend", "engine", "worker", "state", "sleep", "inflight", "capacity", "endpoint"],
            [
                [
                    i["instance_id"],
                    i["alias"],
                    i["backend_type"],
                    i["engine"] + (" (simulated)" if i["engine"] == "simulator" else ""),
                    i["worker_id"],
                    i["state"],
                    i["sleep_level"],
                    i["inflight"],
                    i["capacity"],
                    i["endpoint"],
                ]
                for i in status["instances"]
            ],
        )
        if status["instances"]
        else "  (none)"
    )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool status", description=__doc__)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    status = asyncio.run(load_status(Settings.load()))
    if args.json:
        print(json.dumps(status, default=str, indent=2))
    else:
        print(render(status))
    return 0
