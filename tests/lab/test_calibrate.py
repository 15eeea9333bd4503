"""Calibration recovers the parameters a lab run was generated with, and derives seed 000 §13.7's values."""

from __future__ import annotations

import math

import pytest

from lab import workloads
from lab.calibrate import Estimates, estimate, fragment, initial_parameters, search
from lab.config import LabSettings, apply_sets, parse_sets
from lab.record import RunRecord
from lab.results import run
from shared.contracts.config import AliasConfig, PoolConfig

STARTUP_S, WAKE_S = 40.0, 3.0


def alias(policy: dict | None = None, fast: bool = True) -> AliasConfig:
    backends = {"vllm": {"model_name": "m", "model_path": "lab", "gpu_memory_gb": 12, "max_replicas": 4,
                         "max_model_len": 4096, "engine": "simulator",
                         "engine_args": {"startup-s": STARTUP_S, "wake-l1-s": WAKE_S}}}
    if fast:
        backends["llama.cpp"] = {"model_name": "m", "model_path": "lab", "gpu_memory_gb": 6, "max_replicas": 4,
                                 "engine": "simulator"}
    return AliasConfig.model_validate({"alias": "cal", "backends": backends,
                                       "autoscaling_policy": policy or {"name": "hybrid"}})


@pytest.fixture(scope="module")
def generated() -> RunRecord:
    # Three waves, 10 minutes apart: vLLM starts in the first, sleeps between, wakes for the others.
    _, trace = workloads.load("cold-wave", 4, {"waves": "3", "wave_requests": "300", "output_tokens": "512"})
    return run(alias(), PoolConfig().controller, LabSettings(seed=4), trace).record


def saturated_rate() -> float:
    """What one vLLM instance answers per second when it never runs dry, measured directly."""
    one = alias({"name": "periodic", "schedule": [[0, 1]], "min_instances": 1, "max_instances": 1}, fast=False)
    _, trace = workloads.load("sustained", 5, {"rate": "12", "duration_s": "600", "output_tokens": "512"})
    result = run(one, PoolConfig().controller, LabSettings(seed=5, queue_size=100_000, queue_timeout_s=10_000,
                                                       drain_s=0), trace)
    answered = sorted(s.arrival + s.e2e for s in result.served if s.e2e is not None)
    steady = [t for t in answered if STARTUP_S + 60 <= t <= 600]  # past the start, before the queue dries up
    return (len(steady) - 1) / (steady[-1] - steady[0])


def test_calibration_recovers_the_delays_and_memory_it_was_generated_with(generated):
    e = estimate(generated)
    assert e.tau_s_start == pytest.approx(STARTUP_S, abs=0.01)
    assert e.tau_s_wake == pytest.approx(WAKE_S, abs=0.01)
    assert (e.m_f, e.m_s_act, e.m_s_slp) == (6, 12, 0.5)


def test_calibration_recovers_the_saturated_service_rate(generated):
    e = estimate(generated)
    direct = saturated_rate()
    assert e.mu_s == pytest.approx(direct, rel=0.1), (e.mu_s, direct)
    assert e.mu_f is not None and e.mu_f < e.mu_s  # llama.cpp: fast to start, slow to serve
    assert "fitted over" in e.notes["mu_s"]


def test_the_semi_analytic_values_follow_seed_000():
    e = Estimates(mu_f=0.5, mu_s=4.0, tau_s_start=60.0, tau_s_wake=0.3, m_f=6, m_s_act=12, m_s_slp=0.5, lam=2.0,
                  burstiness=0.5, saturated_decode_tps=2000.0)
    init = initial_parameters(e, beta=1.0, gamma=0.1, kappa=0.0001)
    c = 4.5
    rho_up = (c - math.sqrt(4.0 / (0.1 * 12 + 0.0001 * 60))) / c
    assert 0.5 < rho_up < 0.7
    assert init.params["alpha"] == round(rho_up, 2)
    assert init.params["beta"] == round(rho_up - 0.15, 2)
    lam_prepare = 60 * 0.5 ** 2 / (1 + 60 * 0.5)
    assert init.params["prepare_conc"] == math.ceil(lam_prepare / 0.5)
    assert init.params["down_hold_s"] == 180.0 and init.params["up_consecutive"] == 2
    assert init.heteroscale_target_tps == 1400.0
    text = fragment(init.params, init.heteroscale_target_tps, init.derivation, "test")
    assert "autoscaling_policy: {name: hybrid, alpha:" in text and "target_decode_tps_per_instance: 1400" in text


def test_the_search_keeps_only_changes_that_lower_the_objective(generated):
    a = alias()
    pool = PoolConfig(aliases=[a])
    a, pool, lab = apply_sets(pool, None, parse_sets([]), LabSettings(seed=1, drain_s=60))
    _, trace = workloads.load("cold-wave", 1, {"waves": "1", "wave_requests": "80", "idle_s": "10"})
    start = {"alpha": 0.7, "beta": 0.3, "prepare_conc": 3, "down_hold_s": 180.0,
             "up_consecutive": 2}
    best, history = search(a, pool.controller, lab, trace, start, rounds=1)
    assert history[0]["params"] == start
    assert min(h["objective"] for h in history) == next(h["objective"] for h in history if h["params"] == best)
