"""`modelpool history ALIAS --plot FILE.png`: an alias's timeline (`timeline.py`) drawn as a figure.

matplotlib on an Agg canvas of its own (no pyplot: no process-wide figure state):
routing bands with numbered switches, the mix, instances per backend with the
controller's targets, load and latency, and the switches listed with their reasons.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path

import matplotlib.dates as mdates
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter, PercentFormatter

from services.ops.timeline import Switch, Timeline, TimelineError, clock, gather_timeline
from shared.contracts.backends import BackendType
from shared.contracts.control import MetricWindow
from shared.contracts.states import InstanceState, RoutingState
from shared.settings import Settings

ROUTING_COLOURS = {
    RoutingState.COLD: "#c9ced6",
    RoutingState.FAST_ONLY: "#8cc084",
    RoutingState.WARMING_VLLM: "#f5c35b",
    RoutingState.MIXED: "#b48ccf",
    RoutingState.VLLM_PRIMARY: "#5b8fd1",
    RoutingState.DEGRADED_FAST: "#e0605e",
}
INSTANCE_LAYERS: tuple[tuple[str, tuple[InstanceState, ...], str], ...] = (
    ("running", (InstanceState.RUNNING,), "#3f8f46"),
    ("starting", (InstanceState.STARTING,), "#a7d49b"),
    ("asleep, level 1", (InstanceState.SLEEP_1,), "#7fa8d8"),
    ("asleep, level 2", (InstanceState.SLEEP_2,), "#3c5f97"),
    ("draining / deleting", (InstanceState.DRAINING, InstanceState.DELETING), "#b0b0b0"),
    ("error", (InstanceState.ERROR,), "#d43d3a"),
)
BACKEND_NAMES = {BackendType.LLAMA_CPP: "llama.cpp", BackendType.VLLM: "vLLM"}
FAST_COLOUR, SLOW_COLOUR, HELD_COLOUR = "#3f8f46", "#3c6fb0", "#e08a1e"
WIDTH_IN, DPI = 14.0, 100
LEFT, RIGHT = 0.07, 0.83
"""The panels' horizontal extent (figure fractions); legends sit to the right of it."""
HEADER_IN, TIME_AXIS_IN, LINE_IN = 1.3, 0.55, 0.17
LIST_CHAR_IN = 0.07
"""Width of a character of the switch list (DejaVu Sans Mono, 8 pt, 7 px at 100 dpi): reasons are cut to fit their column."""
MAX_NUMBERED = 60
"""Up to this many switches are numbered over their lines and listed with their reasons; more are summed up by kind."""
MAX_DOTS = 200
"""Windows recorded with decisions are drawn as dots, smaller beyond this many so they do not merge."""


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}".replace(".0 ", " ")
    return f"{seconds:.0f} s"


def short_reason(reason: str, width: int) -> str:
    """A reason cut to `width`: a trailing parenthesis (the thresholds and capacities behind it, which the
    text history keeps) goes first, then words from the end."""
    reason = reason.strip()
    if reason.endswith(")"):
        depth = 0
        for i in range(len(reason) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(reason[i], 0)
            if depth == 0:
                reason = reason[:i].rstrip() or reason
                break
    return textwrap.shorten(reason, width=max(12, width), placeholder=" …")


def engines_line(t: Timeline) -> str:
    """Which engine served each tier, saying plainly when one is the simulator."""
    parts = []
    for backend in sorted(t.engines, key=lambda b: b.value):
        name = BACKEND_NAMES[backend]
        kinds = [f"{name} SIMULATED (engine: simulator: no GPU, no real inference)" if kind.simulated else
                 BACKEND_NAMES[BackendType(kind.value)] for kind in t.engines[backend]]
        parts.append(f"{backend.tier} tier: {' / '.join(kinds)}")
    return "   ·   ".join(parts) or "no configuration recorded: engines unknown"


def _num(times: Sequence[datetime]) -> np.ndarray:
    return np.asarray(mdates.date2num(list(times)), dtype=float)


def _window_series(windows: Sequence[MetricWindow], value) -> tuple[np.ndarray, np.ndarray]:
    """Each window's value at its middle; a gap longer than two windows breaks the line."""
    x: list[datetime] = []
    y: list[float] = []
    previous: MetricWindow | None = None
    for w in windows:
        if previous is not None and (w.window_start - previous.window_end).total_seconds() > 2 * previous.seconds:
            x.append(previous.window_end)
            y.append(np.nan)
        v = value(w)
        x.append(w.window_start + (w.window_end - w.window_start) / 2)
        y.append(np.nan if v is None else v)
        previous = w
    return _num(x), np.asarray(y, dtype=float)


def _switch_labels(switches: Sequence[Switch], xs: np.ndarray, x0: float, x1: float) -> list[tuple[float, str]]:
    """Numbers to flag the switch lines with, left-aligned on one row: switches too close to be numbered apart
    share a label (`4–7`) on the first one's line."""
    char_px, pad_px = 7.0, 5.0
    px = (xs - x0) / (x1 - x0) * (RIGHT - LEFT) * WIDTH_IN * DPI

    def label(first: int, last: int) -> str:
        return str(switches[first].number) + (f"–{switches[last].number}" if last > first else "")

    groups: list[list[int]] = []
    right_edge = -np.inf
    for i in range(len(switches)):
        if px[i] >= right_edge + pad_px:
            groups.append([i, i])
        else:
            groups[-1][1] = i
        right_edge = px[groups[-1][0]] + len(label(*groups[-1])) * char_px
    return [(xs[first], label(first, last)) for first, last in groups]


def _switch_list(t: Timeline, columns: int) -> tuple[str, list[str]]:
    """The heading and lines under the figure: each switch with its reason, or, when there are too many
    to number, a count of each kind of switch with the latest reason for it."""
    long_range = t.until - t.since > timedelta(days=1)
    column_chars = int((1 - LEFT - 0.02) * WIDTH_IN / columns / LIST_CHAR_IN) - 3  # 3 between columns
    if len(t.switches) <= MAX_NUMBERED:
        digits = len(str(len(t.switches)))
        prefix = digits + 1 + len(clock(t.since, long_range)) + 2 + 2 + 13 + 1
        return "routing switches", [
            f"{s.number:>{digits}} {clock(s.at, long_range)}  → {s.to_state.value:<13} "
            f"{short_reason(s.reason, column_chars - prefix)}" for s in t.switches]
    kinds: dict[tuple[RoutingState, RoutingState], list[Switch]] = defaultdict(list)
    for s in t.switches:
        kinds[(s.from_state, s.to_state)].append(s)
    heading = (f"{len(t.switches)} routing switches, too many to number at this range (narrow --since/--until, "
               f"or `modelpool history {t.alias}` lists each); by kind, with the latest reason:")
    prefix = 6 + 2 + 13 + 3 + 13 + 1
    return heading, [f"{len(found):>5}×  {a.value:<13} → {b.value:<13} {short_reason(found[-1].reason, column_chars - prefix)}"
                     for (a, b), found in sorted(kinds.items(), key=lambda kv: -len(kv[1]))]


def _legend(ax, **kwargs) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.05), fontsize=7.5, frameon=False, **kwargs)


def draw_timeline(t: Timeline, path: Path) -> Path:
    """The figure: routing bands with numbered switches, mix, instances per backend, load and latency."""
    backends = sorted(set(t.engines) | {b for c in t.instances for b in c.counts} | set(t.targets),
                      key=lambda b: b.value)
    numbered = len(t.switches) <= MAX_NUMBERED
    columns = 2 if numbered and len(t.switches) > 16 else 1
    heading, lines = _switch_list(t, columns) if t.switches else ("", [])
    list_in = (0.3 + LINE_IN * -(-len(lines) // columns)) if lines else 0.0
    heights = [0.5, 0.9] + [1.0] * len(backends) + [1.4, 1.1, 1.3]
    height_in = HEADER_IN + sum(heights) * 1.1 + TIME_AXIS_IN + list_in
    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights, left=LEFT, right=RIGHT, hspace=0.3,
                            top=1 - HEADER_IN / height_in, bottom=(TIME_AXIS_IN + list_in) / height_in)
    band = fig.add_subplot(grid[0])
    axes = [band] + [fig.add_subplot(grid[i], sharex=band) for i in range(1, len(heights))]
    x0, x1 = mdates.date2num(t.since), mdates.date2num(t.until)
    band.set_xlim(x0, x1)

    # Routing states as bands, named where they are wide enough to hold the name.
    by_state: dict[RoutingState, list[tuple[float, float]]] = defaultdict(list)
    for span in t.spans:
        start, end = mdates.date2num(span.start), mdates.date2num(span.end)
        by_state[span.state].append((start, end - start))
        if (end - start) / (x1 - x0) > 0.075:
            band.text((start + end) / 2, 0.5, span.state.value, ha="center", va="center", fontsize=7.5, color="#222")
    for state, bars in by_state.items():
        band.broken_barh(bars, (0, 1), facecolors=ROUTING_COLOURS[state], edgecolor="none")
    band.set_ylim(0, 1)
    band.set_yticks([])
    band.set_ylabel("routing")
    band.legend(handles=[Patch(facecolor=ROUTING_COLOURS[s], label=s.value) for s in RoutingState],
                loc="upper left", bbox_to_anchor=(1.01, 1.6), fontsize=7.5, frameon=False)
    switch_x = _num([s.at for s in t.switches])
    if numbered:
        for x, text in _switch_labels(t.switches, switch_x, x0, x1):
            band.annotate(text, (x, 1), xycoords=band.get_xaxis_transform(), xytext=(1.5, 3),
                          textcoords="offset points", ha="left", va="bottom", fontsize=7.5, fontweight="bold",
                          color="#333", annotation_clip=False)

    # The mix weight.
    mix_ax = axes[1]
    mix_x = np.append(_num([s.at for s in t.mix]), x1)
    mix_y = np.append([s.value * 100 for s in t.mix], t.mix[-1].value * 100)
    mix_ax.step(mix_x, mix_y, where="post", color=SLOW_COLOUR, lw=1.4)
    mix_ax.fill_between(mix_x, mix_y, step="post", color=SLOW_COLOUR, alpha=0.12)
    mix_ax.set_ylim(-5, 105)
    mix_ax.set_yticks([0, 50, 100])
    mix_ax.yaxis.set_major_formatter(PercentFormatter())
    mix_ax.set_ylabel("share to vLLM")

    # Instances per backend, stacked by state, with the controller's target.
    counts_x = np.append(_num([c.at for c in t.instances]), x1)
    for n, (ax, backend) in enumerate(zip(axes[2:], backends)):
        layers = []
        for _, states, _ in INSTANCE_LAYERS:
            values = [sum(c.counts.get(backend, {}).get(s, 0) for s in states) for c in t.instances]
            layers.append(np.append(values, values[-1]))
        ax.stackplot(counts_x, *layers, step="post", colors=[c for _, _, c in INSTANCE_LAYERS], lw=0)
        steps = t.targets.get(backend, [])
        if steps:
            ax.step(np.append(_num([s.at for s in steps]), x1), np.append([s.value for s in steps], steps[-1].value),
                    where="post", color="black", ls="--", lw=1)
        ax.set_ylim(0, max(np.max(np.sum(layers, axis=0)), *(s.value for s in steps), 1) * 1.15 + 0.2)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
        simulated = any(kind.simulated for kind in t.engines.get(backend, ()))
        ax.set_ylabel(f"{BACKEND_NAMES[backend]}\ninstances" + ("\n(simulated)" if simulated else ""))
        if n == 0:  # one legend for every backend's panel
            handles = [Patch(facecolor=colour, label=name) for name, _, colour in INSTANCE_LAYERS]
            _legend(ax, handles=handles + [Line2D([], [], color="black", ls="--", lw=1, label="target")])

    # Load and latency: the gateways' windows as lines; the windows recorded with decisions as dots, unjoined:
    # they are samples, and a line across the time between two decisions would claim what nobody measured.
    inflight_ax, rate_ax, latency_ax = axes[-3:]
    series = (
        (inflight_ax, "in flight, fast", FAST_COLOUR, lambda w: w.inflight_fast),
        (inflight_ax, "in flight, slow", SLOW_COLOUR, lambda w: w.inflight_slow),
        (inflight_ax, "held at gateways", HELD_COLOUR, lambda w: w.held),
        (rate_ax, "arrivals / s", "#7b4fa0", lambda w: w.arrivals / w.seconds),
        (rate_ax, "answers / s", "#2a9d8f", lambda w: w.requests / w.seconds),
        (latency_ax, "TTFT p95", "#c2571a", lambda w: w.ttft_p95_s),
        (latency_ax, "E2E p95", "#444444", lambda w: w.e2e_p95_s),
    )
    dots = dict(ls="none", marker="o", ms=3 if len(t.recorded_load) <= MAX_DOTS else 1.5)
    for ax, label, colour, value in series:
        x, y = _window_series(t.load, value)
        shown = bool(np.isfinite(y).any())
        if shown:
            ax.plot(x, y, color=colour, lw=1.1, label=label)
            # A value with no neighbour draws no line (a latency exists only where a request ended): a dot shows it.
            known = np.isfinite(y)
            alone = known & ~np.r_[False, known[:-1]] & ~np.r_[known[1:], False]
            ax.plot(x[alone], y[alone], color=colour, ls="none", marker="o", ms=2.5)
        x, y = _window_series(t.recorded_load, value)
        if np.isfinite(y).any():
            ax.plot(x, y, color=colour, label=None if shown else label, **dots)
    if t.load and t.recorded_load:
        inflight_ax.plot([], [], color="#666", label="recorded with decisions", **dots)
    inflight_ax.set_ylabel("requests")
    rate_ax.set_ylabel("per second")
    latency_ax.set_ylabel("p95 (s)")
    for ax in (inflight_ax, rate_ax):
        ax.set_ylim(bottom=0)
    if latency_ax.get_lines():
        latency_ax.set_yscale("log")
        low, high = latency_ax.get_ylim()
        # Labels at 1, 2 and 5 of each decade while they fit, at each decade alone beyond two.
        latency_ax.yaxis.set_major_locator(LogLocator(subs=(1.0,) if high / low > 300 else (1.0, 2.0, 5.0)))
        latency_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        latency_ax.yaxis.set_minor_formatter(NullFormatter())
    for ax in axes[-3:]:
        if ax.get_lines():
            _legend(ax)
        else:
            ax.text(0.5, 0.5, "not measured in this range", transform=ax.transAxes, ha="center", va="center",
                    fontsize=8, color="#888")

    # Every panel: the switch lines (while they can be told apart), a light grid, UTC time at the bottom.
    for ax in axes:
        if numbered and len(switch_x):
            ax.vlines(switch_x, 0, 1, transform=ax.get_xaxis_transform(), colors="#333", lw=0.7, alpha=0.5, zorder=3)
        if ax is not band:
            ax.grid(axis="y", color="#e6e6e6", lw=0.6)
        ax.tick_params(labelsize=8)
        ax.yaxis.label.set_size(8.5)
        if ax is not axes[-1]:
            ax.tick_params(labelbottom=False)
    locator = mdates.AutoDateLocator(tz=timezone.utc)
    axes[-1].xaxis.set_major_locator(locator)
    axes[-1].xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=timezone.utc))
    axes[-1].set_xlabel("time (UTC)", fontsize=8.5)
    fig.align_ylabels(axes)

    # Heading: the alias and range, the engines, where the load comes from.
    since, until = t.since.astimezone(timezone.utc), t.until.astimezone(timezone.utc)
    simulated = any(kind.simulated for kinds in t.engines.values() for kind in kinds)
    from_log_only = bool(t.recorded_load) or not t.load
    for y_in, text, style in (
        (0.28, f"{t.alias}    {since:%Y-%m-%d %H:%M:%S} → {until:%Y-%m-%d %H:%M:%S} UTC"
               f"  ({_duration((until - since).total_seconds())})", dict(fontsize=13, fontweight="bold")),
        (0.6, engines_line(t), dict(fontsize=9, color="#a33" if simulated else "#333")),
        (0.84, t.load_note, dict(fontsize=8.5, style="italic", color="#b35900" if from_log_only else "#555")),
    ):
        fig.text(LEFT, 1 - y_in / height_in, text, va="top", **style)

    # Under it, the switches: numbered as over their lines, with their reasons.
    if lines:
        top_in = list_in - 0.05
        fig.text(LEFT, top_in / height_in, heading, fontsize=9, fontweight="bold", va="top")
        per_column = -(-len(lines) // columns)
        for i, line in enumerate(lines):
            column, row = divmod(i, per_column)
            fig.text(LEFT + column * (1 - LEFT - 0.02) / columns, (top_in - 0.24 - LINE_IN * row) / height_in, line,
                     fontsize=8, family="monospace", va="top", color="#222")
    fig.savefig(path, dpi=DPI)
    return path


# --------------------------------------------------------------------------- the command


def plot_history(settings: Settings, alias: str, since: datetime | None, until: datetime | None, path: Path) -> int:
    """`modelpool history ALIAS --plot FILE`: gather, draw, say where it went."""
    try:
        timeline = asyncio.run(gather_timeline(settings, alias, since, until))
    except TimelineError as exc:
        print(f"modelpool history: {exc}", file=sys.stderr)
        return 1
    try:
        draw_timeline(timeline, path)
    except (OSError, ValueError) as exc:
        print(f"modelpool history: cannot write {path}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}: {alias}, {len(timeline.switches)} routing switches, "
          f"{len(timeline.load) + len(timeline.recorded_load)} load windows")
    return 0
