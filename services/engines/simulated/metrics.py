"""Engine statistics and their Prometheus text in each real engine's metric names.

The vLLM profile uses vLLM's v1 names and labels (`model_name`, `engine`),
counters exposed with the `_total` suffix as prometheus_client does; the
llama.cpp profile uses llama-server's `llamacpp:` names (no labels). Metrics
every profile adds under `modelpool_sim_` say what the simulator itself is doing
(memory per lifecycle state, scheduled versus actual batch time). Durations are
in simulated seconds (wall-clock seconds times the speed-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.prometheus import Histogram, family

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class EngineStats:
    """Everything the engine counts; the driver and server update it, renderers read it."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    steps: int = 0
    busy_slots_sum: int = 0
    scheduled_wall_s: float = 0.0
    """Sum of batch durations divided by the speed-up: the time the model asked for."""
    actual_wall_s: float = 0.0
    """Wall time from each batch's start to the next one's: what the server delivered."""
    schedule_resets: int = 0
    """Times the driver fell so far behind that it restarted its schedule from now."""
    prefill_sim_s: float = 0.0
    decode_sim_s: float = 0.0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))


@dataclass(frozen=True)
class EngineSnapshot:
    """Point-in-time gauges gathered by the server for one scrape."""

    model: str
    engine: str
    running: int
    waiting: int
    deferred: int
    kv_used_tokens: int
    kv_total_tokens: int
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    sleep_state: str
    gpu_bytes: int
    cpu_bytes: int
    lifecycle_state: str
    speedup: float
    cache_config: dict[str, str]
    """vLLM's cache configuration labels (`EngineConfig.cache_config_info`)."""


def render_vllm(stats: EngineStats, snap: EngineSnapshot) -> str:
    labels = f'engine="0",model_name="{snap.model}"'
    out: list[str] = []

    def gauge(name: str, help_text: str, value: float) -> None:
        family(out, name, "gauge", help_text)
        out.append(f"{name}{{{labels}}} {value}")

    def counter(name: str, help_text: str, value: float) -> None:
        family(out, name, "counter", help_text)
        out.append(f"{name}_total{{{labels}}} {value}")

    def histogram(name: str, help_text: str, h: Histogram) -> None:
        family(out, name, "histogram", help_text)
        out.extend(h.lines(name, labels))

    # vLLM's config "info" gauge: value 1, the configuration in the labels. Clients read
    # num_gpu_blocks x block_size as the KV cache's size in tokens.
    family(out, "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
    config_labels = ",".join(f'{k}="{v}"' for k, v in snap.cache_config.items())
    out.append(f'vllm:cache_config_info{{{config_labels},engine="0"}} 1.0')
    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", snap.running)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", snap.waiting + snap.deferred)
    kv = snap.kv_used_tokens / snap.kv_total_tokens if snap.kv_total_tokens else 0.0
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv)
    family(out, "vllm:engine_sleep_state", "gauge",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.")
    for state in ("awake", "weights_offloaded", "discard_all"):
        out.append(f'vllm:engine_sleep_state{{{labels},sleep_state="{state}"}} {int(snap.sleep_state == state)}')
    counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
            snap.prefix_cache_queries)
    counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            snap.prefix_cache_hits)
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", snap.preemptions)
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
    counter("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens)
    family(out, "vllm:request_success", "counter", "Count of successfully processed requests.")
    for reason, n in stats.requests_finished.items():
        out.append(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {n}')
    histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", stats.ttft)
    histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", stats.itl)
    histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", stats.e2e)
    histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
              stats.queue_time)
    _simulator_lines(out, stats, snap)
    return "\n".join(out) + "\n"


def render_llamacpp(stats: EngineStats, snap: EngineSnapshot) -> str:
    out: list[str] = []

    def metric(kind: str, name: str, help_text: str, value: float) -> None:
        full = f"llamacpp:{name}"
        family(out, full, kind, help_text)
        out.append(f"{full} {value}")

    prompt_s = stats.prefill_sim_s
    decode_s = stats.decode_sim_s
    metric("counter", "prompt_tokens_total", "Number of prompt tokens processed.", stats.prompt_tokens)
    metric("counter", "prompt_seconds_total", "Prompt process time", round(prompt_s, 6))
    metric("counter", "tokens_predicted_total", "Number of generation tokens processed.", stats.generation_tokens)
    metric("counter", "tokens_predicted_seconds_total", "Predict process time", round(decode_s, 6))
    metric("counter", "n_decode_total", "Total number of llama_decode() calls", stats.steps)
    metric("counter", "n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
           round(stats.busy_slots_sum / stats.steps, 6) if stats.steps else 0)
    metric("gauge", "prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
           round(stats.prompt_tokens / prompt_s, 3) if prompt_s else 0)
    metric("gauge", "predicted_tokens_seconds", "Average generation throughput in tokens/s.",
           round(stats.generation_tokens / decode_s, 3) if decode_s else 0)
    kv = snap.kv_used_tokens / snap.kv_total_tokens if snap.kv_total_tokens else 0.0
    metric("gauge", "kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.", kv)
    metric("gauge", "kv_cache_tokens", "KV-cache tokens.", snap.kv_used_tokens)
    metric("gauge", "requests_processing", "Number of requests processing.", snap.running + snap.waiting)
    metric("gauge", "requests_deferred", "Number of requests deferred.", snap.deferred)
    _simulator_lines(out, stats, snap)
    return "\n".join(out) + "\n"


def _simulator_lines(out: list[str], stats: EngineStats, snap: EngineSnapshot) -> None:
    def one(kind: str, name: str, help_text: str, value: float, labels: str = "") -> None:
        family(out, name, kind, help_text)
        out.append(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}")

    one("gauge", "modelpool_sim_info", "A simulated engine: no real inference happens here.", 1,
        f'engine="{snap.engine}",state="{snap.lifecycle_state}",speedup="{snap.speedup}"')
    one("gauge", "modelpool_sim_gpu_memory_bytes", "Simulated GPU memory held in the current lifecycle state.",
        snap.gpu_bytes)
    one("gauge", "modelpool_sim_cpu_memory_bytes", "Simulated CPU memory held in the current lifecycle state.",
        snap.cpu_bytes)
    one("counter", "modelpool_sim_batches_total", "Batches executed by the decode model.", stats.steps)
    one("counter", "modelpool_sim_scheduled_seconds_total",
        "Wall seconds the decode model scheduled (sum of batch durations / speed-up).",
        round(stats.scheduled_wall_s, 6))
    one("counter", "modelpool_sim_actual_seconds_total",
        "Wall seconds the batches actually took, token delivery included.", round(stats.actual_wall_s, 6))
