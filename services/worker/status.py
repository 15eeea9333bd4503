"""An engine's status from its own `/metrics`, in the unified fields of seed 000 §12.5.

Each backend's engines share metric names: vLLM and the simulator's vLLM profile
write `vllm:*`; modelpool's llama.cpp engine, llama-server and the simulator's
llama.cpp profile write `llamacpp:*`. One scrape gives the gauges (requests
running and waiting, KV use); counters and histograms only mean something as
differences, so `StatusTracker` keeps the earlier scrapes it needs: the previous
one for the decode rate and the activity check, those of the last
`WINDOW_S` for the latency percentiles.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime

from shared.contracts.backends import BackendType
from shared.prometheus import parse_samples

WINDOW_S = 30.0
"""Latency percentiles cover the requests finished in about this many seconds."""


@dataclass(frozen=True)
class MetricNames:
    """Where one backend's engines put the facts the status needs."""

    inflight: tuple[str, ...]
    """Gauges that add up to the requests running and waiting."""
    kv_usage: tuple[str, ...]
    """The KV cache's used share; the first name present counts (newer names first)."""
    generated_tokens: str
    activity: tuple[str, ...]
    """Counters that move whenever a request is served."""
    ttft: str | None
    e2e: str | None


METRIC_NAMES: dict[BackendType, MetricNames] = {
    BackendType.VLLM: MetricNames(
        inflight=("vllm:num_requests_running", "vllm:num_requests_waiting"),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        generated_tokens="vllm:generation_tokens_total",
        activity=("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total"),
        ttft="vllm:time_to_first_token_seconds",
        e2e="vllm:e2e_request_latency_seconds",
    ),
    BackendType.LLAMA_CPP: MetricNames(
        inflight=("llamacpp:requests_processing", "llamacpp:requests_deferred"),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
        generated_tokens="llamacpp:tokens_predicted_total",
        activity=("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total",
                  "llamacpp:requests_completed_total"),
        ttft="llamacpp:time_to_first_token_seconds",  # modelpool's engine; llama-server has none
        e2e=None,
    ),
}

Buckets = dict[float, float]
"""A cumulative histogram: upper bound (math.inf last) -> observations at or below it."""


@dataclass(frozen=True)
class Scrape:
    """What one `/metrics` answer says, summed over its series (one per model / engine label set)."""

    at: float
    """Monotonic time of the scrape."""
    inflight: int = 0
    kv_usage: float | None = None
    generated_tokens: float = 0.0
    activity: float = 0.0
    ttft: Buckets = field(default_factory=dict)
    e2e: Buckets = field(default_factory=dict)
    kv_cache_tokens: int | None = None
    """vLLM's `num_gpu_blocks x block_size` from `vllm:cache_config_info`."""


def parse_scrape(text: str, names: MetricNames, at: float) -> Scrape:
    totals: dict[str, float] = {}
    histograms: dict[str, Buckets] = {}
    kv_cache_tokens = None
    wanted = {names.ttft, names.e2e} - {None}
    for sample in parse_samples(text):
        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        if sample.name.endswith("_bucket") and sample.name[: -len("_bucket")] in wanted:
            buckets = histograms.setdefault(sample.name[: -len("_bucket")], {})
            bound = float(sample.labels.get("le", "+Inf"))
            buckets[bound] = buckets.get(bound, 0.0) + sample.value
        elif sample.name == "vllm:cache_config_info":
            try:
                kv_cache_tokens = int(sample.labels["num_gpu_blocks"]) * int(sample.labels["block_size"])
            except (KeyError, ValueError):  # "None" before vLLM has sized its cache
                pass
    kv_usage = next((totals[name] for name in names.kv_usage if name in totals), None)
    return Scrape(
        at=at,
        inflight=int(sum(totals.get(name, 0.0) for name in names.inflight)),
        kv_usage=kv_usage,
        generated_tokens=totals.get(names.generated_tokens, 0.0),
        activity=sum(totals.get(name, 0.0) for name in names.activity),
        ttft=histograms.get(names.ttft or "", {}),
        e2e=histograms.get(names.e2e or "", {}),
        kv_cache_tokens=kv_cache_tokens,
    )


def histogram_quantile(q: float, before: Buckets, after: Buckets) -> float | None:
    """The q-quantile of the observations made between two scrapes of a cumulative histogram,
    interpolated within its bucket as Prometheus's `histogram_quantile` does. None when there are none."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if any(c < 0 for c in counts):  # the engine started counting again
        counts = [after[b] for b in bounds]
    if not bounds or not math.isinf(bounds[-1]) or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bucket: its bound is all that is known
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return None


@dataclass(frozen=True)
class EngineStatus:
    inflight: int
    kv_usage: float | None
    decode_tokens_per_s: float | None
    ttft_p95_s: float | None
    e2e_p95_s: float | None
    last_active_at: datetime | None


class StatusTracker:
    """One engine process's scrapes over time: rates, recent percentiles, last activity.

    It starts from an all-zero scrape at the process's launch: the engine counts
    from zero, so everything it counted happened since then.
    """

    def __init__(self, launched_at: float, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._previous = Scrape(at=launched_at)
        self._window: deque[Scrape] = deque([self._previous])
        self.last_active_at: datetime | None = None

    def observe(self, scrape: Scrape, now: datetime) -> EngineStatus:
        previous = self._previous
        elapsed = scrape.at - previous.at
        generated = scrape.generated_tokens - previous.generated_tokens
        if generated < 0:  # the engine started counting again
            generated = scrape.generated_tokens
        if scrape.inflight > 0 or scrape.activity != previous.activity:
            self.last_active_at = now
        self._window.append(scrape)
        # Keep one scrape from before the window's start as the base of the differences.
        while len(self._window) > 1 and self._window[1].at <= scrape.at - self.window_s:
            self._window.popleft()
        base = self._window[0]
        self._previous = scrape
        return EngineStatus(
            inflight=scrape.inflight,
            kv_usage=scrape.kv_usage,
            decode_tokens_per_s=generated / elapsed if elapsed > 0 else None,
            ttft_p95_s=histogram_quantile(0.95, base.ttft, scrape.ttft),
            e2e_p95_s=histogram_quantile(0.95, base.e2e, scrape.e2e),
            last_active_at=self.last_active_at,
        )
