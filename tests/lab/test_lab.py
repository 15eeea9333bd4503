"""The lab's cluster: deterministic for a seed, the pool's own decision code, a scaling log, a CLI."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import pytest
from helpers import eventually

import policy.hybrid
from lab import workloads
from lab.cli import main as lab_main
from lab.config import LabSettings, apply_sets, load_lab_pool, parse_sets
from lab.results import run
from shared.contracts.config import ConfigError
from shared.contracts.events import PolicyDecided

WAVE = {"idle_s": "30", "wave_s": "10", "wave_requests": "40", "waves": "1"}


def lab_run(policy: str = "hybrid", workload: str = "cold-wave", seed: int = 0, *sets: str, overrides=None):
    pool = load_lab_pool("config/lab.yaml")
    parsed = parse_sets([f"autoscaling_policy={policy}", *sets])
    alias, pool, lab = apply_sets(pool, None, parsed, LabSettings(seed=seed, drain_s=120))
    _, trace = workloads.load(workload, seed, overrides if overrides is not None else WAVE)
    return run(alias, pool.controller, lab, trace)


def test_a_run_is_deterministic_for_a_seed_and_differs_for_another():
    a, b = lab_run(seed=1), lab_run(seed=1)
    assert a.summary | {"wall_s": 0} == b.summary | {"wall_s": 0}
    assert [line.csv() for line in a.log] == [line.csv() for line in b.log]
    c = lab_run(seed=2)
    assert c.summary["ttft_s"] != a.summary["ttft_s"]


def test_a_cold_wave_is_taken_by_llama_cpp_first_and_every_request_is_answered():
    r = lab_run()
    assert r.summary["lost"] == 0 and r.summary["answered"] == 40
    switches = [(line.t, line.target) for line in r.log if line.action == "routing_switch"]
    assert switches[0][1] == "FAST_ONLY" and 30 <= switches[0][0] <= 31  # the wave's first request, at the next tick
    assert r.summary["served_by"].get("llama.cpp", 0) > 0
    assert r.summary["gpu_mem_s"] > 0


def test_heteroscale_in_the_lab_scales_prefill_and_decode_instances():
    r = lab_run("heteroscale", "sustained", 0, "heteroscale.scale_out_cooldown=30",
                overrides={"rate": "4", "duration_s": "400"})
    assert r.summary["lost"] == 0
    outs = [line for line in r.log if line.target == "scale_out"]
    assert outs and all(line.status.startswith("prompt:") and "_token:" in line.status for line in outs)
    assert max(s.awake.get("vllm:decode", 0) for s in r.samples) > max(s.awake.get("vllm:prefill", 0) for s in r.samples)


def test_changing_a_rule_in_the_policy_module_changes_the_lab(monkeypatch):
    before = lab_run()
    first = next(line for line in before.log if line.action == "autoscaling_decision")
    assert first.status.startswith("llama.cpp:0->1")
    monkeypatch.setattr(policy.hybrid, "l_target", lambda *args: 2)  # the fast tier's sizing rule, changed
    after = lab_run()
    first = next(line for line in after.log if line.action == "autoscaling_decision")
    assert first.status.startswith("llama.cpp:0->2")


async def test_changing_a_rule_in_the_policy_module_changes_the_pool(monkeypatch, store, bus, settings, telemetry,
                                                                     tmp_path):
    # The same change as above, in the autoscaler service on the real log and bus: it starts two, not one.
    from services.autoscaler.controller import Controller
    from shared.bus.telemetry import TelemetryBus
    from shared.configuration import load_pool_config
    from shared.contracts.telemetry import DemandSignal
    from shared.eventlog.lease import AdvisoryLease

    monkeypatch.setattr(policy.hybrid, "l_target", lambda *args: 2)
    pool_file = tmp_path / "pool.yaml"
    pool_file.write_text((__import__("pathlib").Path("config/lab.yaml")).read_text())
    telemetry_bus = TelemetryBus(bus.nc, bus.js, bus.subjects)
    await telemetry_bus.ensure()
    c = Controller(store=store, engine=store.engine, js=bus.js, subjects=bus.subjects, telemetry=telemetry,
                   telemetry_bus=telemetry_bus, lease=AdvisoryLease(settings.asyncpg_dsn, settings.namespace, "autoscaler"),
                   pool=load_pool_config(pool_file, environ={}), tick_s=60.0, worker_timeout_s=10.0)
    stop = asyncio.Event()
    task = asyncio.create_task(c.run(stop))
    await eventually(lambda: c.ticks >= 1, timeout=20)
    await telemetry_bus.publish_demand(DemandSignal(gateway_id="g1", alias="lab-2b", held=3, at=datetime.now(timezone.utc)))
    await eventually(lambda: c.ticks >= 2, timeout=10)
    stop.set()
    await task
    decided = [e.payload for e in await store.history("lab-2b") if e.type == PolicyDecided.TYPE]
    starts = [a for a in decided[-1]["decision"]["actions"] if a["action"] == "start"]
    assert len(starts) == 2 and {a["backend"] for a in starts} == {"llama.cpp"}


def test_overrides_name_the_field_that_is_wrong():
    pool = load_lab_pool("config/lab.yaml")
    with pytest.raises(ConfigError, match="pd_ratio"):
        apply_sets(pool, None, parse_sets(["autoscaling_policy=heteroscale", "autoscaling_policy.pd_ratio=-1"]))
    with pytest.raises(ConfigError, match="autoscaling_policy"):
        apply_sets(pool, None, parse_sets(["autoscaling_policy=nope"]))
    with pytest.raises(ConfigError, match="workload.rate"):
        workloads.load("sustained", 0, {"rate": "fast"})
    with pytest.raises(ConfigError, match="--set"):
        parse_sets(["nonsense"])
    applied, _, _ = apply_sets(pool, None, parse_sets(["autoscaling_policy=heteroscale", "heteroscale.pd_ratio=0.5",
                                                       "latency.step=3"]))
    assert applied.autoscaling_policy.pd_ratio == 0.5
    _, _, lab = apply_sets(pool, None, parse_sets(["lab.objective.gamma=0.5"]), LabSettings(seed=3))
    assert (lab.objective.gamma, lab.objective.beta, lab.seed) == (0.5, 1.0, 3)  # one weight changed, the rest kept
    with pytest.raises(ConfigError, match="nope"):
        apply_sets(pool, None, parse_sets(["lab.nope=1"]))


def test_lab_compare_writes_a_summary_scaling_logs_and_a_plot(tmp_path, capsys):
    out = tmp_path / "out"
    code = lab_main(["compare", "--workload", "cold-wave", "--policies", "hybrid,utilization", "--quiet",
                     "--set", "lab.drain_s=60", *[f"--set=workload.{k}={v}" for k, v in WAVE.items()],
                     "--out", str(out), "--plot", str(tmp_path / "lab.png")])
    assert code == 0
    printed = capsys.readouterr().out
    assert "lab model of simulated-vllm" in printed  # which engine served, said where results are shown
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"hybrid", "utilization"}
    log = (out / "scaling" / "hybrid.log").read_text().splitlines()
    assert log[0] == "time,action,target,status,reason" and any(",autoscaling_decision,scale_out," in x for x in log)
    assert (tmp_path / "lab.png").stat().st_size > 10_000
    assert json.loads(printed.strip().splitlines()[-1])["hybrid"]["requests"] == 40


def test_an_agentic_trace_runs_closed_loop_with_the_alias_router():
    overrides = {"sessions": "60", "span_s": "60", "new_input_tokens": "300"}
    r = lab_run("hybrid", "agentic", 3, "router.plugin=ear", "router.t_hot_tokens=256", overrides=overrides)
    _, trace = workloads.load("agentic", 3, overrides)
    assert r.summary["requests"] == len(trace) > 60 and r.summary["lost"] == 0
    by_session: dict[str, list] = {}
    for s in sorted(r.served, key=lambda s: s.arrival):
        by_session.setdefault(s.session, []).append(s)
    later = [(a, b) for turns in by_session.values() for a, b in zip(turns, turns[1:])]
    assert later and all(b.arrival >= a.arrival + a.e2e for a, b in later)  # closed loop: after the answer


def test_a_standby_vllm_is_asleep_before_the_wave_and_woken_for_it_rather_than_started():
    pool = load_lab_pool("config/lab.yaml")
    alias, pool, lab = apply_sets(pool, None, parse_sets(["autoscaling_policy=hybrid", "hybrid.vllm_sleep_l1_idle_s=5"]),
                                  LabSettings(seed=0, drain_s=120))
    _, trace = workloads.load("cold-wave", 0, {**WAVE, "idle_s": "120"})
    vllm = alias.backends[policy.hybrid.SLOW]

    def warm_up_s(standby: int) -> float:
        kept = alias.model_copy(update={"backends": {**alias.backends, policy.hybrid.SLOW: vllm.model_copy(
            update={"standby_replicas": standby})}})
        r = run(kept, pool.controller, lab, trace)
        assert r.summary["lost"] == 0
        if standby:  # started ahead of any request, asleep when the wave comes
            assert next(s for s in r.samples if s.t >= 115).asleep == {"vllm": 1}
        switches = {line.target: line.t for line in r.log if line.action == "routing_switch"}
        return switches["MIXED"] - switches["WARMING_VLLM"]

    # The same policy code: the warm-up is a wake (0.3 s and the ready probes) instead of a 60 s start.
    assert warm_up_s(1) < 10 < 60 <= warm_up_s(0)
