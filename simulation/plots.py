"""Experiment figures (matplotlib, Agg backend): queue, arrival and sacrifice dynamics, comparisons."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from simulation.analysis import arrival_dynamics, conditional_prob_timeline, sacrifice_distribution  # noqa: E402
from simulation.recorder import Recorder  # noqa: E402


def _batches(rec: Recorder) -> np.ndarray:
    return np.array([row[:12] for row in rec.batches], dtype=float).reshape(-1, 12)


def plot_queue_dynamics(rec: Recorder, path: Path, title: str) -> Path:
    b = _batches(rec)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    t = b[:, 0]
    top.plot(t, b[:, 5], label="WAITING", lw=1)
    top.plot(t, b[:, 4], label="RUNNING", lw=1)
    if b[:, 6].any():
        top.plot(t, b[:, 6], label="SWAPPED", lw=1)
    if (b[:, 2] != b[:, 4]).any():  # only when B leaves some RUNNING requests out of the batch
        top.plot(t, b[:, 2], label="executed (batch_count)", lw=0.8, ls="--", alpha=0.7)
    sac = b[:, 11] > 0
    if sac.any():
        top.scatter(t[sac], b[sac, 11], s=6, color="red", label="sacrifices in batch", zorder=3)
    top.set_ylabel("requests")
    top.legend(loc="upper right", fontsize=8)
    top.set_title(title)
    bottom.plot(t, b[:, 7], label="GPU memory used", lw=1)
    bottom.axhline(rec.M_total, color="black", ls=":", lw=0.8, label="M_total")
    bottom.set_xlabel("time (batch-time units)")
    bottom.set_ylabel("GPU memory (tokens)")
    twin = bottom.twinx()
    twin.plot(t, b[:, 3], color="C1", label="batch tokens", lw=0.8, alpha=0.8)
    if b[:, 3].max(initial=0) >= 0.5 * rec.system.params.B:
        twin.axhline(rec.system.params.B, color="C1", ls="--", lw=0.8, label="B")
    twin.set_ylabel("batch tokens", color="C1")
    lines = bottom.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    bottom.legend(lines[0] + more[0], lines[1] + more[1], loc="lower center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_arrival_dynamics(
    rec: Recorder,
    path: Path,
    *,
    end_time: float,
    arrival_end: float,
    marks: list[tuple[float, str]] = (),
    title: str = "Arrival dynamics",
) -> Path:
    d = arrival_dynamics(rec, end_time)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for key, label in (("arrivals", "External arrival"), ("internal", "Internal arrival (sacrifice)"),
                       ("completions", "Completion")):
        x = d[key]
        if x.size:
            top.step(x, np.arange(1, x.size + 1), where="post", label=label)
    top.set_ylabel("cumulative count")
    top.set_title(title, fontsize=10)
    mids = (d["edges"][:-1] + d["edges"][1:]) / 2
    bottom.plot(mids, d["arrival_rate"], label="External arrival rate")
    if d["internal"].size:
        bottom.plot(mids, d["internal_rate"], label="Internal arrival rate (sacrifice)")
    bottom.plot(mids, d["completion_rate"], label="Completion rate")
    bottom.set_ylabel(f"per time unit (window {rec.window:g})")
    bottom.set_xlabel("time (batch-time units)")
    for ax in (top, bottom):
        for i, (x, label) in enumerate(marks):
            ax.axvline(x, color="red", ls="--", lw=0.9, label=label if ax is top and i < 8 else None)
        ax.axvline(arrival_end, color="black", ls="--", lw=0.9, label="Arrival End" if ax is top else None)
        ax.axvline(end_time, color="green", ls="--", lw=0.9, label="Simulation End" if ax is top else None)
    top.legend(loc="upper left", fontsize=8)
    bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_sacrifice_dynamics(rec: Recorder, path: Path, *, end_time: float, title: str) -> Path:
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(11, 10))
    events = rec.sacrifices
    edges = np.arange(max(1, int(np.ceil(end_time / rec.window))) + 1) * rec.window
    times = np.array([e[0] for e in events])
    wasted = np.cumsum([e[2] for e in events]) if events else np.array([])
    top.bar(edges[:-1], np.histogram(times, edges)[0], width=rec.window, align="edge", alpha=0.6,
            label="sacrifices per window")
    top.set_ylabel("sacrifice events")
    top.set_xlabel("time")
    twin = top.twinx()
    if events:
        twin.plot(times, wasted, color="red", label="cumulative wasted tokens")
    twin.set_ylabel("wasted tokens", color="red")
    top.set_title(title)
    top.legend(loc="upper left", fontsize=8)

    cols, rows = sacrifice_distribution(rec, max_rows=400)
    if rows:
        probs = np.array([r[3:] for r in rows], dtype=float)
        idx = np.linspace(0, len(rows) - 1, min(6, len(rows))).round().astype(int)
        for i in idx:
            middle.plot(np.arange(probs.shape[1]), probs[i], label=f"t={rows[i][1]:.0f}")
        middle.legend(fontsize=8, title="after the sacrifice at")
    middle.set_xlabel("decode position")
    middle.set_ylabel("CDF of sacrificed positions")

    cols, rows = conditional_prob_timeline(rec)
    if rows:
        mat = np.array([r[3:] for r in rows], dtype=float)
        im = bottom.imshow(mat.T, aspect="auto", origin="lower", cmap="viridis",
                           extent=(rows[0][1], rows[-1][2], -0.5, mat.shape[1] - 0.5))
        fig.colorbar(im, ax=bottom, label="P(sacrifice | position, time)")
    bottom.set_xlabel("time")
    bottom.set_ylabel("decode position")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_comparison(rows: list[dict], path: Path) -> Path:
    labels = [f"{r['mode']}\n{r['strategy']}\n{r['victim_policy']}" for r in rows]
    metrics = [
        ("mean_delay", "mean delay"),
        ("p95_delay", "p95 delay"),
        ("requests_per_time", "requests / time"),
        ("avg_memory_utilization", "memory utilisation"),
        ("preemptions", "preemptions"),
        ("wasted_tokens", "wasted tokens"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, name) in zip(axes.flat, metrics):
        ax.bar(labels, [r[key] for r in rows], color=[f"C{i}" for i in range(len(rows))])
        ax.set_title(name, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("Scheduler variants on the same requests")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
