"""The fluid model: estimated from discrete traces, and approached by the scaled discrete system."""

from __future__ import annotations

import numpy as np
import pytest

from simulation.config import load_config
from simulation.fluid import FluidLimitSpec, FluidParams, run_fluid_limit, solve_fluid


def small_config(mode: str):
    return load_config(None, env={}, overrides={
        "system": {"M_total": 1000, "B": 400, "d_0": 1.0, "d_1": 0.001},
        "control": {"preemption_mode": mode, "preemption_strategy": "aggressive"},
    })


@pytest.mark.parametrize("mode", ["swap", "sacrifice"])
def test_fluid_distance_shrinks_as_the_scale_grows(mode):
    spec = FluidLimitSpec(rate=1.0, horizon=60, prefill="uniform:10:80", decode="uniform:5:40",
                          scales=(1, 8, 64), reference_scale=64, seed=1)
    result = run_fluid_limit(small_config(mode), spec)
    sup = [r["sup_distance_X"] for r in result.rows]
    mean = [r["mean_distance_X"] for r in result.rows]
    assert sup[0] > sup[1] > sup[2], sup
    assert mean[0] > mean[1] > mean[2], mean
    assert sup[2] < 0.5 * sup[0]
    # the case is not trivial: memory binds, requests are preempted, and the ODE carries real mass
    assert result.reference.preempted.sum() > 100
    assert result.solution["X"].sum(axis=1).max() > 10
    if mode == "swap":
        assert result.params.S_Z.sum() > 0
    else:
        assert result.solution["Z"].sum() == 0


def test_ode_conserves_requests():
    # no preemption, geometric-like completion: the mass in the system is arrivals minus completions
    L, W = 30, 40
    q = np.full(L, 0.1)
    q[-1] = 1.0
    fp = FluidParams(window=1.0, lam=np.where(np.arange(W) < 20, 2.0, 0.0), S_q=np.where(np.arange(W) < 20, 2.0, 0.0),
                     p=np.tile(np.eye(1, L, 0), (W, 1)), S_Z=np.zeros((W, L)), r=np.zeros((W, L)), q=q,
                     d_0=1.0, d_1=0.0, sacrifice=False)
    grid = np.arange(0.0, 40.0, 1.0)
    sol = solve_fluid(fp, grid)
    mass = sol["Q"] + sol["X"].sum(axis=1) + sol["Z"].sum(axis=1)
    # completions leave at rate sum_i q_i X_i / tau; integrate them numerically
    outflow = (sol["X"] * q).sum(axis=1)
    completed = np.concatenate(([0.0], np.cumsum((outflow[1:] + outflow[:-1]) / 2)))
    arrived = np.minimum(grid, 20.0) * 2.0
    assert np.allclose(mass + completed, arrived, atol=0.3)
    assert sol["Q"].max() < 1e-6  # admission keeps up with arrivals


def test_fluid_limit_command_writes_its_report(tmp_path, capsys):
    import yaml

    from simulation.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "system": {"M_total": 800, "B": 400, "d_0": 1.0, "d_1": 0.001},
        "data": {"experiments_dir": str(tmp_path / "exp")},
        "experiment": {"verbose": False},
    }))
    assert main(["fluid-limit", "--config", str(cfg), "--scales", "1,4", "--rate", "1.0", "--horizon", "30",
                 "--prefill", "uniform:10:60", "--decode", "uniform:5:30"]) == 0
    out = next((tmp_path / "exp").iterdir())
    names = {p.name for p in out.iterdir()}
    assert {"fluid_limit.csv", "fluid_trajectories.csv", "fluid_parameters.csv", "fluid_limit.png",
            "summary.txt", "config_used.yaml", "experiment_meta.yaml"} <= names
    text = capsys.readouterr().out
    assert "distance shrinks with n" in text
    assert main(["fluid-limit", "--config", str(cfg), "--scales", "0,x"]) == 2
