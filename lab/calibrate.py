"""`modelpool calibrate`: the hybrid policy's parameters from measured rates, then tuned in the lab (seed 000 §13.6-13.7).

1. Estimate from a run (the pool's event log, or a lab run's record):
   - tau_s_start: median STARTING -> RUNNING of vLLM instances;
   - tau_s_wake: median time from a wake command to RUNNING;
   - mu_f, mu_s: a saturated instance's answers per second: seed 002's batch
     time d_0 + d_1 c fitted to the tokens each window generated per
     instance-second at c requests per instance, taken at the tier's capacity,
     over the mean answer length;
   - m_f, m_s_act: GPU memory of an awake instance (the backends' gpu_memory_gb);
     m_s_slp: asleep (the engine's residual memory);
   - lambda: the mean arrival rate, and how bursty arrivals are per window.
2. The semi-analytic initial parameters (§13.7), with C = mu_f + mu_s (one of each):
   - lambda_up = C - sqrt(beta mu_s / (gamma m_s_act + kappa tau_s_start)), rho_up = lambda_up / C
     -> alpha (the load share of a vLLM instance at which to add capacity);
   - rho_down = rho_up - h -> beta;
   - lambda_prepare = tau_s_start C_f^2 / (1 + tau_s_start C_f), C_f = mu_f
     -> prepare_conc = ceil(lambda_prepare / mu_f);
   - down_hold_s = 3 tau_s_start (the seed's 2-4 times);
   - up_consecutive from the arrivals' burstiness (1 to 3).
   HeteroScale's target_decode_tps_per_instance is 0.7 x the saturated decode rate (seed 001's tuning guide).
3. Search around them in the lab on a given trace, one parameter at a time,
   keeping a change only when it lowers the objective of §13.4.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lab.config import LabSettings, tier_models
from lab.record import RunRecord
from lab.results import run
from shared.contracts.backends import BackendType
from shared.contracts.config import AliasConfig, ControllerConfig
from shared.contracts.policies import HybridPolicyConfig
from shared.contracts.states import InstanceState
from shared.contracts.trace import TraceRequest

FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM
H = 0.15
"""rho_down = rho_up - h; the seed suggests h in 0.1-0.2."""
KAPPA = 0.001
"""§13.7's cost of a second of start delay (`modelpool calibrate --kappa`)."""


@dataclass
class Estimates:
    mu_f: float | None
    mu_s: float | None
    tau_s_start: float | None
    tau_s_wake: float | None
    m_f: float | None
    m_s_act: float | None
    m_s_slp: float | None
    lam: float
    burstiness: float
    """Coefficient of variation of arrivals per window."""
    saturated_decode_tps: float | None
    notes: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        keys = ("mu_f", "mu_s", "tau_s_start", "tau_s_wake", "m_f", "m_s_act", "m_s_slp", "lam", "burstiness",
                "saturated_decode_tps")
        return {k: None if getattr(self, k) is None else round(getattr(self, k), 4) for k in keys}


def estimate(record: RunRecord) -> Estimates:
    alias = AliasConfig.model_validate(record.alias)
    tiers = tier_models(alias)
    notes: dict[str, str] = {}

    starts: list[float] = []
    wakes: list[float] = []
    started: dict[str, float] = {}
    commanded = sorted(record.wakes)
    for t in sorted(record.transitions, key=lambda t: t.t):
        if t.backend is not SLOW:
            continue
        if t.to_state is InstanceState.STARTING:
            started[t.instance_id] = t.t
        elif t.to_state is InstanceState.RUNNING and t.from_state is InstanceState.STARTING and t.instance_id in started:
            starts.append(t.t - started.pop(t.instance_id))
        elif t.to_state is InstanceState.RUNNING and t.from_state in (InstanceState.SLEEP_1, InstanceState.SLEEP_2):
            before = [w for w, i in commanded if i == t.instance_id and w <= t.t]
            if before:
                wakes.append(t.t - before[-1])
    tau_start = statistics.median(starts) if starts else None
    tau_wake = statistics.median(wakes) if wakes else None
    notes["tau_s_start"] = f"median of {len(starts)} vLLM start(s)" if starts else "no vLLM start seen"
    notes["tau_s_wake"] = f"median of {len(wakes)} wake(s)" if wakes else "no wake seen"

    mu: dict[BackendType, float | None] = {}
    saturated: dict[BackendType, float | None] = {}
    for backend, answered in ((FAST, "answered_fast"), (SLOW, "answered_slow")):
        key = f"mu_{backend.tier[0]}"
        if backend not in tiers:
            mu[backend] = saturated[backend] = None
            continue
        capacity = tiers[backend].capacity
        # (requests per instance, tokens generated, instance-seconds) of each window the tier ran in
        seen = [(w.inflight.get(backend.value, 0.0) / w.running[backend.value],
                 w.tokens.get(backend.value, 0.0), (w.end - w.start) * w.running[backend.value])
                for w in record.windows if w.running.get(backend.value, 0.0) > 0.05 and w.end > w.start]
        done = sum(getattr(w, answered) for w in record.windows)
        tokens = sum(t for _, t, _ in seen)
        fitted = _batch_time(seen, capacity)
        if fitted is None or not done or not tokens:
            mu[backend] = saturated[backend] = None
            notes[key] = "too few load levels seen to fit the batch time"
            continue
        (a, b), levels = fitted
        step = a + b * capacity
        saturated[backend] = capacity / step
        out = tokens / done
        mu[backend] = saturated[backend] / out
        notes[key] = (f"batch time {a * 1000:.3g} ms + {b * 1000:.3g} ms x c fitted over {levels} load levels; "
                      f"at its capacity {capacity}: {saturated[backend]:.4g} tokens/s / {out:.4g} tokens per answer")
    span = (record.windows[-1].end - record.windows[0].start) if record.windows else 0.0
    arrivals = [w.arrivals for w in record.windows]
    lam = sum(arrivals) / span if span else 0.0
    mean = statistics.fmean(arrivals) if arrivals else 0.0
    burstiness = statistics.pstdev(arrivals) / mean if mean else 0.0
    return Estimates(
        mu_f=mu.get(FAST), mu_s=mu.get(SLOW), tau_s_start=tau_start, tau_s_wake=tau_wake,
        m_f=tiers[FAST].memory_gb if FAST in tiers else None,
        m_s_act=tiers[SLOW].memory_gb if SLOW in tiers else None,
        m_s_slp=tiers[SLOW].sleep_memory_gb if SLOW in tiers else None,
        lam=lam, burstiness=burstiness, saturated_decode_tps=saturated.get(SLOW),
        notes=notes | {"m": "from the alias's configuration (gpu_memory_gb; the engine's residual memory asleep)"},
    )


def _batch_time(seen: list[tuple[float, float, float]], capacity: int) -> tuple[tuple[float, float], int] | None:
    """Seed 002's batch time d_0 + d_1 c, from windows of (requests per instance, tokens, instance-seconds).

    With c requests an instance makes c tokens per batch, so c / (tokens per
    instance-second) is the time of a batch. Windows are binned by c and a line
    through the bins gives the batch time at any load, capacity included. Tokens
    do not wait for completions, so the fit holds through ramps and backlogs
    (a completion-based estimate does not).
    """
    width = max(1.0, capacity / 10)
    bins: dict[int, list[float]] = {}
    for load, tokens, instance_s in seen:
        if load >= 0.5 and tokens > 0:
            b = bins.setdefault(int(load // width), [0.0, 0.0, 0.0])
            b[0] += load * instance_s
            b[1] += tokens
            b[2] += instance_s
    points = [(held / seconds, held / tokens) for held, tokens, seconds in bins.values() if seconds > 0]
    if len(points) < 2:
        return None
    xs, ys = [x for x, _ in points], [y for _, y in points]
    try:
        slope, intercept = statistics.linear_regression(xs, ys)
    except statistics.StatisticsError:  # every window at one load level
        return None
    if slope < 0:  # noise: a batch never gets faster with more requests in it
        slope, intercept = 0.0, statistics.fmean(ys)
    return (intercept, slope), len(points)


@dataclass
class Initial:
    params: dict[str, Any]
    """The hybrid policy's parameters (`autoscaling_policy` of a hybrid alias)."""
    derivation: list[str]
    heteroscale_target_tps: float | None = None


def initial_parameters(e: Estimates, beta: float, gamma: float, kappa: float, h: float = H) -> Initial:
    """§13.7 steps 1-6."""
    if not (e.mu_f and e.mu_s and e.tau_s_start is not None and e.m_s_act is not None):
        missing = [k for k in ("mu_f", "mu_s", "tau_s_start", "m_s_act") if not getattr(e, k)]
        raise ValueError(f"the run does not show {', '.join(missing)}: it needs both tiers serving and a vLLM start")
    lines: list[str] = []
    c = e.mu_f + e.mu_s
    lines.append(f"C = mu_f + mu_s = {e.mu_f:.4g} + {e.mu_s:.4g} = {c:.4g} req/s (one instance of each tier)")
    cost = gamma * e.m_s_act + kappa * e.tau_s_start
    root = math.sqrt(beta * e.mu_s / cost)
    lam_up = c - root
    rho_up = min(0.95, max(0.2, lam_up / c))
    lines.append(f"lambda_up = C - sqrt(beta mu_s / (gamma m_s_act + kappa tau_s_start)) = {c:.4g} - sqrt({beta:g} x "
                 f"{e.mu_s:.4g} / ({gamma:g} x {e.m_s_act:g} + {kappa:g} x {e.tau_s_start:.4g})) = {lam_up:.4g}")
    lines.append(f"rho_up = lambda_up / C = {lam_up / c:.3f}" + (f" -> clipped to {rho_up:.2f}" if rho_up != lam_up / c else "")
                 + " -> alpha")
    rho_down = max(0.05, rho_up - h)
    lines.append(f"rho_down = rho_up - h = {rho_up:.3f} - {h:g} = {rho_down:.3f} -> beta")
    c_f = e.mu_f
    lam_prepare = e.tau_s_start * c_f ** 2 / (1 + e.tau_s_start * c_f)
    prepare = max(1, math.ceil(lam_prepare / e.mu_f))
    lines.append(f"lambda_prepare = tau_s_start C_f^2 / (1 + tau_s_start C_f) = {e.tau_s_start:.4g} x {c_f:.4g}^2 / "
                 f"(1 + {e.tau_s_start:.4g} x {c_f:.4g}) = {lam_prepare:.4g} -> prepare_conc = "
                 f"ceil({lam_prepare:.4g} / mu_f) = {prepare}")
    hold = round(3 * e.tau_s_start, 1)
    lines.append(f"down_hold_s = 3 x tau_s_start = {hold:g} s")
    up = 1 if e.burstiness < 0.3 else 2 if e.burstiness < 0.7 else 3
    lines.append(f"up_consecutive = {up} (arrivals per window vary by {e.burstiness:.2f} of their mean)")
    target = round(0.7 * e.saturated_decode_tps, 1) if e.saturated_decode_tps else None
    if target:
        lines.append(f"heteroscale target_decode_tps_per_instance = 0.7 x {e.saturated_decode_tps:.4g} = {target:g}")
    params = {"alpha": round(rho_up, 2), "beta": round(min(rho_down, rho_up), 2), "prepare_conc": prepare,
              "down_hold_s": hold, "up_consecutive": up}
    return Initial(params, lines, target)


SEARCH_STEPS: dict[str, Callable[[Any], list[Any]]] = {
    "alpha": lambda v: [round(v - 0.1, 2), round(v + 0.1, 2)],
    "prepare_conc": lambda v: [v - 1, v + 1],
    "down_hold_s": lambda v: [round(v / 2, 1), round(v * 2, 1)],
    "up_consecutive": lambda v: [v - 1, v + 1],
}


def search(alias: AliasConfig, controller: ControllerConfig, lab: LabSettings, trace: list[TraceRequest],
           start: dict[str, Any], rounds: int = 2,
           on_run: Callable[[dict[str, Any], dict[str, Any]], None] | None = None) -> tuple[dict[str, Any], list[dict]]:
    """Coordinate search over the hybrid's parameters (from the alias's own, if it is hybrid): each parameter in
    turn, its neighbours tried, the best objective kept."""
    own = alias.autoscaling_policy
    base = own.model_dump() if isinstance(own, HybridPolicyConfig) else HybridPolicyConfig().model_dump()
    tried: dict[tuple, dict[str, Any]] = {}
    history: list[dict] = []

    def score(params: dict[str, Any]) -> float:
        key = tuple(sorted(params.items()))
        if key not in tried:
            try:
                hybrid = alias.model_copy(update={"autoscaling_policy": HybridPolicyConfig.model_validate(
                    {**base, **params})})
            except ValueError:
                tried[key] = {"objective": math.inf}
                return math.inf
            summary = run(hybrid, controller, lab, trace).summary
            tried[key] = summary
            history.append({"params": dict(params), **{k: summary[k] for k in (
                "objective", "slo_attainment", "gpu_mem_s", "scale_actions", "lost")}})
            if on_run:
                on_run(params, summary)
        return tried[key]["objective"]

    best = dict(start)
    best_score = score(best)
    for _ in range(rounds):
        improved = False
        for name, neighbours in SEARCH_STEPS.items():
            for value in neighbours(best[name]):
                candidate = {**best, name: value}
                if name == "alpha":
                    candidate["beta"] = round(max(0.05, value - H), 2)
                s = score(candidate)
                if s < best_score - 1e-9:
                    best, best_score, improved = candidate, s, True
        if not improved:
            break
    return best, history


@dataclass
class Calibration:
    params: dict[str, Any]
    """The hybrid's parameters the search settled on."""
    heteroscale_target_tps: float | None
    derivation: list[str]
    lab_runs: int


def calibrate_on(alias: AliasConfig, controller: ControllerConfig, lab: LabSettings, trace: list[TraceRequest],
                 rounds: int = 8, kappa: float = KAPPA) -> Calibration:
    """The whole pipeline on one trace: the trace run under the hybrid's defaults and recorded, the estimates,
    §13.7's initial values, then the search on the same trace."""
    recorded = run(alias.model_copy(update={"autoscaling_policy": HybridPolicyConfig()}), controller, lab, trace)
    init = initial_parameters(estimate(recorded.record), lab.objective.beta, lab.objective.gamma, kappa)
    best, history = search(alias, controller, lab, trace, init.params, rounds)
    return Calibration(best, init.heteroscale_target_tps, init.derivation, 1 + len(history))


def fragment(params: dict[str, Any], target_tps: float | None, derivation: list[str], source: str) -> str:
    """The alias's `autoscaling_policy` line for its pool-file entry, with how each value was found."""
    lines = [f"# modelpool calibrate: from {source}; seed 000 §13.7's initial values, searched in the lab.", "#"]
    lines += [f"#   {line}" for line in derivation]
    lines += ["autoscaling_policy: {name: hybrid, " + ", ".join(f"{k}: {v}" for k, v in params.items()) + "}"]
    if target_tps:
        lines += ["# for an alias under HeteroScale:", f"#   autoscaling_policy: {{name: heteroscale, "
                  f"target_decode_tps_per_instance: {target_tps:g}}}"]
    return "\n".join(lines) + "\n"
