"""Reading engine status from Prometheus text: parsing, percentiles from histogram differences, rates, activity."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest

from services.worker.status import METRIC_NAMES, Scrape, StatusTracker, histogram_quantile, parse_scrape
from shared.contracts.backends import BackendType
from shared.prometheus import Histogram, parse_samples

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_samples_are_parsed_with_their_labels_and_escapes() -> None:
    text = '\n'.join([
        "# HELP x a comment",
        'vllm:cache_config_info{block_size="16",note="a \\"quoted\\" \\\\ path\\n"} 1.0',
        "plain 3e2 1700000000",
        'inf_bucket{le="+Inf"} +Inf',
        "not a sample line",
    ])
    samples = parse_samples(text)
    assert [(s.name, s.value) for s in samples] == [("vllm:cache_config_info", 1.0), ("plain", 300.0), ("inf_bucket", math.inf)]
    assert samples[0].labels == {"block_size": "16", "note": 'a "quoted" \\ path\n'}
    assert samples[1].labels == {}


def test_quantile_comes_from_the_difference_of_two_cumulative_histograms() -> None:
    before = {0.1: 10.0, 1.0: 10.0, math.inf: 10.0}  # ten fast requests long ago
    after = {0.1: 10.0, 1.0: 30.0, math.inf: 30.0}  # twenty since, all between 0.1 and 1 s
    # rank 0.95 x 20 = 19 of the 20 in (0.1, 1]: interpolated as Prometheus does
    assert histogram_quantile(0.95, before, after) == pytest.approx(0.1 + 0.9 * 19 / 20)
    assert histogram_quantile(0.95, after, after) is None  # nothing new
    assert histogram_quantile(0.5, {}, {0.1: 0.0, 1.0: 0.0, math.inf: 4.0}) == 1.0  # beyond the last finite bound
    assert histogram_quantile(0.5, after, before) == pytest.approx(0.05)  # counts went down: the engine restarted them


def test_a_scrape_sums_series_and_reads_vllms_cache_size() -> None:
    ttft = Histogram((0.1, 1.0))
    for value in (0.05, 0.5, 0.5):
        ttft.observe(value)
    text = "\n".join([
        'vllm:num_requests_running{engine="0",model_name="m"} 2',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1',
        'vllm:num_requests_running{engine="1",model_name="m"} 1',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 40',
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",engine="0"} 1.0',
        *ttft.lines("vllm:time_to_first_token_seconds", 'engine="0",model_name="m"'),
    ])
    scrape = parse_scrape(text, METRIC_NAMES[BackendType.VLLM], at=5.0)
    assert (scrape.inflight, scrape.kv_usage, scrape.generated_tokens, scrape.kv_cache_tokens) == (4, 0.25, 40.0, 16000)
    assert scrape.ttft == {0.1: 1.0, 1.0: 3.0, math.inf: 3.0} and scrape.e2e == {}
    llama = parse_scrape("llamacpp:requests_processing 3\nllamacpp:requests_deferred 2\n",
                         METRIC_NAMES[BackendType.LLAMA_CPP], at=5.0)
    assert (llama.inflight, llama.kv_usage, llama.kv_cache_tokens) == (5, None, None)


def test_the_tracker_gives_rates_recent_percentiles_and_the_last_activity() -> None:
    tracker = StatusTracker(launched_at=0.0, window_s=30.0)
    quiet = tracker.observe(Scrape(at=10.0), T0)
    assert quiet.decode_tokens_per_s == 0 and quiet.last_active_at is None and quiet.ttft_p95_s is None

    busy = tracker.observe(Scrape(at=12.0, inflight=1, generated_tokens=100.0, activity=120.0,
                                  ttft={1.0: 1.0, math.inf: 1.0}), T0 + timedelta(seconds=2))
    assert busy.decode_tokens_per_s == pytest.approx(50.0) and busy.last_active_at == T0 + timedelta(seconds=2)
    assert busy.ttft_p95_s == pytest.approx(0.95)

    # Idle since, but a request finished between the looks: its counters moved.
    finished = tracker.observe(Scrape(at=14.0, generated_tokens=140.0, activity=170.0,
                                      ttft={1.0: 2.0, math.inf: 2.0}), T0 + timedelta(seconds=4))
    assert finished.last_active_at == T0 + timedelta(seconds=4) and finished.decode_tokens_per_s == pytest.approx(20.0)

    # Long idle: the rate is zero, activity stays where it was, the percentile leaves the window.
    idle = tracker.observe(Scrape(at=60.0, generated_tokens=140.0, activity=170.0, ttft={1.0: 2.0, math.inf: 2.0}),
                           T0 + timedelta(seconds=50))
    assert idle.decode_tokens_per_s == 0 and idle.last_active_at == T0 + timedelta(seconds=4)
    assert idle.ttft_p95_s is None
