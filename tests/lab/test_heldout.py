"""The lab's comparison is scored on a day the calibration never saw, and runs every policy there."""

from __future__ import annotations

import numpy as np

from lab import workloads
from lab.calibrate import Calibration
from lab.config import LabSettings, apply_sets, load_lab_pool, parse_sets
from lab.heldout import KEYS, Day, held_out_days, little_schedule, score_policies
from simulation.mooncake import SHAPES, generate_mooncake, stretch


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
    assert score[8:12].sum() < cal[8:12].sum() / 2 and score[0:3].sum() > 5 * cal[0:3].sum()


def test_a_diurnal_day_without_bursts_is_the_day_it_always_was():
    plain = workloads.load("diurnal", 3, {"compress": "48"})[1]
    bursty = workloads.load("diurnal", 3, {"compress": "48", "bursts": "4", "burst_factor": "3"})[1]
    assert len(plain) == 7402 and plain[0].delay_s == 0.314  # as generated before bursts existed
    assert len(bursty) > len(plain) * 1.05


def test_a_mooncake_hour_stretched_over_a_day_keeps_its_order_lengths_and_shape():
    hour = generate_mooncake(SHAPES["mooncake-conversation"], 1, requests=600)
    day = stretch(hour, 86_400)
    assert [r.input_length for r in day] == [r.input_length for r in hour]
    assert day[0].timestamp == 0 and day[-1].timestamp == 86_400_000
    factor = 86_400_000 / (hour[-1].timestamp - hour[0].timestamp)
    assert all(abs(d.timestamp - (h.timestamp - hour[0].timestamp) * factor) <= 1 for d, h in zip(day, hour))
    _, trace = workloads.load("mooncake-conversation", 1, {"span_s": "7200"})
    assert trace[0].delay_s == 0 and 7000 < max(r.delay_s for r in trace if r.turn == 0) <= 7200


def test_a_periodic_schedule_by_littles_law_starts_each_hour_ahead():
    day = workloads.load("sustained", 0, {"rate": "2", "duration_s": "7200"})[1]  # two busy hours, then none
    schedule = little_schedule(day, mean_e2e_s=38.0, capacity=4, lead_s=60.0)
    # 2/s x 38 s / 4 = 19 instances in each busy hour, one in the idle ones from a minute before the third hour.
    assert schedule[0][0] == 0.0 and all(18 <= n <= 20 for _, n in schedule[:-1])
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
