"""What a run leaves for `modelpool calibrate`: instance transitions, wake commands, metric windows.

The same shape whether the run was the lab's (`lab run --out` writes
`record.json`) or the pool's (read back from the event log: InstanceStateChanged,
the WAKE actions of PolicyDecided, and the metric windows decisions recorded
with their inputs), so calibration reads both the same way.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from shared.contracts.backends import Action, BackendType
from shared.contracts.control import MetricWindow
from shared.contracts.events import AliasConfigured, InstanceStateChanged, PolicyDecided
from shared.contracts.messages import Envelope, Event
from shared.contracts.states import InstanceState


@dataclass(slots=True)
class Transition:
    t: float
    instance_id: str
    backend: BackendType
    from_state: InstanceState
    to_state: InstanceState

    @classmethod
    def read(cls, fields: dict[str, Any]) -> "Transition":
        return cls(float(fields["t"]), fields["instance_id"], BackendType(fields["backend"]),
                   InstanceState(fields["from_state"]), InstanceState(fields["to_state"]))


@dataclass(slots=True)
class WindowRecord:
    start: float
    end: float
    arrivals: int
    answered_fast: int
    answered_slow: int
    running: dict[str, float]
    """Running instances per backend, averaged over the window (the pool's log: at the decision)."""
    inflight: dict[str, float]
    """Requests on each backend, averaged over the window."""
    tokens: dict[str, float]
    """Tokens each backend generated in the window."""


@dataclass
class RunRecord:
    alias: dict[str, Any]
    """The alias's configuration (AliasConfig as JSON)."""
    transitions: list[Transition] = field(default_factory=list)
    wakes: list[tuple[float, str]] = field(default_factory=list)
    """(when, instance) of every wake commanded."""
    windows: list[WindowRecord] = field(default_factory=list)
    source: str = "lab"

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({"source": self.source, "alias": self.alias, "wakes": self.wakes,
                                    "transitions": [asdict(t) for t in self.transitions],
                                    "windows": [asdict(w) for w in self.windows]}))

    @classmethod
    def read(cls, path: Path) -> "RunRecord":
        data = json.loads(path.read_text())
        return cls(data["alias"], [Transition.read(t) for t in data["transitions"]], [tuple(w) for w in data["wakes"]],
                   [WindowRecord(**w) for w in data["windows"]], data.get("source", "lab"))


def record_from_log(events: list[tuple[Envelope, Event]]) -> RunRecord:
    """A pool run's record from its alias's events (as `modelpool history` reads them: stored and typed)."""
    if not events:
        raise ValueError("no events for the alias")
    t0 = events[0][0].occurred_at

    def at(when: datetime) -> float:
        return (when - t0).total_seconds()

    alias: dict[str, Any] | None = None
    record = RunRecord({}, source="event log")
    seen_windows: set[datetime] = set()
    for envelope, event in events:
        match event:
            case AliasConfigured(config=config):
                alias = config.model_dump(mode="json")
            case InstanceStateChanged():
                record.transitions.append(Transition(at(envelope.occurred_at), event.instance_id,
                                                     event.backend_type, event.from_state, event.to_state))
            case PolicyDecided(decision=decision, snapshot=snapshot):
                record.wakes.extend((at(envelope.occurred_at), a.instance_id)
                                    for a in decision.actions if a.action is Action.WAKE)
                m = snapshot.metrics
                if m is not None and m.window_end not in seen_windows:
                    seen_windows.add(m.window_end)
                    running: dict[str, float] = {}
                    for i in snapshot.instances:
                        if i.state is InstanceState.RUNNING:
                            running[i.backend.value] = running.get(i.backend.value, 0) + 1
                    start, end = at(m.window_start), at(m.window_end)
                    record.windows.append(WindowRecord(
                        start, end, m.arrivals, m.requests_fast, m.requests_slow, running,
                        {"llama.cpp": m.inflight_fast, "vllm": m.inflight_slow}, _tokens_by_backend(m, end - start)))
    if alias is None:
        raise ValueError("the log has no AliasConfigured event for the alias")
    record.alias = alias
    record.windows.sort(key=lambda w: w.start)
    return record


def _tokens_by_backend(m: MetricWindow, seconds: float) -> dict[str, float]:
    """The gateways measure decode tokens per alias, not per backend: split by where the requests were."""
    total = (m.decode_tokens_per_s or 0.0) * seconds
    fast, slow = m.inflight_fast, m.inflight_slow
    if fast + slow <= 0:
        return {"llama.cpp": 0.0, "vllm": 0.0}
    return {"llama.cpp": total * fast / (fast + slow), "vllm": total * slow / (fast + slow)}
