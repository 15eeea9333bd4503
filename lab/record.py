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


@dataclass(slots=True)
class Transition:
    t: float
    instance_id: str
    backend: str
    from_state: str
    to_state: str


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
        return cls(data["alias"], [Transition(**t) for t in data["transitions"]], [tuple(w) for w in data["wakes"]],
                   [WindowRecord(**w) for w in data["windows"]], data.get("source", "lab"))


def record_from_log(events: list[Any]) -> RunRecord:
    """A pool run's record from its alias's events (as `EventStore.history` returns them)."""
    if not events:
        raise ValueError("no events for the alias")
    t0 = events[0].occurred_at

    def at(when: Any) -> float:
        return (when - t0).total_seconds()

    alias: dict[str, Any] | None = None
    record = RunRecord({}, source="event log")
    seen_windows: set[str] = set()
    for e in events:
        p = e.payload
        if e.type == "AliasConfigured":
            alias = p["config"]
        elif e.type == "InstanceStateChanged":
            record.transitions.append(Transition(at(e.occurred_at), p["instance_id"], p["backend_type"],
                                                 p["from_state"], p["to_state"]))
        elif e.type == "PolicyDecided":
            for a in p["decision"]["actions"]:
                if a["action"] == "wake":
                    record.wakes.append((at(e.occurred_at), a["instance_id"]))
            m = p["snapshot"].get("metrics")
            if m and m["window_end"] not in seen_windows:
                seen_windows.add(m["window_end"])
                running: dict[str, float] = {}
                for i in p["snapshot"]["instances"]:
                    if i["state"] == "RUNNING":
                        running[i["backend"]] = running.get(i["backend"], 0) + 1
                start, end = (_seconds(m["window_start"], t0), _seconds(m["window_end"], t0))
                record.windows.append(WindowRecord(
                    start, end, m.get("arrivals", 0), m.get("requests_fast", 0), m.get("requests_slow", 0), running,
                    {"llama.cpp": m.get("inflight_fast", 0.0), "vllm": m.get("inflight_slow", 0.0)},
                    _tokens_by_backend(m, end - start)))
    if alias is None:
        raise ValueError("the log has no AliasConfigured event for the alias")
    record.alias = alias
    record.windows.sort(key=lambda w: w.start)
    return record


def _tokens_by_backend(m: dict[str, Any], seconds: float) -> dict[str, float]:
    """The gateways measure decode tokens per alias, not per backend: split by where the requests were."""
    total = (m.get("decode_tokens_per_s") or 0.0) * seconds
    fast, slow = m.get("inflight_fast", 0.0), m.get("inflight_slow", 0.0)
    if fast + slow <= 0:
        return {"llama.cpp": 0.0, "vllm": 0.0}
    return {"llama.cpp": total * fast / (fast + slow), "vllm": total * slow / (fast + slow)}


def _seconds(iso: str, t0: Any) -> float:
    return (datetime.fromisoformat(iso) - t0).total_seconds()
