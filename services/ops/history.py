"""`modelpool history ALIAS`: an alias's timeline from the event log.

Every routing switch, mix step, scaling target, placement, instance transition,
command outcome and session binding that names the alias, with its time, reason
and the inputs recorded with it. `--plot FILE.png` draws the same range as a
figure instead (`services/ops/timeline_figure.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from shared.contracts.events import (
    AliasConfigured,
    ColdStartCompleted,
    InstanceCommandCompleted,
    InstanceLoading,
    InstanceLoadReported,
    InstanceStateChanged,
    MixWeightChanged,
    OperatorAction,
    OperatorCommanded,
    PlacementDecided,
    PlacementFailed,
    PlacementRequested,
    PolicyDecided,
    RoutingStateChanged,
    ScalingTargetsChanged,
    SessionBound,
    SessionMigrated,
    SessionReleased,
    event_registry,
)
from shared.contracts.messages import Envelope, Event
from shared.eventlog.db import create_engine
from shared.eventlog.store import make_store
from shared.settings import Settings


def _when(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def summarize(event: Event) -> str:
    """One line saying what happened and why."""
    match event:
        case RoutingStateChanged(from_state=a, to_state=b, mix_weight=weight, policy=policy, reason=reason):
            return f"routing {a.value} -> {b.value} (vLLM share {weight:.0%}) by {policy}: {reason}"
        case MixWeightChanged(from_weight=a, to_weight=b, reason=reason):
            return f"mix {a:.0%} -> {b:.0%} to vLLM: {reason}"
        case ScalingTargetsChanged(reason=reason):
            return f"targets {reason}"
        case PolicyDecided(policy=policy, policy_version=version, summary=summary):
            return f"decided by {policy} v{version}: {summary}"
        case ColdStartCompleted(backend_type=backend, instance_id=instance, duration_s=seconds):
            return f"cold start: {backend.value} instance {instance} serving {seconds:.1f} s after the first demand"
        case AliasConfigured(config=config):
            return f"configured with backends {', '.join(b.value for b in config.backends)}"
        case PlacementRequested(backend_type=backend, instance_id=instance, gpu_memory_gb=gb):
            return f"placement requested for {backend.value} instance {instance} ({gb:g} GB)"
        case PlacementDecided(backend_type=backend, instance_id=instance, worker_id=worker, score=score,
                              fallback_level=level):
            return f"placed {backend.value} instance {instance} on {worker} (score {score:.3f}, fallback level {level})"
        case PlacementFailed(backend_type=backend, instance_id=instance, reason=reason):
            return f"placement of {backend.value} instance {instance} failed: {reason}"
        case InstanceStateChanged(instance_id=instance, backend_type=backend, worker_id=worker, from_state=a,
                                  to_state=b, reason=reason):
            return f"instance {instance} ({backend.value} on {worker}) {a.value} -> {b.value}: {reason}"
        case InstanceCommandCompleted(instance_id=instance, action=action, outcome=outcome, detail=detail):
            return f"instance {instance} {action.value} -> {outcome.value}" + (f": {detail}" if detail else "")
        case InstanceLoading(instance_id=instance, backend_type=backend, worker_id=worker):
            return f"instance {instance} ({backend.value} on {worker}) loading: its engine answers, the model loads"
        case InstanceLoadReported(instance_id=instance, inflight=inflight, capacity=capacity):
            return f"instance {instance} inflight {inflight} / capacity {capacity}"
        case SessionBound(session_id=session, instance_id=instance):
            return f"session {session} bound to {instance}"
        case SessionMigrated(session_id=session, from_instance_id=a, to_instance_id=b, reason=reason):
            return f"session {session} migrated {a} -> {b}: {reason}"
        case SessionReleased(session_id=session, reason=reason):
            return f"session {session} released: {reason}"
        case OperatorCommanded(action=action, operator=operator, reason=reason):
            return f"operator {operator}: {operator_target(event)}: {reason}"
    return event.TYPE


def operator_target(event: OperatorCommanded) -> str:
    """What an operator asked, in a few words ("pause the controller", "sleep instance i-3 at level 1")."""
    match event.action:
        case OperatorAction.PAUSE:
            return "pause the controller"
        case OperatorAction.RESUME:
            return "resume the controller"
        case OperatorAction.PIN:
            return f"pin {event.backend_type.value} min_replicas to {event.min_replicas}"  # type: ignore[union-attr]
        case OperatorAction.UNPIN:
            return f"unpin {event.backend_type.value} min_replicas"  # type: ignore[union-attr]
        case OperatorAction.SLEEP:
            return f"sleep instance {event.instance_id} at level {event.level or 1}"
    return f"{event.action.value} instance {event.instance_id}"


def inputs_of(event: Event) -> dict[str, Any]:
    """The recorded inputs of a decision: metric window, instances and commands in flight, candidates.

    (A `PolicyDecided` carries its whole snapshot; `--json` prints it all.)
    """
    if isinstance(event, PolicyDecided):
        snapshot = event.snapshot
        inputs: dict[str, Any] = {
            "instances": [f"{i.instance_id} {i.state.value} inflight {i.inflight}/{i.capacity}"
                          for i in snapshot.instances],
        }
        if snapshot.pending:
            inputs["in flight"] = [f"{c.action.value} {c.instance_id}" for c in snapshot.pending]
        if snapshot.demand:
            inputs["held at gateways"] = snapshot.demand
        return inputs
    recorded = event.model_dump(mode="json", include={"metrics", "inputs", "candidates"})
    return {k: v for k, v in recorded.items() if v}


async def load_history(settings: Settings, alias: str, since: datetime | None,
                       until: datetime | None) -> list[tuple[Envelope, Event]]:
    """The alias's events in [since, until], each as stored (envelope) and as its typed fact."""
    engine = create_engine(settings, pool_size=1)
    try:
        store = make_store(engine, event_registry(), settings.namespace)
        return store.typed(await store.history(alias, since=since, until=until))
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
        from services.ops.timeline_figure import plot_history  # matplotlib only for those who plot

        return plot_history(settings, args.alias, args.since, args.until, args.plot)
    events = asyncio.run(load_history(settings, args.alias, args.since, args.until))
    if args.json:
        for e, event in events:
            print(
                json.dumps(
                    {
                        "position": e.position,
                        "time": e.occurred_at.isoformat(),
                        "type": e.type,
                        "version": e.version,
                        "stream": e.stream_id,
                        "summary": summarize(event),
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
    for e, event in events:
        print(f"{e.occurred_at.isoformat(timespec='milliseconds')}  #{e.position:<8} {summarize(event)}")
        for key, value in inputs_of(event).items():
            print(f"{'':34}{key}: {json.dumps(value, sort_keys=True)}")
    return 0
