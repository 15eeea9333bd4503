"""Placement as a pure decision (seed 000 §7): filter, score, and the fallback order, on workers described by hand."""

from __future__ import annotations

import pytest

from policy.placement import Placed, PlacementRequest, WorkerView, place, score_worker
from shared.contracts.backends import BackendType, EngineKind

FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM
ENGINES = frozenset({EngineKind.SIMULATOR, EngineKind.LLAMA_CPP})


def worker(worker_id: str, *placed: Placed, memory: float = 24, slots: int = 4, up: bool = True,
           engines: frozenset[EngineKind] = ENGINES) -> WorkerView:
    return WorkerView(worker_id, memory, slots, engines, up, tuple(placed))


def vllm(alias: str = "a", memory: float = 12) -> PlacementRequest:
    return PlacementRequest(alias, SLOW, EngineKind.SIMULATOR, memory)


def test_the_score_is_the_seeds_weighted_sum_of_its_components():
    busy = worker("w1", Placed("x1", "other", SLOW, 6))
    c = score_worker(vllm(), busy)
    assert c.feasible and c.components == {"S_mem": 0.25, "S_anti_backend": 1.0, "S_anti_replica": 1.0, "S_load": 0.25}
    assert c.score == pytest.approx(0.45 * 0.25 + 0.30 * 1.0 + 0.20 * 1.0 - 0.05 * 0.25)


def test_both_anti_affinities_before_one_before_resources_only_whatever_the_memory():
    same_backend = worker("w1", Placed("a1", "a", SLOW, 1), memory=80)  # lots of memory, but a replica is there
    other_backend = worker("w2", Placed("a2", "a", FAST, 0))
    neither = worker("w3", Placed("b1", "b", SLOW, 12))
    assert place(vllm(), [same_backend, other_backend, neither]).worker_id == "w3"
    choice = place(vllm(), [same_backend, other_backend])
    assert (choice.worker_id, choice.fallback_level) == ("w1", 2)  # each keeps one anti-affinity; w1 has more memory
    assert place(vllm(), [worker("w4", Placed("a1", "a", SLOW, 1), Placed("a2", "a", FAST, 0))]).fallback_level == 3


def test_a_worker_that_cannot_host_it_is_refused_with_its_reason():
    workers = [worker("down", up=False), worker("no-engine", engines=frozenset({EngineKind.LLAMA_CPP})),
               worker("full", *(Placed(f"i{n}", "b", FAST, 0) for n in range(2)), slots=2),
               worker("small", memory=8)]
    choice = place(vllm(), workers)
    assert choice.worker_id is None and choice.fallback_level is None
    notes = {c.worker_id: c.note for c in choice.candidates}
    assert notes == {"down": "worker is not up", "no-engine": "cannot run simulator", "full": "no free slot",
                     "small": "needs 12 GB, 8 GB free"}
    assert "small: needs 12 GB" in choice.reason and place(vllm(), []).reason.endswith("(no worker registered)")


def test_equal_workers_are_chosen_by_id_so_a_recorded_decision_is_made_again():
    assert place(vllm(), [worker("w2"), worker("w1")]).worker_id == "w1"
    assert place(vllm(), [worker("w1"), worker("w2")]) == place(vllm(), [worker("w2"), worker("w1")])
