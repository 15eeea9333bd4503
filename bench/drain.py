"""Benchmark: scale-down that hands sessions over (with their KV) against scale-down that lets them recompute.

The whole pool runs as its real services (relay, projector, placement,
autoscaler, gateway, one worker) on the local Postgres and NATS, in a scratch
namespace dropped afterwards. Its engines are SIMULATED llama.cpp-profile
engines (`modelpool engine sim --profile llama.cpp`) with prefix caching on, as
modelpool's llama.cpp engine keeps finished sequences cached, and an internal
port, so a session's KV can move between them; nothing here ran a real model.

The alias scales its llama.cpp tier by utilization (2 to 4 instances) and routes
with EAR. The trace is agentic and its load falls and rises: `--sessions`
sessions start over the first `--spread-s` seconds, take `--turns-before` turns
a short tool time apart, pause for `--pause-s` plus up to `--pause-jitter-s`
(the load falls to nothing, and the controller scales the tier in, draining
instances that hold sessions), then take `--turns-after` more (the load rises).
Sizes are drawn once from `--seed`: new input per turn lognormal around
`--new-input-tokens` (sigma 0.4), answers around `--output-tokens` (sigma 0.3),
tool times around 2 s (sigma 0.5). None of these was tuned on the result.

The same trace runs with the router's `drain_handoff_s` at `--handoff-s`
(handoff) and at 0 (recompute: each drained host's sessions are placed anew at
their next turn), alternating, `--repeats` times each. Measured per run, from
the log and the replayer: for every instance drained from RUNNING, the sessions
bound to it at that moment, and the time to first token of each one's next turn.

    .venv/bin/python bench/drain.py

Progress goes to stderr; the last line on stdout is the JSON summary with
`handoff_ttft_p90_s`, `recompute_ttft_p90_s`, `handoff_ttft_p90_ratio` (goal
<= 0.5) and `share_with_kv` (the drained hosts' sessions handed over with
their KV), over every repeat's next turns pooled (a run drains a handful of
sessions), with the ratios repeat by repeat beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.cluster.localpool import LocalPool  # noqa: E402
from services.ops.load import quantile  # noqa: E402
from services.ops.trace_replay import Replay, ReplayedRequest, replay_client  # noqa: E402
from shared.contracts.events import event_registry  # noqa: E402
from shared.contracts.trace import TraceRequest  # noqa: E402
from shared.eventlog.db import create_engine, migrate_async  # noqa: E402
from shared.eventlog.store import make_store  # noqa: E402
from shared.settings import Settings  # noqa: E402

from harness import drop_namespace  # noqa: E402

ALIAS = "agent"


def say(message: str) -> None:
    print(f"[drain bench] {message}", file=sys.stderr, flush=True)


def pool_yaml(handoff_s: float) -> str:
    return f"""
aliases:
  - alias: {ALIAS}
    autoscaling_policy: {{name: utilization, backend: llama.cpp, min_instances: 2, max_instances: 4,
                         target_utilization: 0.5, scale_out_cooldown: 5, scale_in_cooldown: 15}}
    router: {{plugin: ear, drain_handoff_s: {handoff_s}}}
    backends:
      llama.cpp: {{model_name: {ALIAS}, model_path: default, gpu_memory_gb: 4, min_replicas: 2, max_replicas: 4,
                  engine: simulator, engine_args: {{prefix-caching: true}}}}
"""


def make_trace(args: argparse.Namespace) -> list[TraceRequest]:
    rng = np.random.default_rng(args.seed)
    requests = []
    for s in range(args.sessions):
        turns = args.turns_before + args.turns_after
        for turn in range(turns):
            if turn == 0:
                delay = rng.uniform(0, args.spread_s)
            elif turn == args.turns_before:
                delay = args.pause_s + rng.uniform(0, args.pause_jitter_s)
            else:
                delay = rng.lognormal(np.log(2.0), 0.5)
            requests.append(TraceRequest(
                session_id=f"s{s}", turn=turn, delay_s=round(float(delay), 3),
                new_input_tokens=max(1, int(rng.lognormal(np.log(args.new_input_tokens), 0.4))),
                output_tokens=max(1, int(rng.lognormal(np.log(args.output_tokens), 0.3)))))
    return requests


def session_of(payload: dict) -> str:
    """The replayer's session id of a session event (the gateway keys sessions by alias: `agent/s3`)."""
    return payload["session_id"].removeprefix(f"{ALIAS}/")


async def drained_sessions(settings: Settings, to_monotonic) -> tuple[list[tuple[float, str, set[str]]], dict]:
    """Each drain from RUNNING (its time on the replayer's clock, the instance, the sessions bound to it then), and
    the session moves the drains caused (session -> the move's metrics)."""
    db = create_engine(settings, pool_size=1)
    store = make_store(db, event_registry(), settings.namespace)
    events = []
    for kind in ("InstanceStateChanged", "SessionBound", "SessionMigrated", "SessionReleased"):
        events += await store.of_type(kind, alias=ALIAS)
    await db.dispose()
    events.sort(key=lambda e: e.occurred_at)
    bound: dict[str, str] = {}
    drains, handoffs = [], {}
    for e in events:
        p = e.payload
        match e.type:
            case "SessionBound":
                bound[session_of(p)] = p["instance_id"]
            case "SessionMigrated":
                bound[session_of(p)] = p["to_instance_id"]
                if p["reason"] == "drain":
                    handoffs[session_of(p)] = p["metrics"]
            case "SessionReleased":
                bound.pop(session_of(p), None)
            case "InstanceStateChanged" if p["from_state"] == "RUNNING" and p["to_state"] == "DRAINING":
                drains.append((to_monotonic(e.occurred_at.timestamp()), p["instance_id"],
                               {s for s, host in bound.items() if host == p["instance_id"]}))
    return drains, handoffs


def next_turns(served: list[ReplayedRequest], drains: list[tuple[float, str, set[str]]]) -> list[ReplayedRequest]:
    """The first request of each drained host's sessions sent after the drain (once per session: one handed over
    to a host drained in turn has the same next turn)."""
    found: dict[str, ReplayedRequest] = {}
    for at, _, sessions in drains:
        for session_id in sessions - found.keys():
            later = [r for r in served if r.session_id == session_id and r.sent >= at]
            if later:
                found[session_id] = min(later, key=lambda r: r.sent)
    return list(found.values())


async def run_once(mode: str, args: argparse.Namespace, trace: list[TraceRequest], work: Path) -> dict:
    settings = Settings.load({}, namespace=f"bench_drain_{secrets.token_hex(4)}")
    await migrate_async(settings)
    pool = LocalPool(settings.database_url, settings.nats_url, settings.namespace,
                     pool_yaml(args.handoff_s if mode == "handoff" else 0), work / mode,
                     workers={"w1": {"MODELPOOL_WORKER_GPU_MEMORY_GB": "24", "MODELPOOL_WORKER_SLOTS": "6"}},
                     env={"MODELPOOL_METRIC_WINDOW_S": "2", "MODELPOOL_CONTROL_TICK_S": "0.5",
                          "MODELPOOL_LOG_LEVEL": "WARNING"})
    await asyncio.to_thread(pool.start)
    wall0, mono0 = time.time(), time.monotonic()
    try:
        def progress(n: int) -> None:
            if n % max(1, len(trace) // 5) == 0:
                say(f"{mode}: {n}/{len(trace)} requests answered")

        async with replay_client(300.0) as client:
            replay = Replay(pool.gateway.removesuffix("/v1"), ALIAS, client, progress=progress)
            await replay.run(trace)
        drains, handoffs = await drained_sessions(settings, lambda wall: wall - wall0 + mono0)
    finally:
        await asyncio.to_thread(pool.stop)
        await drop_namespace(settings)
    served = replay.served
    measured = next_turns(served, drains)
    ttfts = [r.first - r.sent for r in measured if r.first is not None]
    handed = [m for s, m in handoffs.items() if any(s in sessions for _, _, sessions in drains)]
    return {
        "mode": mode, "requests": len(served), "failed": sum(1 for r in served if r.error or r.done is None),
        "drains": len(drains), "drained_sessions": len(measured),
        "ttft_p50_s": quantile(ttfts, 0.5), "ttft_p90_s": quantile(ttfts, 0.9),
        "next_turn_ttfts_s": sorted(round(t, 3) for t in ttfts),
        "cached_share": round(sum(r.cached_tokens for r in measured) / max(1, sum(r.prompt_tokens for r in measured)), 3),
        "handed_over": len(handed), "with_kv": sum(1 for m in handed if m.get("kv_moved")),
        "all_ttft_p90_s": quantile([r.first - r.sent for r in served if r.first is not None], 0.9),
    }


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--spread-s", type=float, default=10.0)
    p.add_argument("--turns-before", type=int, default=3)
    p.add_argument("--turns-after", type=int, default=2)
    p.add_argument("--pause-s", type=float, default=45.0)
    p.add_argument("--pause-jitter-s", type=float, default=30.0)
    p.add_argument("--new-input-tokens", type=float, default=300.0)
    p.add_argument("--output-tokens", type=float, default=40.0)
    p.add_argument("--handoff-s", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    trace = make_trace(args)
    runs: dict[str, list[dict]] = {"handoff": [], "recompute": []}
    with tempfile.TemporaryDirectory(prefix="bench-drain-") as tmp:
        for repeat in range(args.repeats):
            for mode in ("handoff", "recompute") if repeat % 2 == 0 else ("recompute", "handoff"):
                say(f"run {repeat + 1}/{args.repeats}: {mode}")
                result = await run_once(mode, args, trace, Path(tmp) / f"{repeat}")
                say(json.dumps(result))
                runs[mode].append(result)

    def pooled(mode: str, q: float) -> float | None:
        """The quantile over every run's next turns of `mode` (a run drains a handful of sessions)."""
        return quantile([t for r in runs[mode] for t in r["next_turn_ttfts_s"]], q)

    def ratios(key: str) -> list[float]:
        """The handoff run's `key` over the recompute run's, repeat by repeat."""
        return [round(h[key] / c[key], 3) for h, c in zip(runs["handoff"], runs["recompute"]) if h[key] and c[key]]

    handoff, recompute = pooled("handoff", 0.9), pooled("recompute", 0.9)
    with_kv = sum(r["with_kv"] for r in runs["handoff"])
    drained = sum(r["drained_sessions"] for r in runs["handoff"])
    summary = {
        "engine": "simulated llama.cpp profile (prefix caching, internal KV port)",
        "sessions": args.sessions, "requests": len(trace), "repeats": args.repeats,
        "handoff_ttft_p90_s": rounded(handoff), "recompute_ttft_p90_s": rounded(recompute),
        "handoff_ttft_p90_ratio": rounded(handoff / recompute) if handoff and recompute else None,
        "share_with_kv": rounded(with_kv / drained) if drained else None,
        "handoff_ttft_p50_s": rounded(pooled("handoff", 0.5)), "recompute_ttft_p50_s": rounded(pooled("recompute", 0.5)),
        "p90_ratio_by_repeat": ratios("ttft_p90_s"), "p50_ratio_by_repeat": ratios("ttft_p50_s"),
        "drained_sessions": {mode: [r["drained_sessions"] for r in rs] for mode, rs in runs.items()},
        "failed": sum(r["failed"] for rs in runs.values() for r in rs),
        "runs": runs,
    }
    print(json.dumps(summary))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
