"""Choosing a worker for a new instance (seed 000 §7): filter, score, pick — the placement service's decision.

    Score = 0.45*S_mem + 0.30*S_anti_backend + 0.20*S_anti_replica - 0.05*S_load

Fallback order: resources and both anti-affinities; resources and one of them;
resources only (availability first). Pure: a recorded snapshot of the workers
gives the same decision again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.events import CandidateScore

W_MEM, W_ANTI_BACKEND, W_ANTI_REPLICA, W_LOAD = 0.45, 0.30, 0.20, 0.05


@dataclass(frozen=True)
class Placed:
    instance_id: str
    alias: str
    backend_type: BackendType
    gpu_memory_gb: float


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    gpu_memory_gb: float
    slots: int
    engines: frozenset[EngineKind]
    up: bool = True
    instances: tuple[Placed, ...] = field(default_factory=tuple)

    @property
    def used_memory_gb(self) -> float:
        return sum(i.gpu_memory_gb for i in self.instances)


@dataclass(frozen=True)
class PlacementRequest:
    """The instance to place: its alias, backend, engine and the GPU memory it takes."""

    alias: str
    backend_type: BackendType
    engine: EngineKind
    gpu_memory_gb: float


@dataclass(frozen=True)
class PlacementChoice:
    """The chosen worker (None: none can host it), its score and fallback level, and every candidate's score."""

    worker_id: str | None
    score: float
    fallback_level: int | None
    candidates: tuple[CandidateScore, ...]
    reason: str


def score_worker(request: PlacementRequest, worker: WorkerView) -> CandidateScore:
    if not worker.up:
        return CandidateScore(worker_id=worker.worker_id, feasible=False, note="worker is not up")
    if request.engine not in worker.engines:
        return CandidateScore(worker_id=worker.worker_id, feasible=False, note=f"cannot run {request.engine.value}")
    if len(worker.instances) >= worker.slots:
        return CandidateScore(worker_id=worker.worker_id, feasible=False, note="no free slot")
    free = worker.gpu_memory_gb - worker.used_memory_gb
    if request.gpu_memory_gb > free + 1e-9:
        return CandidateScore(
            worker_id=worker.worker_id, feasible=False,
            note=f"needs {request.gpu_memory_gb:g} GB, {free:g} GB free",
        )
    same_alias = [i for i in worker.instances if i.alias == request.alias]
    s_mem = (free - request.gpu_memory_gb) / worker.gpu_memory_gb if worker.gpu_memory_gb > 0 else 1.0
    s_anti_backend = 0.0 if any(i.backend_type is not request.backend_type for i in same_alias) else 1.0
    s_anti_replica = 0.0 if any(i.backend_type is request.backend_type for i in same_alias) else 1.0
    s_load = len(worker.instances) / worker.slots if worker.slots else 1.0
    score = W_MEM * s_mem + W_ANTI_BACKEND * s_anti_backend + W_ANTI_REPLICA * s_anti_replica - W_LOAD * s_load
    return CandidateScore(
        worker_id=worker.worker_id,
        feasible=True,
        score=round(score, 6),
        components={"S_mem": round(s_mem, 6), "S_anti_backend": s_anti_backend,
                    "S_anti_replica": s_anti_replica, "S_load": round(s_load, 6)},
    )


def fallback_level(candidate: CandidateScore) -> int:
    satisfied = int(candidate.components["S_anti_backend"] == 1.0) + int(candidate.components["S_anti_replica"] == 1.0)
    return 3 - satisfied  # 1: both anti-affinities, 2: one, 3: resources only


def place(request: PlacementRequest, workers: Sequence[WorkerView]) -> PlacementChoice:
    candidates = tuple(score_worker(request, w) for w in sorted(workers, key=lambda w: w.worker_id))
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        reasons = "; ".join(f"{c.worker_id}: {c.note}" for c in candidates) or "no worker registered"
        return PlacementChoice(None, 0.0, None, candidates, f"no worker can host it ({reasons})")
    best = min(feasible, key=lambda c: (fallback_level(c), -(c.score or 0.0), c.worker_id))
    level = fallback_level(best)
    return PlacementChoice(best.worker_id, best.score or 0.0, level, candidates, f"fallback level {level}")
