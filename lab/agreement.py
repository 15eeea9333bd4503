"""Does the lab agree with the pool? The same trace and pool file through both, compared.

The pool: every service as a real process (`LocalPool`: relay, projector,
placement, autoscaler, gateway, one worker) on Postgres and NATS, its engines
the simulated ones (`modelpool engine sim`), the trace replayed open loop
through the gateway (`services.ops.trace_replay`). The lab: the same pool file,
trace, control tick and metric window, and a worker of the same size. Compared:
TTFT and E2E quantiles (and the largest gap between the two distributions, the
Kolmogorov-Smirnov distance), answered and lost requests, and the routing
switches with their times from the first request.

An engine *process* in the pool comes up later than its configured start-up
delay (Python start, loading, the worker's health polling; 1-4 s on a loaded
2-core machine), which the lab does not model. `pool_run` measures each
backend's start, decision to RUNNING, from the log, and `lab_run` can be given
them (`startup_s`), so that what is compared is the control and the serving,
not how fast this machine starts a process.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy.stats import ks_2samp

from lab.config import LabSettings
from lab.results import run
from services.cluster.localpool import LocalPool
from services.ops.trace_replay import Replay, replay_client
from shared.configuration import pool_config
from shared.contracts.config import PoolConfig
from shared.contracts.events import InstanceStateChanged, PlacementRequested, RoutingStateChanged
from shared.contracts.states import InstanceState
from shared.contracts.trace import TraceRequest
from shared.eventlog.store import EventStore

QUANTILES = (50, 90, 99)


async def pool_run(database_url: str, nats_url: str, namespace: str, pool_yaml: str, workdir: Path,
                   trace: list[TraceRequest], store: EventStore, *, tick_s: float, window_s: float,
                   worker: dict[str, str]) -> dict[str, Any]:
    """The trace through the real pool: per-request TTFT and E2E, the routing switches in trace seconds, and each
    backend's median start (decision to RUNNING)."""
    name = load_pool_config_text(pool_yaml).aliases[0].alias
    pool = LocalPool(database_url, nats_url, namespace, pool_yaml, workdir, workers={"w1": worker},
                     env={"MODELPOOL_METRIC_WINDOW_S": str(window_s), "MODELPOOL_CONTROL_TICK_S": str(tick_s)})
    pool.start()
    try:
        async with replay_client(600.0) as client:
            replay = Replay(pool.gateway.removesuffix("/v1"), name, client, open_loop=True)
            began_at = datetime.now(timezone.utc)
            await replay.run(trace)
        events = store.typed(await store.history(name))
    finally:
        pool.stop()
    return {
        "ttft": [s.first - s.sent for s in replay.served if s.first is not None and s.done is not None],
        "e2e": [s.done - s.sent for s in replay.served if s.done is not None],
        "answered": sum(1 for s in replay.served if s.done is not None and s.error is None),
        "lost": sum(1 for s in replay.served if s.done is None or s.error is not None),
        "switches": [(f"{event.from_state.value}->{event.to_state.value}", (e.occurred_at - began_at).total_seconds())
                     for e, event in events if isinstance(event, RoutingStateChanged)],
        "starts": measured_starts(events),
    }


def measured_starts(events) -> dict[str, float]:
    """Median seconds from an instance's placement request (the controller's decision) to its first RUNNING, per
    backend: what the lab models as `startup_s`."""
    asked: dict[str, float] = {}
    starts: dict[str, list[float]] = {}
    for envelope, event in events:
        at = envelope.occurred_at.timestamp()
        if isinstance(event, PlacementRequested):
            asked.setdefault(event.instance_id, at)
        elif (isinstance(event, InstanceStateChanged) and event.from_state is InstanceState.STARTING
              and event.to_state is InstanceState.RUNNING and event.instance_id in asked):
            starts.setdefault(event.backend_type.value, []).append(at - asked.pop(event.instance_id))
    return {backend: round(float(np.median(seconds)), 2) for backend, seconds in starts.items()}


def lab_run(pool_yaml: str, trace: list[TraceRequest], *, tick_s: float, window_s: float, worker_gb: float,
            worker_slots: int, seed: int = 0, startup_s: dict[str, float] | None = None) -> dict[str, Any]:
    """The trace through the lab; `startup_s` (seconds per backend, as `pool_run` measures them) replaces the
    engines' configured start-up delays."""
    pool = load_pool_config_text(pool_yaml)
    alias = pool.aliases[0]
    if startup_s:
        alias = alias.model_copy(update={"backends": {
            backend: cfg.model_copy(update={"engine_args": {**cfg.engine_args, "startup-s": startup_s[backend.value]}})
            if backend.value in startup_s else cfg for backend, cfg in alias.backends.items()}})
    lab = LabSettings(tick_s=tick_s, window_s=window_s, workers=1, worker_gpu_memory_gb=worker_gb,
                      worker_slots=worker_slots, seed=seed, drain_s=0)
    result = run(alias, pool.controller, lab, trace)
    answered = [s for s in result.served if s.lost is None]
    return {
        "ttft": [s.ttft for s in answered if s.ttft is not None],
        "e2e": [s.e2e for s in answered if s.e2e is not None],
        "answered": len(answered),
        "lost": len(result.served) - len(answered),
        "switches": [(line.status, line.t) for line in result.log if line.action == "routing_switch"],
    }


def compare(pool: dict[str, Any], lab: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"answered": {"pool": pool["answered"], "lab": lab["answered"]},
                           "lost": {"pool": pool["lost"], "lab": lab["lost"]}}
    for key in ("ttft", "e2e"):
        a, b = np.asarray(pool[key]), np.asarray(lab[key])
        out[key] = {f"p{q}": {"pool": round(float(np.percentile(a, q)), 3), "lab": round(float(np.percentile(b, q)), 3)}
                    for q in QUANTILES} if len(a) and len(b) else {}
        out[f"{key}_ks"] = round(float(ks_2samp(a, b).statistic), 3) if len(a) and len(b) else None
    pairs = []
    for (path_p, t_p), (path_l, t_l) in zip(pool["switches"], lab["switches"]):
        pairs.append({"pool": path_p, "lab": path_l, "pool_s": round(t_p, 1), "lab_s": round(t_l, 1),
                      "gap_s": round(t_p - t_l, 1)})
    out["switches"] = pairs
    out["same_path"] = [p for p, _ in pool["switches"]] == [p for p, _ in lab["switches"]]
    return out


def load_pool_config_text(pool_yaml: str) -> PoolConfig:
    return pool_config(yaml.safe_load(pool_yaml), source="the pool file", environ={})
