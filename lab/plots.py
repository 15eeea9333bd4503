"""The lab's figure: instances per tier and load over time, one panel per policy."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lab.results import RunResult  # noqa: E402


def plot_runs(runs: list[RunResult], path: Path, title: str) -> Path:
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.6 * len(runs) + 0.6), sharex=True, squeeze=False)
    hours = max((r.samples[-1].t for r in runs if r.samples), default=0) > 4 * 3600
    scale, unit = (3600.0, "h") if hours else (1.0, "s")
    for ax, run in zip(axes[:, 0], runs):
        t = [s.t / scale for s in run.samples]
        tiers = sorted({k for s in run.samples for k in (*s.awake, *s.asleep)})
        for tier in tiers:
            ax.step(t, [s.awake.get(tier, 0) for s in run.samples], where="post", lw=1.2, label=f"{tier} awake")
            if any(s.asleep.get(tier) for s in run.samples):
                ax.step(t, [s.asleep.get(tier, 0) for s in run.samples], where="post", lw=0.8, ls=":",
                        label=f"{tier} asleep")
        ax.set_ylabel("instances")
        ax.set_ylim(bottom=0, top=max(1, ax.get_ylim()[1]))
        load = ax.twinx()
        load.plot(t, [s.arrivals_per_s for s in run.samples], color="grey", lw=0.6, alpha=0.6, label="arrivals/s")
        load.set_ylabel("arrivals / s", color="grey")
        s = run.summary
        ax.set_title(f"{run.policy}: SLO {s['slo_attainment']:.2%}, TTFT p95 {s['ttft_s']['p95']} s, "
                     f"{s['scale_actions']} scale actions, {s['gpu_mem_s'] / 3600:.0f} GB·h", fontsize=9, loc="left")
        ax.legend(loc="upper left", fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
