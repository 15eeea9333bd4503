"""Telemetry: the high-rate facts that travel on the bus and never enter the log.

Heartbeats with every instance's status, the gateways' metric windows, cold-start
demand and the controller's outlook change every second under load; recording
them would make the log (and every rebuild) grow with load alone. They travel on
the bus with a bounded lifetime instead (docs/bus.md) and are versioned
contracts like everything else, wrapped in the same envelope.

Percentiles must merge across gateway replicas, so windows carry histograms,
not percentiles: `LogHistogram` buckets are fixed powers of 2^(1/8) (a bucket is
9 % wide, a quantile is off by at most 4.5 %), and merging is adding counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.control import MetricWindow, NextStep
from shared.contracts.messages import Contract, Registry
from shared.contracts.states import InstanceState, RoutingState

# --------------------------------------------------------------------------- histograms

_GROWTH = 2 ** (1 / 8)
_LOG_GROWTH = math.log(_GROWTH)
_SMALLEST = 1e-4
"""Values at or below this (seconds, tokens) share bucket 0."""


def bucket_of(value: float) -> int:
    if value <= _SMALLEST:
        return 0
    return max(1, math.ceil(math.log(value / _SMALLEST) / _LOG_GROWTH))


def bucket_middle(index: int) -> float:
    """The geometric middle of a bucket: (lower * upper) ** 0.5."""
    if index == 0:
        return _SMALLEST
    return _SMALLEST * _GROWTH ** (index - 0.5)


class LogHistogram(BaseModel):
    """A mergeable histogram with log-spaced buckets: bucket index -> count."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    counts: dict[int, int] = Field(default_factory=dict)
    total: float = 0.0
    maximum: float = 0.0

    @property
    def n(self) -> int:
        return sum(self.counts.values())

    @classmethod
    def merge(cls, histograms: Iterable["LogHistogram"]) -> "LogHistogram":
        counts: dict[int, int] = {}
        total, maximum = 0.0, 0.0
        for h in histograms:
            for index, count in h.counts.items():
                counts[index] = counts.get(index, 0) + count
            total += h.total
            maximum = max(maximum, h.maximum)
        return cls(counts=counts, total=total, maximum=maximum)

    def quantile(self, q: float) -> float | None:
        return quantile_of(self.counts, self.maximum, q)


def quantile_of(counts: dict[int, int], maximum: float, q: float) -> float | None:
    """The q-quantile of a histogram's bucket counts: the middle of the bucket holding that rank."""
    n = sum(counts.values())
    if n == 0:
        return None
    rank = max(1, math.ceil(q * n))
    seen = 0
    for index in sorted(counts):
        seen += counts[index]
        if seen >= rank:
            return min(bucket_middle(index), maximum)
    return maximum


class HistogramRecorder:
    """The mutable side of `LogHistogram`: record values, then `snapshot()` the window."""

    __slots__ = ("counts", "total", "maximum")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = 0.0
        self.maximum = 0.0

    def record(self, value: float, times: int = 1) -> None:
        index = bucket_of(value)
        self.counts[index] = self.counts.get(index, 0) + times
        self.total += value * times
        if value > self.maximum:
            self.maximum = value

    def snapshot(self) -> LogHistogram:
        return LogHistogram(counts=dict(self.counts), total=self.total, maximum=self.maximum)


# --------------------------------------------------------------------------- messages


class TelemetryMessage(Contract):
    """Base of every telemetry payload."""


class InstanceStatus(BaseModel):
    """One instance as its worker last saw it, in the unified fields of seed 000 §12.5."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instance_id: str
    alias: str
    backend_type: BackendType
    engine: EngineKind
    status: InstanceState
    inflight_requests: int = Field(default=0, ge=0)
    capacity: int | None = Field(default=None, ge=0)
    """Concurrent requests the engine takes: llama.cpp its sequence slots; vLLM its KV cache at max_model_len."""
    sleep_level: int = Field(default=0, ge=0, le=2)
    kv_usage: float | None = Field(default=None, ge=0)
    decode_tokens_per_s: float | None = Field(default=None, ge=0)
    ttft_p95_s: float | None = Field(default=None, ge=0)
    e2e_p95_s: float | None = Field(default=None, ge=0)
    last_active_at: datetime | None = None
    """The last time the engine had work (a request running or waiting, or finished since the last look)."""
    healthy: bool = True
    """The engine process is alive and its API answered at the last look."""
    error: str | None = None


class WorkerHeartbeat(TelemetryMessage):
    """A worker is alive, and this is what its instances look like. Sent every `interval_s`."""

    TYPE = "WorkerHeartbeat"
    worker_id: str
    at: datetime
    interval_s: float = Field(gt=0)
    instances: list[InstanceStatus] = Field(default_factory=list)


class GatewayWindow(TelemetryMessage):
    """One gateway replica's measurements of one alias over one window (seed 000 §6).

    Windows are aligned to multiples of their length in wall-clock time, so the
    windows of every replica for the same period share `window_start` and merge.
    """

    TYPE = "GatewayWindow"
    gateway_id: str
    alias: str
    window_start: datetime
    window_end: datetime
    arrivals: int = Field(default=0, ge=0)
    requests_fast: int = Field(default=0, ge=0)
    requests_slow: int = Field(default=0, ge=0)
    errors_fast: int = Field(default=0, ge=0)
    errors_slow: int = Field(default=0, ge=0)
    errors_gateway: int = Field(default=0, ge=0)
    """Answered with an error before reaching any instance (no instance, hold expired, ...)."""
    timeouts_slow: int = Field(default=0, ge=0)
    inflight_fast: float = Field(default=0.0, ge=0)
    """Time-averaged over the window."""
    inflight_slow: float = Field(default=0.0, ge=0)
    inflight_peak: float = Field(default=0.0, ge=0)
    queue_len: float = Field(default=0.0, ge=0)
    """Requests waiting in this gateway, time-averaged over the window."""
    held: int = Field(default=0, ge=0)
    """Requests waiting in this gateway at the window's end."""
    prefill_tokens: int = Field(default=0, ge=0)
    decode_tokens: int = Field(default=0, ge=0)
    queue_wait_s: LogHistogram = Field(default_factory=LogHistogram)
    ttft_s: LogHistogram = Field(default_factory=LogHistogram)
    e2e_fast_s: LogHistogram = Field(default_factory=LogHistogram)
    e2e_slow_s: LogHistogram = Field(default_factory=LogHistogram)
    tbt_s: LogHistogram = Field(default_factory=LogHistogram)


class DemandSignal(TelemetryMessage):
    """A gateway holds requests for an alias that has no instance to serve them: start one now."""

    TYPE = "DemandSignal"
    gateway_id: str
    alias: str
    held: int = Field(ge=0)
    at: datetime


class ControlOutlook(TelemetryMessage):
    """What the controller's leader last decided for an alias and what it will do next."""

    TYPE = "ControlOutlook"
    alias: str
    at: datetime
    leader: str
    policy: str
    routing_state: RoutingState
    targets: dict[BackendType, int] = Field(default_factory=dict)
    next: list[NextStep] = Field(default_factory=list)
    metrics: MetricWindow | None = None


class KeyUsageSecond(BaseModel):
    """What one API key used through one gateway in one wall-clock second."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    second: int
    """Unix time, whole seconds."""
    requests: int = Field(default=0, ge=0)
    tokens: int = Field(default=0, ge=0)
    sessions: int = Field(default=0, ge=0)
    """New sessions bound."""


class KeyUsage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    in_flight: int = Field(default=0, ge=0)
    seconds: list[KeyUsageSecond] = Field(default_factory=list)
    """The last minute's, oldest first; seconds with nothing used are left out."""


class UsageReport(TelemetryMessage):
    """A gateway's use of each limited API key over the last minute, sent every second so that every replica
    counts every replica's use against the keys' limits (`services/gateway/quotas.py`). Keys are named by their
    ids, never themselves."""

    TYPE = "UsageReport"
    gateway_id: str
    at: datetime
    keys: dict[str, KeyUsage] = Field(default_factory=dict)


TELEMETRY: tuple[type[TelemetryMessage], ...] = (WorkerHeartbeat, GatewayWindow, DemandSignal, ControlOutlook,
                                                 UsageReport)


def telemetry_registry() -> Registry:
    return Registry(TELEMETRY)


# --------------------------------------------------------------------------- merging


_SUMMED = ("arrivals", "requests_fast", "requests_slow", "errors_fast", "errors_slow", "errors_gateway", "timeouts_slow",
           "inflight_fast", "inflight_slow", "inflight_peak", "queue_len", "held", "prefill_tokens", "decode_tokens")


def _p95(windows: Sequence[GatewayWindow], *names: str) -> float | None:
    """The 95th percentile of the named histograms of every window, added up."""
    counts: dict[int, int] | None = None
    maximum = 0.0
    merged = False
    for w in windows:
        for name in names:
            h: LogHistogram = getattr(w, name)
            if not h.counts:
                continue
            if counts is None:
                counts = h.counts  # one histogram alone needs no copy
            else:
                if not merged:
                    counts, merged = dict(counts), True
                for index, count in h.counts.items():
                    counts[index] = counts.get(index, 0) + count
            if h.maximum > maximum:
                maximum = h.maximum
    return None if counts is None else quantile_of(counts, maximum, 0.95)


def merge_windows(windows: Sequence[GatewayWindow]) -> MetricWindow:
    """One alias's windows from several gateway replicas (same period) as one `MetricWindow`.

    Counts and time-averaged gauges add up; percentiles come from the added-up
    histograms.
    """
    assert windows, "nothing to merge"
    first = windows[0]
    seconds = max(1e-9, (first.window_end - first.window_start).total_seconds())
    t = dict.fromkeys(_SUMMED, 0)
    for w in windows:
        for name in _SUMMED:
            t[name] += getattr(w, name)
    decode, prefill = t["decode_tokens"], t["prefill_tokens"]
    return MetricWindow(
        window_start=first.window_start,
        window_end=first.window_end,
        gateways=len(windows),
        arrivals=int(t["arrivals"]),
        requests=int(t["requests_fast"] + t["requests_slow"]),
        requests_fast=int(t["requests_fast"]),
        requests_slow=int(t["requests_slow"]),
        errors=int(t["errors_fast"] + t["errors_slow"] + t["errors_gateway"]),
        errors_slow=int(t["errors_slow"]),
        timeouts_slow=int(t["timeouts_slow"]),
        inflight_fast=float(t["inflight_fast"]),
        inflight_slow=float(t["inflight_slow"]),
        inflight_peak=float(t["inflight_peak"]),
        queue_len=float(t["queue_len"]),
        held=int(t["held"]),
        queue_wait_p95_s=_p95(windows, "queue_wait_s"),
        ttft_p95_s=_p95(windows, "ttft_s"),
        e2e_p95_fast_s=_p95(windows, "e2e_fast_s"),
        e2e_p95_slow_s=_p95(windows, "e2e_slow_s"),
        e2e_p95_s=_p95(windows, "e2e_fast_s", "e2e_slow_s"),
        tbt_p95_s=_p95(windows, "tbt_s"),
        decode_tokens_per_s=decode / seconds if decode else None,
        prefill_tokens_per_s=prefill / seconds if prefill else None,
    )
