"""Which instance serves a request: the routing state picks the backend, the gateway's own count the instance.

Seed 000 §12.4: fast only in FAST_ONLY / WARMING_VLLM / DEGRADED_FAST, split by
the mix weight (the share sent to vLLM) in MIXED, vLLM first with llama.cpp as
the floor in VLLM_PRIMARY. A COLD alias takes whatever instance comes up first,
so a request held through a cold start is served as soon as one runs, before the
controller has recorded the switch. An alias of the gateway's pool file that the
controller has not registered yet (the pool is starting) is COLD. The gateway
decides nothing about states or replicas; it follows what its live view of the
log says.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from shared.contracts.backends import BackendType
from shared.projections.live import LiveView
from shared.projections.readmodels import INSTANCES, ROUTING

FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM


def backend_order(state: str, mix_weight: float, draw: float) -> tuple[BackendType, ...]:
    """The backends a request may go to, in the order to try them; `draw` is uniform in [0, 1)."""
    if state in ("FAST_ONLY", "WARMING_VLLM", "DEGRADED_FAST"):
        return (FAST,)
    if state == "MIXED":
        return (SLOW, FAST) if draw < mix_weight else (FAST, SLOW)
    if state == "COLD":
        return (FAST, SLOW)
    return (SLOW, FAST)  # VLLM_PRIMARY: llama.cpp is the floor


@dataclass(frozen=True, slots=True)
class Choice:
    backend: BackendType
    instances: tuple[dict[str, Any], ...]
    """Routable instances of the backend, the one to try first first: fewest requests in flight from this gateway."""


class Router:
    """Picks instances from the live view and counts what this gateway has in flight on each.

    The count is the gateway's own: engines report load as telemetry now, and the
    read model's `inflight` column is no longer fed. With several replicas each
    balances its own share, which evens out the total.
    """

    def __init__(self, view: LiveView, rng: random.Random, configured: frozenset[str] = frozenset()) -> None:
        self.view = view
        self.rng = rng
        self.configured = configured
        self.inflight: dict[str, int] = {}
        self._routable: dict[tuple[str, BackendType], list[dict[str, Any]]] | None = None

    def view_advanced(self) -> None:
        self._routable = None

    def _instances(self, alias: str, backend: BackendType) -> list[dict[str, Any]]:
        if self._routable is None:
            # Rebuilt once per change of the view, not per request: the instance table spans every alias.
            index: dict[tuple[str, BackendType], list[dict[str, Any]]] = {}
            for row in self.view[INSTANCES].values():
                if row["state"] == "RUNNING" and row.get("endpoint"):
                    index.setdefault((row["alias"], BackendType(row["backend_type"])), []).append(row)
            self._routable = index
        return self._routable.get((alias, backend), [])

    def known(self, alias: str) -> bool:
        return alias in self.view[ROUTING] or alias in self.configured

    def _state(self, alias: str) -> tuple[str, float]:
        routing = self.view[ROUTING].get(alias)
        return ("COLD", 0.0) if routing is None else (routing["state"], routing["mix_weight"])

    def choose(self, alias: str) -> Choice | None:
        """Where one request goes; None when no backend it may use has a routable instance."""
        for backend in backend_order(*self._state(alias), self.rng.random()):
            candidates = self._instances(alias, backend)
            if candidates:
                # Ties broken at random, so replicas that each count only their own
                # requests do not all pile onto the same instance.
                ranked = sorted(candidates, key=lambda row: (self.inflight.get(row["instance_id"], 0), self.rng.random()))
                return Choice(backend, tuple(ranked))
        return None

    def routable(self, alias: str) -> bool:
        # A draw of 0 lists every backend the state allows (MIXED lists both whatever the weight).
        return any(self._instances(alias, b) for b in backend_order(*self._state(alias), 0.0))

    def acquire(self, instance_id: str) -> None:
        self.inflight[instance_id] = self.inflight.get(instance_id, 0) + 1

    def release(self, instance_id: str) -> None:
        left = self.inflight[instance_id] - 1
        if left:
            self.inflight[instance_id] = left
        else:
            del self.inflight[instance_id]  # instances come and go: keep only those with requests
