"""The lab's workloads, seeded: cold wave, sustained, diurnal, bursty, agentic, or a trace file.

Every workload is a list of requests in the agentic trace format of
`shared/contracts/trace.py` (a request of an open-loop workload is its own
session's turn 0, `delay_s` its arrival), so a file written by `modelpool
trace generate` and a generated workload run the same way. Parameters are
set like the policies', `--set workload.peak_rate=12`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from shared.contracts.config import ConfigError
from shared.contracts.mooncake import MooncakeRequest, conversations, is_mooncake, read_mooncake
from shared.contracts.trace import TraceRequest, read_trace
from simulation.mooncake import SHAPES as MOONCAKE_SHAPES
from simulation.mooncake import generate_mooncake, mooncake_to_agentic
from simulation.mooncake_rate import CONVERSATION_RATE, RateCurve
from simulation.agentic import AgenticShape, BurstyShape, generate_agentic, generate_bursty


@dataclass(frozen=True)
class Lengths:
    input_tokens: float = 512.0
    """Median prompt length (lognormal)."""
    output_tokens: float = 256.0
    """Median answer length (lognormal)."""
    input_sigma: float = 0.6
    output_sigma: float = 0.5


@dataclass(frozen=True)
class ColdWave(Lengths):
    """Idle, then a wave, then idle again, `waves` times: the first wave after an idle meets a cold pool."""

    idle_s: float = 600.0
    wave_s: float = 30.0
    wave_requests: int = 120
    waves: int = 2


@dataclass(frozen=True)
class Sustained(Lengths):
    """A steady Poisson rate for `duration_s`."""

    rate: float = 4.0
    duration_s: float = 1800.0


@dataclass(frozen=True)
class Diurnal(Lengths):
    """A day's Poisson traffic: trough at `trough_at_s` (4 am), peak 12 h later, a raised cosine in between
    to the power `peakiness` (1: a plain cosine, mean half the peak; 3: busy hours, quiet nights, mean 0.31
    of the peak). `bursts` windows of `burst_s` at seeded random times each add `burst_peak_share` x the
    peak rate to the rate wherever they land, a quiet hour as a busy one (none by default). `compress` shrinks
    the day (24 h in 24 h / compress) at the same rates: the same shape in fewer requests, for quick runs (a
    policy's delays and cooldowns do not shrink with it)."""

    peak_rate: float = 8.0
    trough_rate: float = 0.4
    duration_s: float = 86_400.0
    trough_at_s: float = 4 * 3600.0
    peakiness: float = 1.0
    compress: float = 1.0
    bursts: int = 0
    burst_s: float = 900.0
    burst_peak_share: float = 0.5


@dataclass(frozen=True)
class MooncakeDay(Lengths):
    """A day's Poisson traffic at the Mooncake conversation trace's arrival rate: its hour's rate curve
    (`simulation/mooncake_rate.py`, read off the released file) stretched over `duration_s` / `compress` and scaled
    so that its highest point is `peak_rate`; the requests' lengths are this workload's, not the trace's."""

    peak_rate: float = 12.0
    duration_s: float = 86_400.0
    compress: float = 1.0


@dataclass(frozen=True)
class Bursty(BurstyShape):
    pass


@dataclass(frozen=True)
class Agentic(AgenticShape):
    pass


SHAPES: dict[str, type] = {"cold-wave": ColdWave, "sustained": Sustained, "diurnal": Diurnal, "bursty": Bursty,
                           "agentic": Agentic, "mooncake-day": MooncakeDay}


def shape_named(name: str, overrides: dict[str, Any] | None = None) -> Any:
    """The named workload's parameters with `overrides` (strings are converted to the field's type)."""
    if name not in SHAPES:
        raise ConfigError("workload", f"unknown workload {name!r}; known: {', '.join(SHAPES)} (or a trace file)")
    cls = SHAPES[name]
    shape = cls()
    known = {f.name: f for f in fields(cls)}
    changes: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if key not in known:
            raise ConfigError(f"workload.{key}", f"not a parameter of {name}; known: {', '.join(known)}")
        default = getattr(shape, key)
        try:
            changes[key] = type(default)(value) if not isinstance(default, bool) else str(value).lower() in ("1", "true", "yes")
        except ValueError:
            raise ConfigError(f"workload.{key}", f"{value!r} is not a {type(default).__name__}") from None
    return replace(shape, **changes)


def generate(name: str, seed: int, overrides: dict[str, Any] | None = None) -> list[TraceRequest]:
    shape = shape_named(name, overrides)
    rng = np.random.default_rng(seed)
    if isinstance(shape, Bursty):
        return generate_bursty(shape, seed)
    if isinstance(shape, Agentic):
        return generate_agentic(shape, seed)
    if isinstance(shape, MooncakeDay):
        return _curve_day(shape, CONVERSATION_RATE, seed)
    if isinstance(shape, ColdWave):
        starts = [shape.idle_s + k * (shape.idle_s + shape.wave_s) for k in range(shape.waves)]
        arrivals = np.sort(np.concatenate([s + rng.uniform(0.0, shape.wave_s, shape.wave_requests) for s in starts]))
    elif isinstance(shape, Sustained):
        arrivals = _poisson(rng, lambda t: np.full_like(t, shape.rate), shape.duration_s, shape.rate)
    else:
        span_s = shape.duration_s / shape.compress
        # Drawn only when asked for, so a day without bursts is the same day it always was for its seed.
        bursts = np.sort(rng.uniform(0.0, span_s, shape.bursts)) if shape.bursts else np.empty(0)
        envelope = shape.peak_rate * (1 + (shape.burst_peak_share if shape.bursts else 0.0))
        arrivals = _poisson(rng, lambda t: diurnal_rate(shape, t, bursts), span_s, envelope)
    return _requests(arrivals, rng, shape)


def diurnal_rate(shape: Diurnal, t: np.ndarray, bursts: np.ndarray = np.empty(0)) -> np.ndarray:
    """Requests per second at `t` (seconds of the compressed day), `bursts` the sorted starts of its bursts."""
    day = 86_400.0 / shape.compress
    phase = 2 * math.pi * (t - shape.trough_at_s / shape.compress) / day
    rise = ((1 - np.cos(phase)) / 2) ** shape.peakiness
    rate = shape.trough_rate + (shape.peak_rate - shape.trough_rate) * rise
    if not len(bursts):
        return rate
    latest = np.searchsorted(bursts, t, side="right") - 1  # the last burst started at or before t
    inside = (latest >= 0) & (t < bursts[np.maximum(latest, 0)] + shape.burst_s / shape.compress)
    return np.where(inside, rate + shape.burst_peak_share * shape.peak_rate, rate)


def curve_day(curve: RateCurve, seed: int, overrides: dict[str, Any] | None = None) -> list[TraceRequest]:
    """The `mooncake-day` workload at another hour's rate curve (`rate_from_timestamps` of a trace file)."""
    return _curve_day(shape_named("mooncake-day", overrides), curve, seed)


def curve_rate(curve: RateCurve, shape: MooncakeDay, t: np.ndarray) -> np.ndarray:
    """Requests per second at `t` (seconds of the compressed day): the curve at the same fraction of its span,
    linear between its points, flat beyond its first and last."""
    minutes, rates = np.array(curve.points).T
    at = t / (shape.duration_s / shape.compress) * curve.span_min
    return shape.peak_rate * np.interp(at, minutes, rates) / rates.max()


def _curve_day(shape: MooncakeDay, curve: RateCurve, seed: int) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    arrivals = _poisson(rng, lambda t: curve_rate(curve, shape, t), shape.duration_s / shape.compress,
                        shape.peak_rate)
    return _requests(arrivals, rng, shape)


def _poisson(rng: np.random.Generator, rate: Any, duration_s: float, peak: float) -> np.ndarray:
    """A non-homogeneous Poisson process by thinning, vectorised."""
    n = rng.poisson(peak * duration_s)
    t = np.sort(rng.uniform(0.0, duration_s, n))
    keep = rng.uniform(0.0, peak, n) < rate(t)
    return t[keep]


def _requests(arrivals: np.ndarray, rng: np.random.Generator, lengths: Lengths) -> list[TraceRequest]:
    n = len(arrivals)
    inputs = np.maximum(1, np.rint(rng.lognormal(np.log(lengths.input_tokens), lengths.input_sigma, n))).astype(int)
    outputs = np.maximum(1, np.rint(rng.lognormal(np.log(lengths.output_tokens), lengths.output_sigma, n))).astype(int)
    build = TraceRequest.model_construct  # checked by construction: skip validation on a million requests
    return [build(session_id=f"r{i}", turn=0, delay_s=float(a), new_input_tokens=int(p), output_tokens=int(o),
                  shared_prefix_id=None)
            for i, (a, p, o) in enumerate(zip(np.round(arrivals, 3), inputs, outputs))]


def load(spec: str, seed: int, overrides: dict[str, Any] | None = None) -> tuple[str, list[TraceRequest]]:
    """A workload by name, or a trace file by path (agentic or Mooncake format): its name and requests.

    A Mooncake trace, read or generated (`mooncake-conversation`, `mooncake-toolagent`), becomes agentic sessions
    by its inferred conversations (`simulation/mooncake.py`): a turn's delay is the time since its predecessor's
    arrival, which the lab counts from the predecessor's answer, so a turn comes later by that answer's time
    (seconds, against conversations' gaps of minutes)."""
    path = Path(spec)
    if spec in MOONCAKE_SHAPES:
        if overrides:
            raise ConfigError("workload", f"{spec} takes no workload.* settings (its statistics are the release's)")
        return spec, _agentic(generate_mooncake(MOONCAKE_SHAPES[spec], seed))
    if spec not in SHAPES and (path.suffix in (".jsonl", ".json") or path.exists()):
        if overrides:
            raise ConfigError("workload", "a trace file takes no workload.* settings")
        if is_mooncake(path):
            return path.stem, _agentic(read_mooncake(path))
        return path.stem, read_trace(path)
    return spec, generate(spec, seed, overrides)


def _agentic(requests: list[MooncakeRequest]) -> list[TraceRequest]:
    return mooncake_to_agentic(requests, conversations(requests))
