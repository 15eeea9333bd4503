"""`modelpool top`: the pool live in a terminal, redrawn every second; over SSH as well as anywhere.

What `modelpool status` shows, kept current and cut to the terminal: each
alias's routing state, since when, its share to vLLM, its targets and what the
controller will do next; each instance's state, load against capacity, KV use
and health; the workers; and the latest decisions from the log. The read
models and the log come from Postgres, the live facts (load, health, the
controller's outlook) from the bus; when either is away the screen says so and
keeps refreshing until it is back. Ctrl-C quits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from nats.aio.client import Client as NATS
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from services.ops.status import LIVE_TIMEOUT_S, ago, due_in, read_live, read_status, table
from shared.bus.jetstream import connect_once
from shared.bus.subjects import Subjects
from shared.bus.telemetry import TelemetryBus
from shared.eventlog.db import create_engine
from shared.settings import Settings

CLEAR = "\x1b[H\x1b[2J"
DECISIONS = 8

_LATEST_DECISIONS = text(
    """
    SELECT occurred_at, payload->>'alias', payload->>'summary' FROM events
    WHERE type = 'PolicyDecided' ORDER BY position DESC LIMIT :n
    """
)


async def latest_decisions(engine: AsyncEngine, n: int = DECISIONS) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = (await conn.execute(_LATEST_DECISIONS, {"n": n})).all()
    return [{"at": at, "alias": alias, "summary": summary} for at, alias, summary in rows]


class Live:
    """The bus for the live facts, connected again when it was lost."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.nc: NATS | None = None
        self.bus: TelemetryBus | None = None

    async def read(self) -> dict[str, Any]:
        try:
            if self.nc is None or not self.nc.is_connected:
                await self.close()
                self.nc = await connect_once(self.settings.nats_url, name="modelpool-top", timeout_s=LIVE_TIMEOUT_S,
                                             credentials=self.settings.nats_credentials)
                # A reader: binds to the buckets there are, declares none.
                self.bus = TelemetryBus(self.nc, self.nc.jetstream(), Subjects(self.settings.namespace),
                                        declares=False)
            assert self.bus is not None
            return await asyncio.wait_for(read_live(self.bus), LIVE_TIMEOUT_S)
        except Exception as exc:  # the bus is away: say so, and connect again at the next frame
            await self.close()
            return {"error": str(exc) or exc.__class__.__name__}

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        self.nc = self.bus = None


class LiveFeed:
    """The live facts read again in the background: a frame shows the latest read and never waits for the bus
    (a key-value read can take a second or two while values change under it), except the first."""

    def __init__(self, live: Live, interval_s: float) -> None:
        self.live = live
        self.interval_s = interval_s
        self.latest: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None

    async def current(self) -> dict[str, Any]:
        if self.latest is None:
            self.latest = await self.live.read()
            self._task = asyncio.create_task(self._refresh())
        return self.latest

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.latest = await self.live.read()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.live.close()


async def gather(engine: AsyncEngine, live: LiveFeed, namespace: str) -> dict[str, Any]:
    """One frame's facts; what could not be read says why instead."""
    try:
        frame = await read_status(engine, namespace)
        frame["decisions"] = await latest_decisions(engine)
    except Exception as exc:  # Postgres is away: the frame says so, the next one tries again
        frame = {"namespace": namespace, "error": str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__}
    frame["live"] = await live.current()
    return frame


def render(frame: dict[str, Any], now: datetime, width: int, height: int, interval_s: float) -> str:
    live = frame["live"]
    heartbeats = live.get("heartbeats", {})
    outlooks = live.get("outlooks", {})
    statuses = {s["instance_id"]: s for hb in heartbeats.values() for s in hb["instances"]}
    out = [f"modelpool top  namespace {frame['namespace']}  {now:%Y-%m-%d %H:%M:%S} UTC  "
           f"every {interval_s:g} s, Ctrl-C quits"]
    if "error" in frame:
        out.append(f"the log is unavailable: {frame['error']}")
    else:
        out[0] += f"  log position {frame['position']}"
    if "error" in live:
        out.append(f"live facts unavailable: {live['error']}")
    if "error" not in frame:
        out += ["", table(["ALIAS", "STATE", "SINCE", "TO VLLM", "TARGETS", "NEXT"], [
            [a["alias"], a["state"], ago(a["switched_at"] or a["updated_at"], now), f"{a['mix_weight']:.0%}",
             ",".join(f"{k}={v}" for k, v in sorted((a["targets"] or {}).items())) or "-", _next(outlooks, a, now)]
            for a in frame["aliases"]]) if frame["aliases"] else "no aliases"]
        rows = []
        for i in frame["instances"]:
            s = statuses.get(i["instance_id"]) or {}
            capacity = s.get("capacity") or i["capacity"]
            kv = s.get("kv_usage")
            rows.append([i["instance_id"], i["alias"], i["backend_type"],
                         i["engine"] + (" (simulated)" if i["engine"] == "simulator" else ""),
                         i["state"] + (f" L{i['sleep_level']}" if i["sleep_level"] else ""),
                         f"{s['inflight_requests']}/{capacity or '?'}" if s else "-",
                         f"{kv:.0%}" if kv is not None else "-",
                         ("yes" if s.get("healthy") else "no") if s else "-", i["worker_id"],
                         ago(i["updated_at"], now)])
        out += ["", table(["INSTANCE", "ALIAS", "BACKEND", "ENGINE", "STATE", "LOAD", "KV", "HEALTHY", "WORKER",
                            "SINCE"], rows) if rows else "no instances"]
        out += ["", "WORKERS  " + ("; ".join(
            f"{w['worker_id']} {w['status']}"
            f" (heard {ago(heartbeats[w['worker_id']]['at'], now) if w['worker_id'] in heartbeats else 'never'})"
            f" {w['gpu_memory_gb']} GB {w['slots']} slots" for w in frame["workers"]) or "none registered")]
        out += ["", "LATEST DECISIONS"] + [
            f"{d['at']:%H:%M:%S}  {d['alias']}  {d['summary']}" for d in frame["decisions"]] or ["  none yet"]
    lines = [line[:width] for block in out for line in block.splitlines() or [""]]
    return "\n".join(lines[:height])


def _next(outlooks: dict[str, Any], alias: dict[str, Any], now: datetime) -> str:
    outlook = outlooks.get(alias["alias"])
    if outlook is None:
        return "no controller deciding"
    steps = outlook["next"]
    return f"{steps[0]['what']}{due_in(steps[0]['at'], now)}" if steps else "nothing planned"


async def run(settings: Settings, interval_s: float, frames: int | None, write: Callable[[str], None],
              size: Callable[[], tuple[int, int]]) -> None:
    engine = create_engine(settings, pool_size=1)
    live = LiveFeed(Live(settings), interval_s)
    try:
        shown = 0
        while frames is None or shown < frames:
            began = asyncio.get_running_loop().time()
            frame = await gather(engine, live, settings.namespace)
            width, height = size()
            write(render(frame, datetime.now(timezone.utc), width, height, interval_s))
            shown += 1
            if frames is None or shown < frames:
                await asyncio.sleep(max(0.0, interval_s - (asyncio.get_running_loop().time() - began)))
    finally:
        await live.close()
        await engine.dispose()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool top", description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default 1)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be positive")
    screen = sys.stdout.isatty() and not args.once

    def write(frame: str) -> None:
        sys.stdout.write((CLEAR if screen else "") + frame + "\n")
        sys.stdout.flush()

    def size() -> tuple[int, int]:
        columns, lines = shutil.get_terminal_size((160, 50))
        return (columns, lines - 1) if screen else (10_000, 10_000)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(Settings.load(discover=True), args.interval, 1 if args.once else None, write, size))
    return 0
