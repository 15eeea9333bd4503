"""What the replica-count policies share: one scaled tier, COLD until demand, a count computed each tick.

HeteroScale and the baselines of seed 001 (utilization, latency, periodic) size
one tier of the alias (`autoscaling_policy.backend`, default vLLM when the
alias has it) and leave the others empty. Each computes a `Count` from the
snapshot; this module does the rest the same way for all of them:

- routing: COLD until the first demand (or while min_instances is 0 and nothing
  is left and nothing comes), then the scaled tier's serving state
  (VLLM_PRIMARY for vLLM, FAST_ONLY for llama.cpp);
- bounds: min_instances..max_instances, at least one instance (one of each role)
  while there is demand;
- pacing through the shared rules: `scale_out_cooldown` after a scale-out,
  `scale_in_cooldown` after any scaling before a scale-in; surplus instances
  are drained and deleted.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from policy.base import DELETE_AT_ONCE, Pacing, Proposal, Wish
from policy.census import TierCensus, census
from policy.coldstart import first_serving
from policy.load import Load, load_of
from policy.rules import bounded_roles
from shared.contracts.backends import BackendType, Role
from shared.contracts.config import AliasConfig
from shared.contracts.policies import ReplicaPolicyConfig
from shared.contracts.building import evolve
from shared.contracts.control import AliasSnapshot, ColdStart, NextStep, RoutingChange, ScalerState
from shared.contracts.states import RoutingState

R = RoutingState
P, D = Role.PREFILL, Role.DECODE
C = TypeVar("C", bound=ReplicaPolicyConfig)


@dataclass(slots=True)
class Count:
    """What a policy computed for its tier: the instances, by role when disaggregated, and why."""

    replicas: int
    reason: str
    roles: dict[Role, int] | None = None


def scaled_backend(config: AliasConfig, chosen: BackendType | None) -> BackendType:
    if chosen is not None:
        return chosen
    return BackendType.VLLM if BackendType.VLLM in config.backends else BackendType.LLAMA_CPP


def served_inflight(load: Load, backend: BackendType) -> float:
    """Requests on the scaled tier or waiting for a slot on it (the only tier these policies route)."""
    return (load.inflight_slow if backend is BackendType.VLLM else load.inflight_fast) + load.queued


class ReplicaPolicy(ABC, Generic[C]):
    name: str
    version = 2
    """2: a drained instance of an alias whose router binds sessions is deleted after `drain_handoff_s`."""
    config_type: type[C]

    @abstractmethod
    def count(self, s: AliasSnapshot, cfg: C, backend: BackendType, load: Load, c: TierCensus,
              now: datetime) -> Count:
        """The instances the scaled tier should have now, and why."""

    def propose(self, s: AliasSnapshot, now: datetime, new_window: bool) -> Proposal:
        cfg = s.config.autoscaling_policy
        if not isinstance(cfg, self.config_type):
            raise TypeError(f"alias {s.alias}: policy {self.name} needs autoscaling_policy.name {self.name}, "
                            f"got {cfg.name}")
        backend = scaled_backend(s.config, cfg.backend)
        memory = s.state.policy if isinstance(s.state.policy, ScalerState) else ScalerState()
        load = load_of(s)
        c = census(s, backend)
        idle_since = None if load.busy else (memory.idle_since or now)
        serving = R.VLLM_PRIMARY if backend is BackendType.VLLM else R.FAST_ONLY
        standing = cfg.min_instances > 0 or s.config.backends[backend].min_replicas > 0
        routing = None
        state = s.routing_state
        if state is R.COLD and (load.busy or standing):
            why = f"{load.waiting} request(s) waiting" if load.waiting else (
                f"{load.arrivals} request(s) arrived" if load.arrivals else f"min_instances {cfg.min_instances}")
            routing = RoutingChange(state, serving, f"first demand ({why}): {backend.value} takes it")
            memory = evolve(memory, demand_at=now if load.busy else None)
            state = serving
        elif state is serving and not (load.busy or standing or c.supply or c.asleep):
            routing = RoutingChange(state, R.COLD, f"no {backend.value} instance left, no request and min_instances 0")
            state = R.COLD

        if state is R.COLD:
            count = Count(0, "COLD: no instance kept")
        else:
            count = self._bounded(self.count(s, cfg, backend, load, c, now), cfg, load.busy)
        if memory.idle_since != idle_since:
            memory = evolve(memory, idle_since=idle_since)
        cold_start: ColdStart | None = None
        if memory.demand_at is not None:
            cold_start = None if state is R.COLD else first_serving(s, memory.demand_at)
            if cold_start or state is R.COLD:
                memory = evolve(memory, demand_at=None)
        pacing = Pacing(cfg.scale_out_cooldown, cfg.scale_in_cooldown, down_after_any=True)
        wishes = {b: Wish(0, f"not scaled by {self.name}", DELETE_AT_ONCE, pacing) for b in s.config.backends}
        wishes[backend] = Wish(count.replicas, count.reason, DELETE_AT_ONCE, pacing, roles=count.roles)
        outlook = () if state is R.COLD else (NextStep(f"{self.name} sizes {backend.value} each window"),)
        return Proposal(wishes=wishes, memory=memory, mix_weight=1.0 if state is R.VLLM_PRIMARY else 0.0,
                        routing=routing, outlook=outlook, cold_start=cold_start)

    @staticmethod
    def _bounded(count: Count, cfg: ReplicaPolicyConfig, busy: bool) -> Count:
        floor = max(cfg.min_instances, 1 if busy else 0)
        if count.roles is not None and floor:
            floor = max(floor, 2)  # a disaggregated pool serves nothing without one of each role
        n = min(max(count.replicas, floor), cfg.max_instances)
        if count.roles is None:
            if n == count.replicas:
                return count
            return Count(n, f"{count.reason}; bounded to {floor}..{cfg.max_instances} -> {n}")
        roles = count.roles
        if n != count.replicas:
            roles = bounded_roles(roles, n) if count.replicas else {P: 1, D: max(0, n - 1)}
        if n >= 2 and (roles.get(P, 0) == 0 or roles.get(D, 0) == 0):  # a disaggregated pool needs both roles
            smaller = P if roles.get(P, 0) == 0 else D
            roles = {**roles, smaller: 1, (D if smaller is P else P): n - 1}
        if roles == count.roles:
            return count
        return Count(n, f"{count.reason}; bounded to {floor}..{cfg.max_instances} -> "
                        f"{roles.get(P, 0)}P+{roles.get(D, 0)}D", roles)


def grown(n: int, factor: float) -> int:
    """`n` times `factor`, rounded up (so one instance grows too), without float dust (10 x 1.2 is 12)."""
    return math.ceil(round(n * factor, 9))


def nearest(x: float) -> int:
    """Round half up (Python's round() goes to even)."""
    return math.floor(x + 0.5)
