"""The lab's event-level instance against seed 002's decode system, batch by batch, on the same arrivals."""

from __future__ import annotations

import numpy as np
import pytest

from lab.instance import LabInstance, TierModel
from shared.contracts.backends import BackendType
from shared.contracts.states import InstanceState
from simulation.core import DecodeSystem, SimRequest, SystemParams
from simulation.runner import run_until_idle

D0, D1 = 0.012, 0.00004  # the simulated vLLM profile's batch timing


def requests(rate: float, n: int, seed: int = 3) -> list[tuple[float, int, int]]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    prompts = rng.integers(200, 1500, n)
    outputs = rng.integers(20, 300, n)
    return [(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]


def exact(reqs) -> dict[str, tuple[float, float]]:
    """(first token, completion) of each request in the batch-by-batch decode system."""
    params = SystemParams(M_total=10_000_000, B=8192, d_0=D0, d_1=D1, prefill=True)
    system = DecodeSystem(params)
    first: dict[str, float] = {}
    done: dict[str, float] = {}

    def on_step(step):
        for rid in step.emitted:
            first.setdefault(rid, step.end_time)
        for rid in step.completed:
            first.setdefault(rid, step.end_time)
            done[rid] = step.end_time

    run_until_idle(system, [SimRequest(str(i), a, p, o) for i, (a, p, o) in enumerate(reqs)], on_step=on_step)
    return {rid: (first[rid], done[rid]) for rid in done}


def modelled(reqs) -> dict[str, tuple[float, float]]:
    model = TierModel(startup_s=0, wake_l1_s=0, wake_l2_s=0, d_0=D0, d_1=D1, capacity=10_000, kv_tokens=0,
                      memory_gb=1, sleep_memory_gb=0, engine="test")
    inst = LabInstance("i", BackendType.VLLM, "w", model, InstanceState.RUNNING, 0.0)
    events = [(a, "arrive", str(i), p, o) for i, (a, p, o) in enumerate(reqs)]
    out: dict[str, tuple[float, float]] = {}
    pending = sorted(events)
    k = 0
    while k < len(pending) or inst.jobs:
        due = inst.next_completion()
        if k < len(pending) and (due is None or pending[k][0] <= due):
            a, _, rid, p, o = pending[k]
            inst.admit(rid, rid, p, o, a)
            k += 1
        else:
            jobs, _ = inst.complete_due(due)
            for job in jobs:
                out[job.request] = (job.first_token_at, due)
    return out


@pytest.mark.parametrize("rate", [2.0, 10.0, 20.0])
def test_the_event_level_model_keeps_the_decode_systems_latencies(rate):
    reqs = requests(rate, 400)
    a, b = exact(reqs), modelled(reqs)
    arrival = {str(i): r[0] for i, r in enumerate(reqs)}
    e2e_exact = np.array([a[k][1] - arrival[k] for k in a])
    e2e_model = np.array([b[k][1] - arrival[k] for k in a])
    ttft_exact = np.array([a[k][0] - arrival[k] for k in a])
    ttft_model = np.array([b[k][0] - arrival[k] for k in a])
    assert abs(e2e_model.mean() / e2e_exact.mean() - 1) < 0.05
    assert abs(np.percentile(e2e_model, 95) / np.percentile(e2e_exact, 95) - 1) < 0.08
    assert abs(ttft_model.mean() / ttft_exact.mean() - 1) < 0.25  # chunked prefill (B) is not modelled
    print(f"rate {rate}: e2e mean {e2e_model.mean():.3f} vs {e2e_exact.mean():.3f}, "
          f"ttft mean {ttft_model.mean():.3f} vs {ttft_exact.mean():.3f}")
