"""What a lab run reports: each request's outcome, the cluster at each window's end, the scaling log."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestResult:
    """One request's outcome."""

    arrival: float
    ttft: float | None
    e2e: float | None
    tbt: float | None
    backend: str | None
    queue_wait: float
    lost: str | None = None
    session: str = ""


@dataclass(slots=True)
class WindowSample:
    """The cluster at the end of one metric window, for the plots and the objective (Delta = the window)."""

    t: float
    routing: str
    awake: dict[str, int]
    asleep: dict[str, int]
    arrivals_per_s: float
    memory_gb: float
    actions: int
    objective: float


@dataclass(slots=True)
class LogLine:
    """One line of seed 001's scaling log: time,action,target,status,reason."""

    t: float
    action: str
    target: str
    status: str
    reason: str

    def csv(self) -> str:
        reason = self.reason.replace("\n", " ")
        return f"{self.t:.1f},{self.action},{self.target},{self.status},{reason}"
