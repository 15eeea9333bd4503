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
class Slot:
    """One request's place on an instance: taken from the router's count, given back with `Router.release`."""

    backend: BackendType
    instance: dict[str, Any]

    @property
    def instance_id(self) -> str:
        return self.instance["instance_id"]


def _has_room(row: dict[str, Any], inflight: int) -> bool:
    capacity = row.get("capacity")
    return not capacity or inflight < capacity  # an instance that has not said its capacity takes what comes


class Router:
    """Picks instances from the live view and counts what this gateway has in flight on each.

    An instance takes at most its reported capacity of this gateway's requests at
    once (`take` answers None when every instance the routing state allows is
    full; admission queues the request). The count is the gateway's own: with
    several replicas each balances its own share, which evens out the total, and
    each may fill an instance to its capacity, the engine queueing the excess.
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

    def state(self, alias: str) -> tuple[str, float]:
        routing = self.view[ROUTING].get(alias)
        return ("COLD", 0.0) if routing is None else (routing["state"], routing["mix_weight"])

    def take(self, alias: str) -> Slot | None:
        """A slot for one request of `alias`, or None when no instance it may use has room."""
        for backend in backend_order(*self.state(alias), self.rng.random()):
            slot = self.take_in(alias, backend)
            if slot is not None:
                return slot
        return None

    def take_in(self, alias: str, backend: BackendType, exclude: frozenset[str] = frozenset()) -> Slot | None:
        """A slot on the instance of `backend` with the fewest requests in flight from here, if one has room."""
        best, best_key = None, None
        for row in self._instances(alias, backend):
            instance_id = row["instance_id"]
            inflight = self.inflight.get(instance_id, 0)
            if instance_id in exclude or not _has_room(row, inflight):
                continue
            # Ties broken at random, so replicas that each count only their own
            # requests do not all pile onto the same instance.
            key = (inflight, self.rng.random())
            if best_key is None or key < best_key:
                best, best_key = row, key
        if best is None:
            return None
        self.inflight[best["instance_id"]] = self.inflight.get(best["instance_id"], 0) + 1
        return Slot(backend, best)

    def routable(self, alias: str) -> bool:
        """Whether any instance the routing state allows is running, full or not."""
        # A draw of 0 lists every backend the state allows (MIXED lists both whatever the weight).
        return any(self._instances(alias, b) for b in backend_order(*self.state(alias), 0.0))

    def release(self, slot: Slot) -> None:
        instance_id = slot.instance_id
        left = self.inflight[instance_id] - 1
        if left:
            self.inflight[instance_id] = left
        else:
            del self.inflight[instance_id]  # instances come and go: keep only those with requests
