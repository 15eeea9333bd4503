"""The speed probe the benchmark calls: it simulates, and reports consistent numbers."""

from __future__ import annotations

import pytest

from simulation.speed import measure_sim_speed, running_curve_point


def test_measure_sim_speed_reports_batches_requests_and_a_scaling_curve():
    result = measure_sim_speed(1, n_requests=300, seconds=5.0, running_points=(10, 200), point_seconds=0.05)
    assert result["requests_completed"] == 300  # a small run finishes well within the budget
    assert result["batches"] > 0 and result["sim_batches_per_s"] > 0 and result["sim_requests_per_s"] > 0
    assert result["sim_batches_per_s"] == result["batches"] / result["wall_seconds"]
    assert [p["running"] for p in result["scaling"]] == [10, 200]
    for point in result["scaling"]:
        # every running request decodes once per batch
        assert point["tokens_per_s"] == pytest.approx(point["batches_per_s"] * point["running"])


def test_a_scaling_point_keeps_its_batch_full_when_requests_complete_within_the_time():
    # Requests of 3 tokens complete every few batches: each is replaced, and the point keeps measuring.
    point = running_curve_point(4, seconds=0.05, decode_tokens=3)
    assert point["batches_per_s"] > 0
    assert point["tokens_per_s"] == pytest.approx(point["batches_per_s"] * 4)
