"""Experiments of seed 002: a single run, the four-way comparison and truncation.

`run_*` functions are pure simulation (the progress callback is the only way
out); `write_*` functions do the file I/O.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from simulation.analysis import conditional_prob_timeline, sacrifice_distribution
from simulation.config import SimConfig
from simulation.core import DecodeSystem, PreemptionMode, SimRequest, StepResult, Strategy
from simulation.plots import plot_arrival_dynamics, plot_comparison, plot_queue_dynamics, plot_sacrifice_dynamics
from simulation.recorder import (
    BATCH_COLUMNS,
    EVENT_COLUMNS,
    MEMORY_COLUMNS,
    QUEUE_COLUMNS,
    SACRIFICE_COLUMNS,
    TRACE_COLUMNS,
    Recorder,
)
from simulation.runner import run_until_idle
from simulation.summary import compute_summary, format_summary
from simulation.workload import RequestSpec, to_requests

Progress = Callable[[int], None]  # called with the number of requests completed since the last call


@dataclass
class ExperimentResult:
    config: SimConfig
    system: DecodeSystem
    recorder: Recorder
    end_time: float
    arrival_end: float
    wall_seconds: float
    summary: dict[str, Any]
    marks: list[tuple[float, str]] = field(default_factory=list)
    phases: dict[str, Any] | None = None
    title: str = ""


def window_length(config: SimConfig) -> float:
    s = config.system
    return config.experiment.window_batches * (s.d_0 + s.d_1 * s.B)


def _step_hook(rec: Recorder, progress: Progress | None, every: int) -> Callable[[StepResult], None]:
    pending = 0

    def on_step(res: StepResult) -> None:
        nonlocal pending
        rec.on_step(res)
        if progress is not None:
            pending += len(res.completed)
            if res.batch_id % every == 0 and pending:
                progress(pending)
                pending = 0

    def flush() -> None:
        nonlocal pending
        if progress is not None and pending:
            progress(pending)
            pending = 0

    on_step.flush = flush  # type: ignore[attr-defined]
    return on_step


def new_system(config: SimConfig) -> tuple[DecodeSystem, Recorder]:
    system = DecodeSystem(config.params())
    rec = Recorder(system, window=window_length(config),
                   queue_timeline_interval=config.experiment.queue_timeline_interval)
    return system, rec


def run_experiment(config: SimConfig, specs: Sequence[RequestSpec], *, progress: Progress | None = None) -> ExperimentResult:
    if not specs:
        raise ValueError("no requests to simulate")
    system, rec = new_system(config)
    requests = to_requests(list(specs))
    started = time.perf_counter()
    hook = _step_hook(rec, progress, config.experiment.progress_interval)
    end = run_until_idle(system, requests, on_arrival=rec.on_arrival, on_step=hook)
    hook.flush()
    wall = time.perf_counter() - started
    summary = compute_summary(rec, end_time=end)
    summary["basic"]["wall_seconds"] = wall
    p = system.params
    return ExperimentResult(config, system, rec, end, float(specs[-1].arrival_time), wall, summary,
                            title=f"{p.mode.value} + {p.strategy.value} ({p.victim_policy.value} victims)")


# ---- truncation ---------------------------------------------------------------

def candidate_truncation_batches(result: ExperimentResult, count: int) -> list[tuple[int, float]]:
    """Batches evenly spaced in time over the arrival phase: (batch_id, start time)."""
    times = np.array([row[0] for row in result.recorder.batches])
    targets = np.linspace(0, result.arrival_end, count + 2)[1:-1]
    out = []
    for x in targets:
        i = int(min(np.searchsorted(times, x), len(times) - 1))
        out.append((int(result.recorder.batches[i][1]), float(times[i])))
    return out


def run_truncated(
    config: SimConfig,
    specs: Sequence[RequestSpec],
    at_batch: int,
    *,
    new_rate: float | None = None,
    new_n: int | None = None,
    seed: int | None = None,
    progress: Progress | None = None,
) -> ExperimentResult:
    """Run to `at_batch`, drop requests not yet arrived, inject new arrivals at `new_rate`, run to the end."""
    if not specs:
        raise ValueError("no requests to simulate")
    system, rec = new_system(config)
    requests = to_requests(list(specs))
    hook = _step_hook(rec, progress, config.experiment.progress_interval)
    started = time.perf_counter()
    cut = run_until_idle(system, requests, on_arrival=rec.on_arrival, on_step=hook, stop_after_batch=at_batch)
    if system.batches <= at_batch:
        raise ValueError(f"the run ended after {system.batches} batches, before batch {at_batch}")
    fed = set(rec.requests)
    pending = [r for r in requests if r.request_id not in fed and r.arrival_time <= cut]
    dropped = sum(1 for r in requests if r.request_id not in fed and r.arrival_time > cut)
    span = specs[-1].arrival_time - specs[0].arrival_time
    original_rate = (len(specs) - 1) / span if span > 0 else 1.0
    rate = new_rate if new_rate is not None else original_rate / 2
    n = new_n if new_n is not None else max(dropped, 1)
    rng = np.random.default_rng(config.experiment.seed + 1 if seed is None else seed)
    times = cut + np.cumsum(rng.exponential(1.0 / rate, size=n))
    pick = rng.integers(0, len(specs), size=n)  # lengths resampled from the original workload
    injected = [SimRequest(f"new{i}", float(t), specs[j].prefill_length, specs[j].decode_length)
                for i, (t, j) in enumerate(zip(times, pick))]
    end = run_until_idle(system, pending + injected, start_time=cut, on_arrival=rec.on_arrival, on_step=hook)
    hook.flush()
    wall = time.perf_counter() - started
    summary = compute_summary(rec, end_time=end)
    summary["basic"]["wall_seconds"] = wall
    phases = phase_statistics(rec, cut, end, injected_prefix="new")
    phases["truncation"] = {
        "at_batch": at_batch, "time": cut, "dropped_requests": dropped, "injected_requests": n,
        "original_rate": original_rate, "new_rate": rate,
    }
    p = system.params
    return ExperimentResult(
        config, system, rec, end, float(times[-1]), wall, summary,
        marks=[(cut, f"truncation at batch {at_batch}")], phases=phases,
        title=f"{p.mode.value} + {p.strategy.value}, truncated at batch {at_batch}",
    )


def phase_statistics(rec: Recorder, cut: float, end: float, injected_prefix: str) -> dict[str, Any]:
    reqs = list(rec.requests.values())
    batches = np.array([row[:12] for row in rec.batches], dtype=float).reshape(-1, 12)

    def stats(group: list[SimRequest], t0: float, t1: float) -> dict[str, Any]:
        done = [r for r in group if r.completion_time is not None]
        delays = np.array([r.completion_time - r.arrival_time for r in done])
        arr = np.array([r.arrival_time for r in group])
        in_window = (batches[:, 0] >= t0) & (batches[:, 0] < t1)
        w = batches[in_window]
        dur = w[:, 9].sum()
        completed_in = sum(1 for r in reqs if r.completion_time is not None and t0 <= r.completion_time < t1)
        return {
            "time_start": t0,
            "time_end": t1,
            "requests": len(group),
            "completed": len(done),
            "observed_arrival_rate": (len(arr) - 1) / (arr.max() - arr.min()) if len(arr) > 1 and arr.max() > arr.min() else 0.0,
            "completion_rate_in_window": completed_in / (t1 - t0) if t1 > t0 else 0.0,
            "mean_delay": float(delays.mean()) if delays.size else float("nan"),
            "p95_delay": float(np.percentile(delays, 95)) if delays.size else float("nan"),
            "mean_waiting_queue": float((w[:, 5] * w[:, 9]).sum() / dur) if dur else 0.0,
            "max_waiting_queue": int(w[:, 5].max()) if w.size else 0,
            "mean_memory_utilization": float((w[:, 8] * w[:, 9]).sum() / dur) if dur else 0.0,
            "sacrifices": int(w[:, 11].sum()) if w.size else 0,
        }

    phase1 = [r for r in reqs if not r.request_id.startswith(injected_prefix)]
    phase2 = [r for r in reqs if r.request_id.startswith(injected_prefix)]
    return {"phase1": stats(phase1, 0.0, cut), "phase2": stats(phase2, cut, end), "overall": stats(reqs, 0.0, end)}


# ---- comparison ---------------------------------------------------------------

COMPARISON_COLUMNS = (
    "mode", "strategy", "victim_policy", "completed", "simulated_time", "batches", "requests_per_time", "tokens_per_time",
    "mean_delay", "p95_delay", "mean_waiting_time", "mean_waiting_queue", "max_waiting_queue",
    "avg_memory_utilization", "swap_out", "sacrifices", "preemptions", "wasted_tokens", "littles_law_error",
)


def comparison_row(result: ExperimentResult) -> dict[str, Any]:
    s = result.summary
    return {
        "mode": s["basic"]["mode"],
        "strategy": s["basic"]["strategy"],
        "victim_policy": s["basic"]["victim_policy"],
        "completed": s["basic"]["completed"],
        "simulated_time": s["basic"]["simulated_time"],
        "batches": s["basic"]["batches"],
        "requests_per_time": s["throughput"]["requests_per_time"],
        "tokens_per_time": s["throughput"]["tokens_per_time"],
        "mean_delay": s["delay"]["total_delay"]["mean"],
        "p95_delay": s["delay"]["total_delay"]["p95"],
        "mean_waiting_time": s["delay"]["waiting_time"]["mean"],
        "mean_waiting_queue": s["queues"]["waiting"]["mean"],
        "max_waiting_queue": s["queues"]["waiting"]["max"],
        "avg_memory_utilization": s["memory"]["avg_utilization"],
        "swap_out": s["preemption"]["swap_out"],
        "sacrifices": s["preemption"]["sacrifices"],
        "preemptions": s["preemption"]["swap_out"] + s["preemption"]["sacrifices"],
        "wasted_tokens": s["preemption"]["wasted_tokens"],
        "littles_law_error": s["littles_law"]["relative_error"],
    }


def format_table(rows: list[dict[str, Any]], columns: Iterable[str]) -> str:
    columns = list(columns)
    cells = [[_cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out) + "\n"


def _cell(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# ---- writing ------------------------------------------------------------------

def experiment_dir(base: str | Path, label: str) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%d_%H%M%S")
    path = Path(base) / f"{stamp}_{label}"
    n = 1
    while path.exists():
        n += 1
        path = Path(base) / f"{stamp}_{label}_{n}"
    path.mkdir(parents=True)
    return path


def _write_csv(path: Path, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for row in rows:
            w.writerow(["" if v is None else (f"{v:.6g}" if isinstance(v, float) else v) for v in row])


def write_experiment(result: ExperimentResult, out: Path, *, request_file: str | None, command: str) -> list[Path]:
    rec = result.recorder
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []

    def csv_file(name: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        _write_csv(out / name, columns, rows)
        files.append(out / name)

    csv_file("batch_snapshots.csv", BATCH_COLUMNS, rec.batches)
    csv_file("request_traces.csv", TRACE_COLUMNS, rec.trace_rows())
    csv_file("events.csv", EVENT_COLUMNS, sorted(rec.events, key=lambda e: e[0]))
    csv_file("queue_timeline.csv", QUEUE_COLUMNS, rec.queue_rows)
    csv_file("memory_events.csv", MEMORY_COLUMNS, rec.memory)
    sacrifice = result.system.params.mode is PreemptionMode.SACRIFICE
    if sacrifice:
        csv_file("sacrifice_snapshot.csv", SACRIFICE_COLUMNS, (e[:6] for e in rec.sacrifices))
        cols, rows = sacrifice_distribution(rec)
        csv_file("sacrifice_distribution.csv", cols, rows)
        cols, rows = conditional_prob_timeline(rec)
        csv_file("sacrifice_conditional_prob_timeline.csv", cols, rows)

    text = format_summary(result.summary)
    if result.phases:
        text += "\n" + format_summary(result.phases, title="Truncation phases")
    (out / "summary.txt").write_text(text)
    files.append(out / "summary.txt")
    (out / "config_used.yaml").write_text(yaml.safe_dump(result.config.dump(), sort_keys=False))
    files.append(out / "config_used.yaml")

    title = f"{result.title}\n" + _rates_title(result)
    files.append(plot_queue_dynamics(rec, out / "queue_dynamics.png", result.title))
    files.append(plot_arrival_dynamics(rec, out / "arrival_dynamics.png", end_time=result.end_time,
                                       arrival_end=result.arrival_end, marks=result.marks, title=title))
    if sacrifice:
        files.append(plot_sacrifice_dynamics(rec, out / "sacrifice_dynamics.png", end_time=result.end_time,
                                             title=f"Sacrifices: {result.title}"))
    p = result.system.params
    meta = {
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "experiment_dir": str(out),
        "command": command,
        "request_file": request_file,
        "preemption_mode": p.mode.value,
        "preemption_strategy": p.strategy.value,
        "victim_policy": p.victim_policy.value,
        "requests": len(rec.requests),
        "batches": result.system.batches,
        "simulated_time": result.end_time,
        "wall_seconds": round(result.wall_seconds, 3),
        "marks": [{"time": t, "label": label} for t, label in result.marks],
        "files": sorted(f.name for f in files) + ["experiment_meta.yaml"],
    }
    if result.phases:
        meta["truncation"] = result.phases["truncation"]
    (out / "experiment_meta.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    files.append(out / "experiment_meta.yaml")
    return files


def _rates_title(result: ExperimentResult) -> str:
    if result.phases:
        ph = result.phases
        return (f"Phase 1 (t=0-{ph['truncation']['time']:.0f}): rate {ph['phase1']['observed_arrival_rate']:.3g}, "
                f"mean delay {ph['phase1']['mean_delay']:.3g} | Phase 2: rate {ph['phase2']['observed_arrival_rate']:.3g}, "
                f"mean delay {ph['phase2']['mean_delay']:.3g} | Overall: {ph['overall']['completed']} completed")
    s = result.summary
    return (f"arrival rate {s['throughput']['arrival_rate']:.3g}, completion rate "
            f"{s['throughput']['requests_per_time']:.3g}, mean delay {s['delay']['total_delay']['mean']:.3g}")


def write_comparison(results: list[ExperimentResult], out: Path) -> tuple[str, list[Path]]:
    rows = [comparison_row(r) for r in results]
    _write_csv(out / "comparison.csv", COMPARISON_COLUMNS, ([r[c] for c in COMPARISON_COLUMNS] for r in rows))
    table = format_table(rows, COMPARISON_COLUMNS)
    (out / "comparison.txt").write_text(table)
    plot = plot_comparison(rows, out / "comparison.png")
    return table, [out / "comparison.csv", out / "comparison.txt", plot]


ALL_COMBINATIONS = [(m, s) for m in PreemptionMode for s in Strategy]
