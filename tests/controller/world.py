"""A small deterministic world for stepping the controller tick by tick on a fake clock.

It holds what the autoscaler would gather (routing state, instances, pending
commands) and plays the workers' part with the workers' own rule of what a
command does (`shared.contracts.effects`): commands take effect after the delays
it is given, or fail, or get lost. Tests feed it metric windows and assert on the
decisions `policy.decide` makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from policy import decide
from shared.contracts.backends import Action, BackendType, EngineKind
from shared.contracts.config import AliasConfig, ControllerConfig
from shared.contracts.control import (
    AliasSnapshot,
    Decision,
    InstanceView,
    MetricWindow,
    OperatorHold,
    PendingCommand,
    PolicyState,
    StartFailure,
)
from shared.contracts.effects import EngineStep, effect_of
from shared.contracts.policies import HybridPolicyConfig
from shared.contracts.states import (
    IllegalTransition,
    InstanceState,
    RoutingState,
    check_instance_transition,
    check_routing_transition,
)

FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM
S, R = InstanceState, RoutingState
T0 = datetime(2026, 11, 23, 8, 0, tzinfo=timezone.utc)


def alias_config(fast: tuple[int, int] | None = (0, 2), slow: tuple[int, int] | None = (0, 1), **extra: Any) -> AliasConfig:
    backends: dict[str, Any] = {}
    if fast:
        backends["llama.cpp"] = {"model_name": "m", "model_path": "default", "gpu_memory_gb": 0,
                                 "min_replicas": fast[0], "max_replicas": fast[1], "engine": "simulator"}
    if slow:
        backends["vllm"] = {"model_name": "m", "model_path": "m", "gpu_memory_gb": 12, "min_replicas": slow[0],
                            "max_replicas": slow[1], "max_model_len": 4096, "engine": "simulator"}
    return AliasConfig.model_validate({"alias": "a", "backends": backends, **extra})


def with_hybrid(config: AliasConfig, **params: Any) -> AliasConfig:
    """`config` under the hybrid policy with `params` (HybridPolicyConfig's fields)."""
    return config.model_copy(update={"autoscaling_policy": HybridPolicyConfig(**params)})


@dataclass
class Delays:
    start: dict[BackendType, float] = field(default_factory=lambda: {FAST: 2.0, SLOW: 40.0})
    wake: float = 1.0


@dataclass
class World:
    config: AliasConfig = field(default_factory=alias_config)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    delays: Delays = field(default_factory=Delays)
    capacity: dict[BackendType, int] = field(default_factory=lambda: {FAST: 4, SLOW: 38})
    now: datetime = T0
    routing: RoutingState = R.COLD
    routing_since: datetime | None = None
    mix_weight: float = 0.0
    targets: dict[BackendType, int] = field(default_factory=dict)
    state: PolicyState = field(default_factory=PolicyState)
    version: int = 1
    instances: dict[str, InstanceView] = field(default_factory=dict)
    pending: dict[str, PendingCommand] = field(default_factory=dict)
    start_failures: dict[BackendType, StartFailure] = field(default_factory=dict)
    operator: OperatorHold = field(default_factory=OperatorHold)
    decisions: list[Decision] = field(default_factory=list)
    # The workers' side
    ready_at: dict[str, datetime] = field(default_factory=dict)
    fail_starts: set[BackendType] = field(default_factory=set)
    lose_commands: bool = False
    unsupported: dict[tuple[BackendType, Action], bool] = field(default_factory=dict)
    commands_sent: list[tuple[Action, str]] = field(default_factory=list)

    # ------------------------------------------------------------------ the controller's side

    def snapshot(self, metrics: MetricWindow | None = None, demand: int = 0) -> AliasSnapshot:
        return AliasSnapshot(
            alias=self.config.alias, version=self.version, config=self.config, controller=self.controller,
            routing_state=self.routing, routing_since=self.routing_since, mix_weight=self.mix_weight,
            targets=dict(self.targets), state=self.state,
            instances=tuple(sorted(self.instances.values(), key=lambda i: i.instance_id)),
            pending=tuple(sorted(self.pending.values(), key=lambda p: str(p.command_id))),
            metrics=metrics, demand=demand, start_failures=dict(self.start_failures), operator=self.operator,
        )

    def tick(self, seconds: float = 0.0, metrics: MetricWindow | None = None, demand: int = 0) -> Decision:
        """Advance the clock, let the workers act, then decide once and apply the decision."""
        self.now += timedelta(seconds=seconds)
        self._workers_act()
        snapshot = self.snapshot(metrics, demand)
        decision = decide(snapshot, self.now)
        self.decisions.append(decision)
        if decision.routing:
            check_routing_transition(decision.routing.from_state, decision.routing.to_state)
            self.routing, self.routing_since = decision.routing.to_state, self.now
        self.mix_weight = decision.mix_weight
        self.state = decision.state
        if decision.effective(snapshot):
            self.version += 1 + bool(decision.routing) + bool(decision.mix)  # as the autoscaler appends them
            self.targets = dict(decision.targets)
        for action in decision.actions:
            self.pending[action.instance_id] = PendingCommand(action.command_id, action.action, action.backend,
                                                             action.instance_id, self.now, action.level, action.role)
            self.commands_sent.append((action.action, action.instance_id))
        return decision

    # ------------------------------------------------------------------ the workers' side

    def _workers_act(self) -> None:
        for instance_id, ready in list(self.ready_at.items()):
            inst = self.instances.get(instance_id)
            if inst and self.now >= ready:
                target = S.RUNNING
                if inst.state is S.STARTING and inst.backend in self.fail_starts:
                    target = S.ERROR
                self._set(inst, target, sleep_level=0)
                del self.ready_at[instance_id]
                if target is S.ERROR:
                    self.start_failures[inst.backend] = StartFailure(instance_id, self.now, "engine exited with code 1")
        if self.lose_commands:
            return
        for cmd in list(self.pending.values()):
            if cmd.issued_at >= self.now:
                continue  # sent this very tick: not handled yet
            self._handle(cmd)

    def _handle(self, cmd: PendingCommand) -> None:
        """As a worker does (`shared.contracts.effects`), with no time taken but a start's."""
        inst = self.instances.get(cmd.instance_id)
        del self.pending[cmd.instance_id]
        try:
            effect = effect_of(cmd.action, cmd.backend, inst.state if inst else S.ABSENT, cmd.level)
        except IllegalTransition:
            # A command the instance's state no longer allows is rejected (a cancel that
            # arrives after the start finished, say); the controller decides again.
            return
        if self.unsupported.get((cmd.backend, cmd.action)):
            self.instances[cmd.instance_id] = replace(inst, unsupported=inst.unsupported | {cmd.action})
            return
        match effect.step:
            case EngineStep.SPAWN:
                self.instances[cmd.instance_id] = InstanceView(cmd.instance_id, cmd.backend, EngineKind.SIMULATOR, "w1",
                                                               effect.accepted, self.now, capacity=None, role=cmd.role)
                self.ready_at[cmd.instance_id] = self.now + timedelta(seconds=self.delays.start[cmd.backend])
            case EngineStep.WAKE | EngineStep.SLEEP:
                self._set(inst, effect.done, sleep_level=effect.sleep_level)
            case EngineStep.WAIT_IDLE:
                self._set(inst, effect.accepted)
            case EngineStep.STOP:
                del self.instances[cmd.instance_id]
                self.ready_at.pop(cmd.instance_id, None)

    def _set(self, inst: InstanceView, state: InstanceState, **fields: Any) -> None:
        check_instance_transition(inst.backend, inst.state, state)
        capacity = self.capacity[inst.backend] if state is S.RUNNING else inst.capacity
        self.instances[inst.instance_id] = replace(inst, state=state, state_since=self.now, capacity=capacity, **fields)

    # ------------------------------------------------------------------ helpers for tests

    def put(self, instance_id: str, backend: BackendType, state: InstanceState = S.RUNNING, **fields: Any) -> InstanceView:
        """Place an instance in the world as if it had got there on its own."""
        fields.setdefault("capacity", self.capacity[backend] if state is S.RUNNING else None)
        fields.setdefault("sleep_level", {S.SLEEP_1: 1, S.SLEEP_2: 2}.get(state, 0))
        inst = InstanceView(instance_id, backend, EngineKind.SIMULATOR, "w1", state, fields.pop("since", self.now), **fields)
        self.instances[instance_id] = inst
        return inst

    def at(self, routing: RoutingState, mix_weight: float | None = None) -> "World":
        self.routing, self.routing_since = routing, self.now
        self.mix_weight = mix_weight if mix_weight is not None else {R.VLLM_PRIMARY: 1.0, R.MIXED: 0.2}.get(routing, 0.0)
        return self

    def set_load(self, instance_id: str, inflight: int) -> None:
        inst = self.instances[instance_id]
        active = self.now if inflight else (inst.last_active_at or self.now)
        self.instances[instance_id] = replace(inst, inflight=inflight, last_active_at=active)

    def of(self, backend: BackendType, *states: InstanceState) -> list[InstanceView]:
        return sorted((i for i in self.instances.values() if i.backend is backend and (not states or i.state in states)),
                      key=lambda i: i.instance_id)

    def window(self, seconds: float = 2.0, **fields: Any) -> MetricWindow:
        return MetricWindow(window_start=self.now - timedelta(seconds=seconds), window_end=self.now, gateways=1, **fields)

    def run(self, seconds: float, step: float = 2.0, **fields: Any) -> list[Decision]:
        """Tick every `step` seconds for `seconds`, each with a fresh window of the same load."""
        out = []
        for _ in range(int(round(seconds / step))):
            self.now += timedelta(seconds=step)
            out.append(self.tick(0, self.window(step, **fields)))
        return out
