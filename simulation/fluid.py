"""The fluid model of seed 002 and the fluid-limit experiment.

State (per unit of scale): Q(t) WAITING, X_i(t) RUNNING at decode position i,
Z_i(t) SWAPPED at position i. With tau(t) = d_0 + d_1*B(t) the batch duration
and B(t) = sum_i X_i the batch tokens (one per decoding request):

    dQ/dt   = lambda(t) - S_q(t)                         (+ sum_i X_i r_i / tau in sacrifice mode)
    dZ_i/dt = X_i r_i / tau - S_Z,i(t)                   (swap mode)
    dX_i/dt = [X_{i-1} (1 - r_{i-1} - q_{i-1}) - X_i] / tau + S_q p_i + S_Z,i

The controls S_q, S_Z,i and the observed probabilities p_i, q_i, r_i are
estimated, window by window, from the traces of a discrete run (an
independent run at the reference scale, so the ODE is not fitted to the runs
it is compared with). `run_fluid_limit` then runs the discrete system with
arrival rate, memory and budget multiplied by n (and d_1 divided by n, so a
batch of n times more requests takes the same time) and measures the distance
between X^(n)(t)/n and X(t), which must shrink as n grows.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy.integrate import solve_ivp

from simulation.config import SimConfig
from simulation.core import DecodeCost, DecodeSystem, PreemptionMode, SimRequest, StepResult, SystemParams
from simulation.runner import run_until_idle
from simulation.workload import LengthDist, generate


@dataclass(frozen=True)
class FluidLimitSpec:
    rate: float = 1.5  # base arrival rate (scale 1)
    horizon: float = 300.0  # arrivals stop here
    prefill: LengthDist | str = "uniform:20:200"
    decode: LengthDist | str = "uniform:10:100"
    arrival: str = "poisson"
    burstiness: float = 1.0
    scales: tuple[int, ...] = (1, 10, 100, 1000)
    reference_scale: int = 1000
    seed: int = 42
    window: float = 5.0  # parameter-estimation window and comparison grid step

    def lengths(self) -> tuple[LengthDist, LengthDist]:
        p = LengthDist.parse(self.prefill) if isinstance(self.prefill, str) else self.prefill
        d = LengthDist.parse(self.decode) if isinstance(self.decode, str) else self.decode
        return p, d


def scaled_params(cfg: SimConfig, n: int) -> SystemParams:
    base = cfg.params()
    return SystemParams(
        M_total=base.M_total * n, B=base.B * n, d_0=base.d_0, d_1=base.d_1 / n, mode=base.mode,
        strategy=base.strategy, victim_policy=base.victim_policy,
        allow_waiting_preempt=base.allow_waiting_preempt, decode_cost=DecodeCost.ONE, seed=base.seed,
    )


@dataclass
class DiscreteTrace:
    """Counts of one discrete run by time window and decode position, and sampled states."""

    scale: int
    window: float
    L: int
    admitted: np.ndarray  # [W, L] WAITING -> RUNNING, by position
    swapped_in: np.ndarray  # [W, L]
    preempted: np.ndarray  # [W, L]
    completed: np.ndarray  # [W, L] completions from position i
    exposure: np.ndarray  # [W, L] request-batches spent at position i
    grid: np.ndarray  # [K] sample times
    X: np.ndarray  # [K, L] RUNNING by position, divided by the scale
    Z: np.ndarray  # [K, L]
    Q: np.ndarray  # [K]
    requests: int = 0
    batches: int = 0
    end_time: float = 0.0
    wall_seconds: float = 0.0


def simulate_scaled(cfg: SimConfig, spec: FluidLimitSpec, n: int, *, seed: int, t_max: float) -> DiscreteTrace:
    prefill, decode = spec.lengths()
    specs = generate(max(1, int(round(spec.rate * n * spec.horizon))), spec.rate * n, seed=seed,
                     arrival=spec.arrival, burstiness=spec.burstiness, prefill=prefill, decode=decode)
    specs = [s for s in specs if s.arrival_time <= spec.horizon] or specs[:1]
    L = max(s.decode_length for s in specs)
    W = int(np.ceil(t_max / spec.window)) + 1
    grid = np.arange(0.0, t_max + 1e-9, spec.window)
    K = len(grid)
    trace = DiscreteTrace(
        scale=n, window=spec.window, L=L,
        admitted=np.zeros((W, L)), swapped_in=np.zeros((W, L)), preempted=np.zeros((W, L)),
        completed=np.zeros((W, L)), exposure=np.zeros((W, L)),
        grid=grid, X=np.zeros((K, L)), Z=np.zeros((K, L)), Q=np.zeros(K), requests=len(specs),
    )
    system = DecodeSystem(scaled_params(cfg, n))
    requests = [SimRequest(str(i), s.arrival_time, s.prefill_length, s.decode_length) for i, s in enumerate(specs)]
    by_id = {r.request_id: r for r in requests}
    swap_pos: dict[str, int] = {}
    swapped_hist: Counter[int] = Counter()
    next_k = 0

    def sample_until(t: float) -> None:
        nonlocal next_k
        if next_k >= K or grid[next_k] > t:
            return
        running = system.running_positions()
        xs = np.zeros(L)
        for pos, c in running.items():
            xs[min(pos, L - 1)] = c
        zs = np.zeros(L)
        for pos, c in swapped_hist.items():
            zs[min(pos, L - 1)] = c
        while next_k < K and grid[next_k] <= t:
            trace.X[next_k] = xs / n
            trace.Z[next_k] = zs / n
            trace.Q[next_k] = system.waiting / n
            next_k += 1

    def on_step(res: StepResult) -> None:
        w = min(int(res.start_time // spec.window), W - 1)
        if res.admitted:
            trace.admitted[w, 0] += len(res.admitted)
        for rid in res.swapped_in:
            pos = swap_pos.pop(rid)
            swapped_hist[pos] -= 1
            trace.swapped_in[w, pos] += 1
        for p in res.preemptions:
            trace.preempted[w, p.decode_position] += 1
            trace.exposure[w, p.decode_position] += 1
            if p.mode is PreemptionMode.SWAP:
                swap_pos[p.request_id] = p.decode_position
                swapped_hist[p.decode_position] += 1
        if res.decoded:
            positions = np.fromiter((by_id[rid].decoded - 1 for rid in res.decoded), dtype=np.int64,
                                    count=len(res.decoded))
            np.add.at(trace.exposure[w], positions, 1)
        for rid in res.completed:
            trace.completed[w, by_id[rid].decode_length - 1] += 1
        sample_until(res.end_time)

    def on_arrival(req: SimRequest, t: float) -> None:
        return None

    started = time.perf_counter()
    sample_until(0.0)
    end = run_until_idle(system, requests, on_arrival=on_arrival, on_step=on_step)
    sample_until(t_max)  # the system is empty from `end` on
    trace.wall_seconds = time.perf_counter() - started
    trace.batches = system.batches
    trace.end_time = end
    return trace


@dataclass
class FluidParams:
    window: float
    lam: np.ndarray  # [W] arrival rate per unit of scale
    S_q: np.ndarray  # [W]
    p: np.ndarray  # [W, L]
    S_Z: np.ndarray  # [W, L]
    r: np.ndarray  # [W, L]
    q: np.ndarray  # [L]
    d_0: float
    d_1: float
    sacrifice: bool

    @property
    def L(self) -> int:
        return len(self.q)


def estimate_params(trace: DiscreteTrace, spec: FluidLimitSpec, cfg: SimConfig) -> FluidParams:
    n, win = trace.scale, trace.window
    W, L = trace.exposure.shape
    starts = np.arange(W) * win
    lam = np.where(starts < spec.horizon, spec.rate, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        S_q = trace.admitted.sum(axis=1) / (n * win)
        adm = trace.admitted.sum(axis=1, keepdims=True)
        p = np.where(adm > 0, trace.admitted / np.where(adm > 0, adm, 1), 0.0)
        p[adm[:, 0] == 0, 0] = 1.0
        S_Z = trace.swapped_in / (n * win)
        r = np.where(trace.exposure > 0, trace.preempted / np.where(trace.exposure > 0, trace.exposure, 1), 0.0)
        total_exp = trace.exposure.sum(axis=0)
        q = np.where(total_exp > 0, trace.completed.sum(axis=0) / np.where(total_exp > 0, total_exp, 1), 1.0)
    q[-1] = 1.0  # nobody decodes past the longest request
    return FluidParams(win, lam, S_q, p, S_Z, np.clip(r, 0, 1), np.clip(q, 0, 1),
                       cfg.system.d_0, cfg.system.d_1, cfg.control.preemption_mode is PreemptionMode.SACRIFICE)


def solve_fluid(fp: FluidParams, grid: np.ndarray) -> dict[str, np.ndarray]:
    """Integrate the ODE from an empty system; returns Q [K], X [K, L], Z [K, L] on `grid`."""
    L = fp.L
    W = len(fp.lam)

    def rhs(t: float, y: np.ndarray) -> np.ndarray:
        w = min(int(t // fp.window), W - 1)
        Q, X, Z = y[0], y[1 : L + 1], y[L + 1 :]
        X = np.maximum(X, 0.0)
        tau = fp.d_0 + fp.d_1 * X.sum()
        r, q = fp.r[w], fp.q
        lam = fp.lam[w]
        S_q = fp.S_q[w] if Q > 1e-12 else min(fp.S_q[w], lam)  # an empty queue admits what arrives
        S_Z = np.where(Z > 1e-12, fp.S_Z[w], 0.0)
        out_rate = X * r / tau
        dX = -X / tau + S_q * fp.p[w] + S_Z
        dX[1:] += X[:-1] * np.clip(1.0 - r[:-1] - q[:-1], 0.0, 1.0) / tau
        if fp.sacrifice:
            dQ = lam - S_q + out_rate.sum()
            dZ = np.zeros(L)
        else:
            dQ = lam - S_q
            dZ = out_rate - S_Z
        return np.concatenate(([dQ], dX, dZ))

    y0 = np.zeros(2 * L + 1)
    sol = solve_ivp(rhs, (float(grid[0]), float(grid[-1])), y0, t_eval=grid, method="RK45",
                    max_step=fp.window / 2, rtol=1e-5, atol=1e-7)
    if not sol.success:
        raise RuntimeError(f"the fluid ODE did not integrate: {sol.message}")
    y = np.maximum(sol.y.T, 0.0)
    return {"t": grid, "Q": y[:, 0], "X": y[:, 1 : L + 1], "Z": y[:, L + 1 :]}


def _pad(a: np.ndarray, L: int) -> np.ndarray:
    if a.shape[1] == L:
        return a
    if a.shape[1] > L:
        # positions beyond the ODE's range are lumped into its last one
        return np.concatenate([a[:, : L - 1], a[:, L - 1 :].sum(axis=1, keepdims=True)], axis=1)
    return np.pad(a, ((0, 0), (0, L - a.shape[1])))


def distance(trace: DiscreteTrace, sol: dict[str, np.ndarray]) -> dict[str, float]:
    """sup over the grid of the L1 distance over positions, and its time average."""
    L = sol["X"].shape[1]
    dx = np.abs(_pad(trace.X, L) - sol["X"]).sum(axis=1)
    dz = np.abs(_pad(trace.Z, L) - sol["Z"]).sum(axis=1)
    dq = np.abs(trace.Q - sol["Q"])
    mass = max(float(sol["X"].sum(axis=1).max()), 1e-12)
    dtotal = np.abs(trace.X.sum(axis=1) - sol["X"].sum(axis=1))
    return {
        "sup_distance_X_total": float(dtotal.max()),
        "sup_distance_X": float(dx.max()),
        "mean_distance_X": float(dx.mean()),
        "relative_sup_distance_X": float(dx.max() / mass),
        "sup_distance_Z": float(dz.max()),
        "sup_distance_Q": float(dq.max()),
    }


@dataclass
class FluidLimitResult:
    config: SimConfig
    spec: FluidLimitSpec
    params: FluidParams
    solution: dict[str, np.ndarray]
    reference: DiscreteTrace
    traces: list[DiscreteTrace]
    rows: list[dict[str, Any]] = field(default_factory=list)


def run_fluid_limit(
    cfg: SimConfig, spec: FluidLimitSpec, *, progress: Callable[[int], Any] | None = None
) -> FluidLimitResult:
    if spec.rate <= 0 or spec.horizon <= 0:
        raise ValueError("rate and horizon must be positive")
    # the time grid must cover the drain after arrivals stop: estimate it from the reference run
    first = simulate_scaled(cfg, spec, spec.reference_scale, seed=spec.seed + 10_007, t_max=spec.horizon * 4)
    t_max = float(np.ceil(max(first.end_time, spec.horizon) / spec.window) * spec.window) + spec.window
    reference = simulate_scaled(cfg, spec, spec.reference_scale, seed=spec.seed + 10_007, t_max=t_max) \
        if t_max > spec.horizon * 4 else _trim(first, t_max)
    if progress:
        progress(1)
    fp = estimate_params(reference, spec, cfg)
    solution = solve_fluid(fp, reference.grid)
    traces, rows = [], []
    for n in spec.scales:
        tr = simulate_scaled(cfg, spec, n, seed=spec.seed, t_max=t_max)
        traces.append(tr)
        rows.append({"scale": n, "requests": tr.requests, "batches": tr.batches, "end_time": tr.end_time,
                     "wall_seconds": tr.wall_seconds, **distance(tr, solution)})
        if progress:
            progress(1)
    return FluidLimitResult(cfg, spec, fp, solution, reference, traces, rows)


def _trim(trace: DiscreteTrace, t_max: float) -> DiscreteTrace:
    k = int(np.searchsorted(trace.grid, t_max + 1e-9))
    w = int(np.ceil(t_max / trace.window)) + 1
    return DiscreteTrace(
        scale=trace.scale, window=trace.window, L=trace.L,
        admitted=trace.admitted[:w], swapped_in=trace.swapped_in[:w], preempted=trace.preempted[:w],
        completed=trace.completed[:w], exposure=trace.exposure[:w],
        grid=trace.grid[:k], X=trace.X[:k], Z=trace.Z[:k], Q=trace.Q[:k],
        requests=trace.requests, batches=trace.batches, end_time=trace.end_time, wall_seconds=trace.wall_seconds,
    )


FLUID_COLUMNS = ("scale", "requests", "batches", "end_time", "sup_distance_X", "mean_distance_X", "sup_distance_X_total",
                 "relative_sup_distance_X", "sup_distance_Z", "sup_distance_Q", "wall_seconds")


def write_fluid_limit(result: FluidLimitResult, out: Path, *, command: str) -> str:
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    with (out / "fluid_limit.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FLUID_COLUMNS)
        for row in result.rows:
            w.writerow([f"{row[c]:.6g}" if isinstance(row[c], float) else row[c] for c in FLUID_COLUMNS])
    sol = result.solution
    with (out / "fluid_trajectories.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["time", "ode_Q", "ode_X_total", "ode_Z_total",
                    *[f"n{tr.scale}_{k}" for tr in result.traces for k in ("Q", "X_total", "Z_total")]])
        for k, t in enumerate(sol["t"]):
            vals = [t, sol["Q"][k], sol["X"][k].sum(), sol["Z"][k].sum()]
            for tr in result.traces:
                vals += [tr.Q[k], tr.X[k].sum(), tr.Z[k].sum()]
            w.writerow([f"{v:.6g}" for v in vals])
    fp = result.params
    with (out / "fluid_parameters.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["position", "q_completion_prob", "r_mean_preempt_prob", "p_mean_entry_share", "S_Z_mean_rate"])
        for i in range(fp.L):
            w.writerow([i, f"{fp.q[i]:.6g}", f"{fp.r[:, i].mean():.6g}", f"{fp.p[:, i].mean():.6g}",
                        f"{fp.S_Z[:, i].mean():.6g}"])

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    ax = axes[0, 0]
    ax.plot(sol["t"], sol["X"].sum(axis=1), color="black", lw=2, label="ODE  sum X_i")
    for tr in result.traces:
        ax.plot(tr.grid, tr.X.sum(axis=1), lw=1, alpha=0.8, label=f"n={tr.scale}  sum X_i^(n)/n")
    ax.set_title("RUNNING per unit of scale")
    ax.legend(fontsize=8)
    ax = axes[0, 1]
    ax.plot(sol["t"], sol["Q"], color="black", lw=2, label="ODE  Q")
    if not fp.sacrifice:
        ax.plot(sol["t"], sol["Z"].sum(axis=1), color="black", ls="--", lw=2, label="ODE  sum Z_i")
    for tr in result.traces:
        ax.plot(tr.grid, tr.Q, lw=1, alpha=0.8, label=f"n={tr.scale}  Q/n")
    ax.set_title("WAITING (and SWAPPED) per unit of scale")
    ax.legend(fontsize=8)
    ax = axes[1, 0]
    k = int(np.argmax(sol["X"].sum(axis=1)))
    ax.plot(np.arange(fp.L), sol["X"][k], color="black", lw=2, label="ODE")
    for tr in result.traces:
        ax.plot(np.arange(tr.X.shape[1]), tr.X[k], lw=1, alpha=0.7, label=f"n={tr.scale}")
    ax.set_title(f"X_i by decode position at t={sol['t'][k]:.0f}")
    ax.set_xlabel("decode position i")
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    scales = [r["scale"] for r in result.rows]
    ax.loglog(scales, [r["sup_distance_X"] for r in result.rows], "o-", label="sup_t ||X^(n)/n - X||_1")
    ax.loglog(scales, [r["mean_distance_X"] for r in result.rows], "s-", label="mean_t ||X^(n)/n - X||_1")
    ax.set_xlabel("scale n (lambda, M_total, B multiplied by n)")
    ax.set_title("Distance to the fluid solution")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fluid_limit.png", dpi=110)
    plt.close(fig)

    (out / "config_used.yaml").write_text(yaml.safe_dump(result.config.dump(), sort_keys=False))
    spec = result.spec
    p, d = spec.lengths()
    meta = {
        "command": command,
        "rate": spec.rate, "horizon": spec.horizon, "prefill": str(p), "decode": str(d),
        "arrival": spec.arrival, "scales": list(spec.scales), "reference_scale": spec.reference_scale,
        "reference_seed": spec.seed + 10_007, "seed": spec.seed, "window": spec.window,
        "scaling": "arrival rate, M_total and B multiplied by n; d_1 divided by n",
        "files": ["fluid_limit.csv", "fluid_trajectories.csv", "fluid_parameters.csv", "fluid_limit.png",
                  "config_used.yaml", "experiment_meta.yaml"],
    }
    (out / "experiment_meta.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    lines = [
        f"Fluid limit ({result.config.control.preemption_mode.value} mode): ODE parameters estimated from an "
        f"independent run at n={spec.reference_scale}",
        "",
        f"{'n':>6} {'requests':>9} {'sup|X^n/n - X|':>15} {'mean|X^n/n - X|':>16} {'relative':>9} "
        f"{'sup|sumX^n/n - sumX|':>21} {'sup|Q^n/n - Q|':>15}",
    ]
    for r in result.rows:
        lines.append(f"{r['scale']:>6} {r['requests']:>9} {r['sup_distance_X']:>15.4g} {r['mean_distance_X']:>16.4g} "
                     f"{r['relative_sup_distance_X']:>9.3%} {r['sup_distance_X_total']:>21.4g} {r['sup_distance_Q']:>15.4g}")
    dists = [r["sup_distance_X"] for r in result.rows]
    shrinking = all(b < a for a, b in zip(dists, dists[1:]))
    lines += ["", "distance shrinks with n: " + ("yes" if shrinking else "NO")]
    text = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(text)
    return text
