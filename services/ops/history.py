"""`modelpool history ALIAS`: an alias's timeline from the event log.

Every routing switch, mix step, scaling target, placement, instance transition,
command outcome and session binding that names the alias, with its time, reason
and the inputs recorded with it. `--plot FILE.png` draws the same range as a
figure instead (`services/ops/timeline.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from shared.contracts.events import event_registry
from shared.contracts.messages import Envelope
from shared.eventlog.db import create_engine
from shared.eventlog.store import make_store
from shared.settings import Settings


def _when(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def summarize(e: Envelope) -> str:
    """One line saying what happened and why."""
    p = e.payload
    t = e.type
    if t == "RoutingStateChanged":
        return f"routing {p['from_state']} -> {p['to_state']} (vLLM share {p['mix_weight']:.0%}) by {p['policy']}: {p['reason']}"
    if t == "MixWeightChanged":
        return f"mix {p['from_weight']:.0%} -> {p['to_weight']:.0%} to vLLM: {p['reason']}"
    if t == "ScalingTargetsChanged":
        return f"targets {p['reason']}"
    if t == "PolicyDecided":
        return f"decided by {p['policy']} v{p['policy_version']}: {p['summary']}"
    if t == "ColdStartCompleted":
        return f"cold start: {p['backend_type']} instance {p['instance_id']} serving {p['duration_s']:.1f} s after the first demand"
    if t == "AliasConfigured":
        backends = ", ".join(p["config"]["backends"])
        return f"configured with backends {backends}"
    if t == "PlacementRequested":
        return f"placement requested for {p['backend_type']} instance {p['instance_id']} ({p['gpu_memory_gb']} GB)"
    if t == "PlacementDecided":
        return f"placed {p['backend_type']} instance {p['instance_id']} on {p['worker_id']} (score {p['score']:.3f}, fallback level {p['fallback_level']})"
    if t == "PlacementFailed":
        return f"placement of {p['backend_type']} instance {p['instance_id']} failed: {p['reason']}"
    if t == "InstanceStateChanged":
        return f"instance {p['instance_id']} ({p['backend_type']} on {p['worker_id']}) {p['from_state']} -> {p['to_state']}: {p['reason']}"
    if t == "InstanceCommandCompleted":
        detail = f": {p['detail']}" if p.get("detail") else ""
        return f"instance {p['instance_id']} {p['action']} -> {p['outcome']}{detail}"
    if t == "InstanceLoadReported":
        return f"instance {p['instance_id']} inflight {p['inflight']} / capacity {p.get('capacity')}"
    if t == "SessionBound":
        return f"session {p['session_id']} bound to {p['instance_id']}"
    if t == "SessionMigrated":
        return f"session {p['session_id']} migrated {p['from_instance_id']} -> {p['to_instance_id']}: {p['reason']}"
    if t == "SessionReleased":
        return f"session {p['session_id']} released: {p['reason']}"
    return t


def inputs_of(e: Envelope) -> dict[str, Any]:
    """The recorded inputs of a decision: metric window, instances and commands in flight, candidates.

    (A `PolicyDecided` carries its whole snapshot; `--json` prints it all.)
    """
    if e.type == "PolicyDecided":
        snapshot = e.payload["snapshot"]
        inputs: dict[str, Any] = {
            "instances": [f"{i['instance_id']} {i['state']} inflight {i['inflight']}/{i['capacity']}"
                          for i in snapshot["instances"]],
        }
        if snapshot["pending"]:
            inputs["in flight"] = [f"{c['action']} {c['instance_id']}" for c in snapshot["pending"]]
        if snapshot["demand"]:
            inputs["held at gateways"] = snapshot["demand"]
        return inputs
    keys = ("metrics", "inputs", "candidates")
    return {k: e.payload[k] for k in keys if e.payload.get(k)}


async def load_history(settings: Settings, alias: str, since: datetime | None, until: datetime | None) -> list[Envelope]:
    engine = create_engine(settings, pool_size=1)
    try:
        return await make_store(engine, event_registry(), settings.namespace).history(alias, since=since, until=until)
    finally:
        await engine.dispose()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool history", description=__doc__.splitlines()[0])
    parser.add_argument("alias")
    parser.add_argument("--since", type=_when, help="ISO time, e.g. 2026-11-22T10:00:00Z")
    parser.add_argument("--until", type=_when, help="ISO time")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="one JSON object per event")
    output.add_argument("--plot", metavar="FILE.png", type=Path,
                        help="draw routing, mix, instances, load and latency over the range into an image")
    args = parser.parse_args(argv)
    settings = Settings.load(discover=True)
    if args.plot:
        from services.ops.timeline import plot_history  # matplotlib only for those who plot

        return plot_history(settings, args.alias, args.since, args.until, args.plot)
    events = asyncio.run(load_history(settings, args.alias, args.since, args.until))
    if args.json:
        for e in events:
            print(
                json.dumps(
                    {
                        "position": e.position,
                        "time": e.occurred_at.isoformat(),
                        "type": e.type,
                        "version": e.version,
                        "stream": e.stream_id,
                        "summary": summarize(e),
                        "causation_id": str(e.causation_id) if e.causation_id else None,
                        "correlation_id": str(e.correlation_id) if e.correlation_id else None,
                        "payload": e.payload,
                    }
                )
            )
        return 0
    if not events:
        print(f"no events for alias {args.alias!r}")
        return 0
    for e in events:
        print(f"{e.occurred_at.isoformat(timespec='milliseconds')}  #{e.position:<8} {summarize(e)}")
        for key, value in inputs_of(e).items():
            print(f"{'':34}{key}: {json.dumps(value, sort_keys=True)}")
    return 0
