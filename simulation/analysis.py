"""Derived tables of an experiment: sacrifice statistics and windowed arrival rates."""

from __future__ import annotations

from collections import Counter

import numpy as np

from simulation.recorder import Recorder


def sacrifice_distribution(rec: Recorder, max_rows: int = 2000) -> tuple[list[str], list[list]]:
    """One row per sacrifice event: the cumulative distribution (CDF) over decode positions of all
    sacrifices so far; column `pos_j` = share of sacrifices at a position <= j.

    Rows are thinned evenly to at most `max_rows` (the last event is always kept).
    """
    events = rec.sacrifices
    if not events:
        return ["event_index", "time", "req_id"], []
    max_pos = max(e[2] for e in events)
    columns = ["event_index", "time", "req_id", *[f"pos_{j}" for j in range(max_pos + 1)]]
    keep = set(np.linspace(0, len(events) - 1, min(max_rows, len(events))).round().astype(int).tolist())
    counts = np.zeros(max_pos + 1)
    rows = []
    for k, e in enumerate(events):
        counts[e[2]] += 1
        if k in keep:
            rows.append([k, e[0], e[1], *(np.cumsum(counts) / (k + 1)).round(6).tolist()])
    return columns, rows


def conditional_prob_timeline(rec: Recorder) -> tuple[list[str], list[list]]:
    """P(sacrifice | position, time window) = sacrifices at the position / request-batches spent there."""
    if not rec.sacrifices:
        return ["window", "time_start", "time_end"], []
    max_pos = max(e[2] for e in rec.sacrifices)
    by_window: dict[int, Counter[int]] = {}
    for e in rec.sacrifices:
        by_window.setdefault(int(e[0] // rec.window), Counter())[e[2]] += 1
    columns = ["window", "time_start", "time_end", *[f"pos_{j}" for j in range(max_pos + 1)]]
    rows = []
    for w in sorted(set(by_window) | set(rec.exposure)):
        sac = by_window.get(w, Counter())
        exp = rec.exposure.get(w, Counter())
        probs = [round(sac[j] / exp[j], 6) if exp[j] else 0.0 for j in range(max_pos + 1)]
        rows.append([w, w * rec.window, (w + 1) * rec.window, *probs])
    return columns, rows


def arrival_dynamics(rec: Recorder, end_time: float) -> dict[str, np.ndarray]:
    """Cumulative and per-window counts of external arrivals, internal (sacrifice) arrivals, completions."""
    window = rec.window
    arrivals = np.sort(np.array([r.arrival_time for r in rec.requests.values()]))
    completions = np.sort(np.array([r.completion_time for r in rec.requests.values() if r.completion_time is not None]))
    internal = np.sort(np.array([e[0] for e in rec.sacrifices]))
    n_windows = max(1, int(np.ceil(end_time / window)))
    edges = np.arange(n_windows + 1) * window
    return {
        "edges": edges,
        "arrivals": arrivals,
        "internal": internal,
        "completions": completions,
        "arrival_rate": np.histogram(arrivals, edges)[0] / window,
        "internal_rate": np.histogram(internal, edges)[0] / window,
        "completion_rate": np.histogram(completions, edges)[0] / window,
    }
