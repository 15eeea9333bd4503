"""The lab's comparison is scored on a day the calibration never saw, and runs every policy there."""

from __future__ import annotations

import math

import numpy as np

from lab import workloads
from lab.calibrate import Calibration
from lab.config import LabSettings, apply_sets, load_lab_pool, parse_sets
from lab.heldout import KEYS, MOONCAKE_DAY, Day, held_out_days, hourly_schedule, score_policies
from simulation.mooncake import SHAPES, generate_mooncake
from simulation.mooncake_rate import CONVERSATION_RATE, CONVERSATION_SAMPLES, FILE_CHARS, rate_from_timestamps


def hourly(day: Day) -> np.ndarray:
    arrivals = np.array([r.delay_s for r in day.trace(compress=24)])  # an hour for a day: same shape, quick
    return np.bincount((arrivals // 150).astype(int), minlength=24)[:24]


def test_the_scored_day_is_another_seed_peak_hour_peakiness_and_burst_pattern():
    calibration, scored = held_out_days(7)
    assert scored.seed != calibration.seed
    assert {k for k in ("trough_at_s", "peakiness", "bursts") if scored.shape.get(k) != calibration.shape.get(k)} == {
        "trough_at_s", "peakiness", "bursts"}
    cal, score = hourly(calibration), hourly(scored)
    assert cal.argmax() == 16 and score.argmax() in (18, 19, 20)  # 4 pm against 7 pm, give or take a burst
    # Without its bursts, the scored day is quieter in the morning and busier in the night.
    cal_at, score_at = (workloads.diurnal_rate(workloads.shape_named("diurnal", {k: str(v) for k, v in d.shape.items()}),
                                               np.array([2 * 3600.0, 10 * 3600.0])) for d in (calibration, scored))
    assert score_at[1] < cal_at[1] / 2 and score_at[0] > 5 * cal_at[0]


def test_a_diurnal_day_without_bursts_is_the_day_it_always_was():
    plain = workloads.load("diurnal", 3, {"compress": "48"})[1]
    bursty = workloads.load("diurnal", 3, {"compress": "48", "bursts": "4", "burst_peak_share": "1"})[1]
    assert len(plain) == 7402 and plain[0].delay_s == 0.314  # as generated before bursts existed
    assert len(bursty) > len(plain) * 1.05


def test_a_burst_adds_the_same_rate_in_a_quiet_hour_as_in_a_busy_one():
    shape = workloads.shape_named("diurnal", {"peak_rate": "12", "trough_rate": "0.02", "burst_peak_share": "0.5"})
    bursts = np.array([4 * 3600.0, 16 * 3600.0])  # at the trough and at the peak
    t = np.array([4 * 3600.0 + 60, 16 * 3600.0 + 60])
    added = workloads.diurnal_rate(shape, t, bursts) - workloads.diurnal_rate(shape, t)
    assert np.allclose(added, 6.0)


def test_the_conversation_rate_from_its_samples_holds_the_published_request_count():
    rates = [rate for _, rate in CONVERSATION_RATE.points]
    assert (min(rates), max(rates)) == (2.58, 4.21)  # as docs/lab.md gives the curve's range
    offsets = [x for x, _, _, _ in CONVERSATION_SAMPLES]
    assert offsets == sorted(offsets) and offsets[-1] + CONVERSATION_SAMPLES[-1][1] <= FILE_CHARS
    assert len(CONVERSATION_RATE.points) == 40
    assert abs(CONVERSATION_RATE.requests() / 12_031 - 1) < 0.02  # the README's count, within the sampling's error


def test_the_rate_of_a_trace_s_own_timestamps_counts_every_request():
    hour = generate_mooncake(SHAPES["mooncake-conversation"], 1, requests=3000)
    curve = rate_from_timestamps([r.timestamp for r in hour], intervals=20)
    assert len(curve.points) == 20 and abs(curve.requests() - len(hour)) < 1


def test_a_mooncake_day_is_the_conversation_hour_s_rate_stretched_and_scaled_to_the_peak():
    shape = workloads.shape_named("mooncake-day", {k: str(v) for k, v in MOONCAKE_DAY.items()})
    minutes, rates = np.array(CONVERSATION_RATE.points).T
    top = minutes[rates.argmax()]
    at = np.array([0.0, top / CONVERSATION_RATE.span_min * 86_400, 86_400.0])
    expected = [12 * rates[0] / rates.max(), 12.0, 12 * rates[-1] / rates.max()]
    assert np.allclose(workloads.curve_rate(CONVERSATION_RATE, shape, at), expected)
    day = Day(1, MOONCAKE_DAY, "mooncake-day").trace(compress=48)  # half an hour for the day: same shape, quick
    mean = CONVERSATION_RATE.requests() / (CONVERSATION_RATE.span_min * 60) / rates.max() * 12
    assert abs(len(day) / (mean * 1800) - 1) < 0.03
    assert 300 < np.median([r.new_input_tokens for r in day]) < 900  # the diurnal days' lengths, not the trace's


def test_a_periodic_schedule_sizes_each_hour_for_heteroscale_s_target_and_starts_it_ahead():
    day = workloads.load("sustained", 0, {"rate": "2", "duration_s": "7200"})[1]  # two busy hours, then none
    schedule = hourly_schedule(day, target_decode_tps=100.0, lead_s=60.0)
    first_hour = sum(r.output_tokens for r in day if r.delay_s < 3600)
    # Each hour's answer tokens per second over the target per instance: 2/s x about 256 tokens / 100 = 6.
    assert schedule[0] == (0.0, math.ceil(first_hour / 3600 / 100.0)) and 5 <= schedule[0][1] <= 7
    assert schedule[-1] == (2 * 3600 - 60.0, 1) and {at for at, _ in schedule[1:-1]} <= {3600 - 60.0}


def test_every_policy_runs_on_the_scored_trace_and_is_reported():
    pool = load_lab_pool("config/lab.yaml")
    alias, pool, lab = apply_sets(pool, None, parse_sets([]), LabSettings(seed=1, drain_s=120))
    day = workloads.load("diurnal", 1, {"compress": "288", "peak_rate": "3", "output_tokens": "128",
                                        "bursts": "2", "burst_s": "1800"})[1]  # 5 minutes of a day
    # Two quiet minutes first, as the night gives a whole day: an always-on pool is up when its traffic comes.
    trace = [r.model_copy(update={"delay_s": r.delay_s + 120}) for r in day]
    calibration = Calibration({"alpha": 0.8, "beta": 0.65, "prepare_conc": 1, "down_hold_s": 60, "up_consecutive": 2},
                              500.0, [], 1)
    table = score_policies(alias, pool.controller, lab, trace, calibration).table()
    assert list(table["runs"]) == list(KEYS)
    for key, row in table["runs"].items():
        assert row["requests"] == len(trace) and {"slo_attainment", "gpu_mem_s", "scale_actions"} <= set(row)
        assert row["gpu_mem_s"] > 0
    runs = table["runs"]
    assert runs["always_on"]["gpu_mem_ratio_to_always_on"] == 1.0
    assert runs["always_on"]["slo_attainment"] >= runs["hybrid"]["slo_attainment"]
    assert table["always_on_tried"][-1]["instances"] >= table["always_on_instances"]
    assert runs["hybrid"]["label"] == "hybrid, calibrated" and runs["always_on"]["label"].startswith("always-on,")
    assert table["periodic_target_tps"] == 500.0 and runs["periodic"]["scale_actions"] >= 1
