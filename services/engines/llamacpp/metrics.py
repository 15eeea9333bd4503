"""Engine metrics and their Prometheus text rendering.

Names follow llama.cpp's own server (`llamacpp:` prefix) where it has the
metric, so dashboards written for it keep working.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shared.prometheus import Histogram, family

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)


@dataclass
class EngineMetrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_tokens: int = 0
    prefix_copies: int = 0
    kv_exports: int = 0
    kv_imports: int = 0
    prompt_cache_restores: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    rejected_429: int = 0
    timeouts_408: int = 0
    failures_500: int = 0
    cancelled: int = 0
    completed: int = 0
    stream_chunks_direct: int = 0
    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    itl_s: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))


def render_prometheus(
    m: EngineMetrics, *, running: int, waiting: int, kv_usage_ratio: float, kv_tokens: int, labels: dict[str, str],
    prompt_cache_bytes: int = 0,
) -> str:
    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float) -> None:
        family(lines, name, kind, help_)
        lines.append(f"{name}{{{lab}}} {value:g}")

    def histogram(name: str, help_: str, h: Histogram) -> None:
        family(lines, name, "histogram", help_)
        lines.extend(h.lines(name, lab))

    gauge: Callable[[str, str, float], None] = lambda n, h, v: metric(n, "gauge", h, v)  # noqa: E731
    counter: Callable[[str, str, float], None] = lambda n, h, v: metric(n, "counter", h, v)  # noqa: E731
    gauge("llamacpp:requests_processing", "Requests holding a sequence id and decoding.", running)
    gauge("llamacpp:requests_deferred", "Requests waiting: queued or pending a sequence id.", waiting)
    gauge("llamacpp:kv_cache_usage_ratio", "KV cache entries over the manager's capacity.", kv_usage_ratio)
    gauge("llamacpp:kv_cache_tokens", "Tokens held in the KV cache (running and parked).", kv_tokens)
    counter("llamacpp:prompt_tokens_total", "Prompt tokens received.", m.prompt_tokens)
    counter("llamacpp:tokens_predicted_total", "Tokens generated.", m.generated_tokens)
    counter("llamacpp:prompt_tokens_reused_total", "Prompt tokens served from a cached prefix.", m.reused_tokens)
    counter("llamacpp:prefix_copies_total", "Cached prefixes copied from another sequence.", m.prefix_copies)
    counter("llamacpp:kv_exports_total", "Sequences exported to another engine (session moves).", m.kv_exports)
    counter("llamacpp:kv_imports_total", "Sequences imported from another engine (session moves).", m.kv_imports)
    gauge("llamacpp:prompt_cache_bytes", "Host memory held by sequences evicted from the KV (the prompt cache).",
          prompt_cache_bytes)
    counter("llamacpp:prompt_cache_restores_total", "Prompts answered from a sequence restored from host memory.",
            m.prompt_cache_restores)
    counter("llamacpp:decode_steps_total", "llama_decode calls.", m.decode_steps)
    counter("llamacpp:decode_seconds_total", "Time spent in llama_decode.", m.decode_seconds)
    counter("llamacpp:requests_completed_total", "Requests completed.", m.completed)
    counter("llamacpp:requests_rejected_total", "Requests refused with 429 (queue full).", m.rejected_429)
    counter("llamacpp:requests_timeout_total", "Requests answered 408 (timeout).", m.timeouts_408)
    counter("llamacpp:requests_failed_total", "Requests answered 500 (engine failure).", m.failures_500)
    counter("llamacpp:stream_chunks_direct_total",
            "Streamed token chunks the decode thread wrote to the client's socket itself (the rest went through the "
            "event loop).", m.stream_chunks_direct)
    counter("llamacpp:requests_cancelled_total", "Requests cancelled by a client disconnect.", m.cancelled)
    histogram("llamacpp:time_to_first_token_seconds", "Time to first token.", m.ttft_s)
    histogram("llamacpp:inter_token_latency_seconds", "Time between consecutive tokens.", m.itl_s)
    return "\n".join(lines) + "\n"
