"""Plots of trace replays side by side: TTFT CDFs, per-instance TTFT p90, and when sessions changed instance."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from services.ops.trace_replay import ReplayedRequest, instance_changes  # noqa: E402


def plot_runs(runs: dict[str, tuple[dict, list[ReplayedRequest]]], path: Path) -> Path:
    """One column per measure, every run in each: `runs` maps a name to its summary and its requests."""
    fig, (cdf, bars, moves) = plt.subplots(1, 3, figsize=(17, 4.8))
    for name, (summary, served) in runs.items():
        speedup = summary.get("speedup", 1.0)
        ttft = np.sort([(s.first - s.sent) * speedup for s in served if s.first is not None and s.error is None])
        if len(ttft):
            cdf.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=name)
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (s, trace time)")
    cdf.set_ylabel("share of requests")
    cdf.set_title("TTFT CDF")
    cdf.grid(alpha=0.3)
    cdf.legend(fontsize=8)

    width = 0.8 / max(1, len(runs))
    for k, (name, (summary, _)) in enumerate(runs.items()):
        each = summary["instance_ttft_p90_s"].get("each", {})
        values = [v for _, v in sorted(each.items())]
        bars.bar(np.arange(len(values)) + k * width, values, width, label=name)
    bars.set_xlabel("instance (sorted by id)")
    bars.set_ylabel("TTFT p90 (s)")
    bars.set_title("per-instance TTFT p90")
    bars.legend(fontsize=8)

    for k, (name, (summary, served)) in enumerate(runs.items()):
        ok = [s for s in served if s.done is not None and s.error is None]
        began = min((s.sent for s in ok), default=0.0)
        _, changes = instance_changes(ok)
        speedup = summary.get("speedup", 1.0)
        times = [(sent - began) * speedup for _, sent in changes]
        moves.scatter(times, [k] * len(times), s=8, marker="|")
    moves.set_yticks(range(len(runs)), list(runs))
    moves.set_xlabel("trace time (s)")
    moves.set_title("a session's turn served by another instance")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
