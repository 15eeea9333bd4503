"""System-level metrics of an experiment (seed 002 "性能指标") and their text report."""

from __future__ import annotations

from typing import Any

import numpy as np

from simulation.recorder import Recorder


def _stats(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p95": float("nan"), "p99": float("nan"), "max": float("nan")}
    return {
        "mean": float(values.mean()),
        "p50": float(np.percentile(values, 50)),
        "p95": float(np.percentile(values, 95)),
        "p99": float(np.percentile(values, 99)),
        "max": float(values.max()),
    }


def _weighted(values: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    total = weights.sum()
    if values.size == 0 or total <= 0:
        return {"mean": 0.0, "max": 0.0, "std": 0.0}
    mean = float((values * weights).sum() / total)
    var = float((weights * (values - mean) ** 2).sum() / total)
    return {"mean": mean, "max": float(values.max()), "std": var**0.5}


def compute_summary(rec: Recorder, *, end_time: float, start_time: float = 0.0) -> dict[str, Any]:
    """Metrics over [start_time, end_time] from the recorder's batches and request traces."""
    system = rec.system
    params = system.params
    batches = np.array([row[:12] for row in rec.batches], dtype=float).reshape(-1, 12)
    durations = batches[:, 9]
    horizon = max(end_time - start_time, 1e-12)
    reqs = list(rec.requests.values())
    done = [r for r in reqs if r.completion_time is not None]
    delays = np.array([r.completion_time - r.arrival_time for r in done])
    waits = np.array([r.first_enter_running_time - r.arrival_time for r in done])
    execs = np.array([r.completion_time - r.first_enter_running_time for r in done])
    arrivals = np.array([r.arrival_time for r in reqs])
    out_tokens = int(sum(r.decode_length for r in done))
    counters = dict(system.counters)

    # Little's law: L from the queue snapshots (time-weighted number in system), lambda*W from traces
    in_system = batches[:, 4] + batches[:, 5] + batches[:, 6]
    L = float((in_system * durations).sum() / horizon)
    lam = len(done) / horizon
    W = float(delays.mean()) if delays.size else 0.0
    little_rel = abs(L - lam * W) / (lam * W) if lam * W > 0 else 0.0

    busy = durations.sum()
    summary: dict[str, Any] = {
        "basic": {
            "mode": params.mode.value,
            "strategy": params.strategy.value,
            "victim_policy": params.victim_policy.value,
            "M_total": params.M_total,
            "B": params.B,
            "d_0": params.d_0,
            "d_1": params.d_1,
            "requests": len(reqs),
            "completed": len(done),
            "batches": int(batches.shape[0]),
            "simulated_time": horizon,
            "arrival_span": float(arrivals.max() - arrivals.min()) if arrivals.size > 1 else 0.0,
            "busy_fraction": float(busy / horizon),
        },
        "throughput": {
            "requests_per_time": len(done) / horizon,
            "tokens_per_time": out_tokens / horizon,
            "generated_tokens_per_time": counters["generation_tokens"] / horizon,
            "arrival_rate": (len(reqs) - 1) / float(arrivals.max() - arrivals.min()) if arrivals.size > 1 and arrivals.max() > arrivals.min() else 0.0,
        },
        "delay": {
            "total_delay": _stats(delays),
            "waiting_time": _stats(waits),
            "execution_time": _stats(execs),
        },
        "queues": {
            "waiting": _weighted(batches[:, 5], durations),
            "running": _weighted(batches[:, 4], durations),
            "swapped": _weighted(batches[:, 6], durations),
            "batch_count": _weighted(batches[:, 2], durations),
            "batch_tokens": _weighted(batches[:, 3], durations),
        },
        "memory": {
            "avg_utilization": float((batches[:, 8] * durations).sum() / horizon),
            "avg_utilization_busy": float((batches[:, 8] * durations).sum() / busy) if busy else 0.0,
            "max_used": int(batches[:, 7].max()) if batches.size else 0,
        },
        "preemption": {
            "swap_out": counters["swap_out"],
            "swap_in": counters["swap_in"],
            "sacrifices": counters["sacrifices"],
            "swap_frequency": counters["swap_out"] / horizon,
            "sacrifice_frequency": counters["sacrifices"] / horizon,
            "wasted_tokens": counters["wasted_tokens"],
            "wasted_token_share": counters["wasted_tokens"] / max(counters["generation_tokens"], 1),
        },
        "littles_law": {
            "L_time_average_in_system": L,
            "lambda": lam,
            "W_mean_delay": W,
            "lambda_W": lam * W,
            "relative_error": little_rel,
        },
        "checks": {"memory_bookkeeping_mismatches": rec.mismatches},
    }
    return summary


def format_summary(summary: dict[str, Any], title: str = "Decode simulation summary") -> str:
    lines = [title, "=" * len(title)]
    for section, values in summary.items():
        lines.append("")
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, dict):
                inner = ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())
                lines.append(f"  {key}: {inner}")
            else:
                lines.append(f"  {key}: {_fmt(value)}")
    ll = summary.get("littles_law")
    if ll:
        verdict = "holds" if ll["relative_error"] < 0.05 else "DOES NOT hold"
        lines += ["", f"Little's law L = lambda*W: {ll['L_time_average_in_system']:.4g} vs "
                      f"{ll['lambda_W']:.4g} (relative error {ll['relative_error']:.2%}) -> {verdict}"]
    return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
