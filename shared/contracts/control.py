"""What the controller decides from and what it decides: the snapshot, the decision, the policy state.

`decide(snapshot, now) -> Decision` (package `policy`) is pure code over these
types. The autoscaler builds a snapshot per alias from the log and the bus, the
policy lab builds one from its simulated cluster, and `replay --verify-decisions`
parses one back from a recorded `PolicyDecided` event: the same code decides in
all three.

The types are frozen, slotted dataclasses rather than pydantic models because
a tick builds one per alias and instance (thousands per second at scale) and
nothing here needs validating until it is recorded; `SNAPSHOT` and `DECISION`
are the pydantic adapters that validate and serialise them when it is. The
tick's fast ways to build and change them are in `building.py`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Literal, Union

from pydantic import Field, TypeAdapter

from shared.contracts.backends import Action, BackendType, EngineKind, Role
from shared.contracts.config import AliasConfig, ControllerConfig
from shared.contracts.states import InstanceState, RoutingState

# --------------------------------------------------------------------------- load


@dataclass(frozen=True, slots=True)
class MetricWindow:
    """Per-alias load over one window, as the gateways measure it (seed 000 §6, §12.3).

    Merged over every gateway replica: counts and inflight averages add, and the
    percentiles come from the replicas' merged histograms (see `telemetry.py`).
    `None` means no request in the window gave that measurement.
    """

    window_start: datetime
    window_end: datetime
    requests: int = 0
    """Requests answered in the window (any status)."""
    inflight_fast: float = 0.0
    """Requests on llama.cpp instances, averaged over the window."""
    inflight_slow: float = 0.0
    queue_len: float = 0.0
    """Requests waiting in the gateways (cold-start hold, admission queue), averaged over the window."""
    queue_wait_p95_s: float | None = None
    ttft_p95_s: float | None = None
    e2e_p95_fast_s: float | None = None
    e2e_p95_s: float | None = None
    decode_tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    tbt_p95_s: float | None = None
    capacity_vllm: float | None = None
    extra: dict[str, float] = field(default_factory=dict)
    # Added in events v2 (RoutingStateChanged, MixWeightChanged, ScalingTargetsChanged).
    gateways: int = 0
    """Gateway replicas whose windows were merged into this one."""
    arrivals: int = 0
    requests_fast: int = 0
    requests_slow: int = 0
    errors: int = 0
    """Requests answered with an error, the gateway's or an engine's."""
    errors_slow: int = 0
    timeouts_slow: int = 0
    """vLLM requests that failed to connect or timed out: the 'consecutive timeouts' of §4.1."""
    inflight_peak: float = 0.0
    held: int = 0
    """Requests held at the window's end, waiting for an instance to start or wake."""
    e2e_p95_slow_s: float | None = None

    @property
    def inflight_total(self) -> float:
        return self.inflight_fast + self.inflight_slow

    @property
    def seconds(self) -> float:
        return max(1e-9, (self.window_end - self.window_start).total_seconds())


# --------------------------------------------------------------------------- facts


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance of the alias as the controller sees it: the log's facts plus its worker's latest report."""

    instance_id: str
    backend: BackendType
    engine: EngineKind
    worker_id: str
    state: InstanceState
    state_since: datetime
    sleep_level: int = 0
    capacity: int | None = None
    """Concurrent requests it takes, as its engine reports (llama.cpp: sequence slots; vLLM: KV at max_model_len)."""
    inflight: int = 0
    last_active_at: datetime | None = None
    """The last time its engine had work; None when it never had any (idle since `state_since`)."""
    healthy: bool = True
    """Reported by a live worker recently, and its engine answered."""
    unsupported: frozenset[Action] = frozenset()
    """Actions its worker answered `unsupported`: the controller takes the substitute instead."""
    last_failure: tuple[Action, datetime] | None = None
    """The most recent command that failed on it, and when."""
    role: Role | None = None
    """Prefill or decode, in a disaggregated alias; None otherwise."""

    def idle_since(self) -> datetime:
        return self.last_active_at or self.state_since


@dataclass(frozen=True, slots=True)
class PendingCommand:
    """A command the controller sent whose outcome is not in the log yet."""

    command_id: uuid.UUID
    action: Action
    backend: BackendType
    instance_id: str
    issued_at: datetime
    level: int = 0
    role: Role | None = None
    """The role a start gives its instance."""


# --------------------------------------------------------------------------- policy state


@dataclass(frozen=True, slots=True)
class StartFailure:
    """The latest start of a tier that failed: placement found no worker, or the engine did not come up."""

    instance_id: str
    at: datetime
    reason: str


@dataclass(frozen=True, slots=True)
class TierState:
    """What the shared rules remember about one backend tier of an alias."""

    last_scale_up_at: datetime | None = None
    last_scale_down_at: datetime | None = None
    down_windows: int = 0
    """Consecutive windows in which the policy asked for fewer awake replicas than there are."""
    last_wanted: int = 0
    """The policy's own wish for the tier at the previous tick: a higher wish now is a rebound."""


@dataclass(frozen=True, slots=True)
class HybridState:
    """The hybrid policy's own memory (seed 000): its counters, timers and learned capacities."""

    kind: Literal["hybrid"] = "hybrid"
    up_windows: int = 0
    """Consecutive windows with the warm-up signal (§4.1 item 2, §5.2)."""
    timeout_windows: int = 0
    """Consecutive windows with vLLM timeouts or errors (§4.1 item 6)."""
    ready_probes: int = 0
    """Consecutive healthy probes of a vLLM instance while warming (§4.1 item 3)."""
    warming_since: datetime | None = None
    mix_step_since: datetime | None = None
    low_load_since: datetime | None = None
    """Since when load has stayed low (for VLLM_PRIMARY -> FAST_ONLY)."""
    idle_since: datetime | None = None
    """Since when the alias has had no request at all (for -> COLD)."""
    degraded_at: datetime | None = None
    degraded_reason: str = ""
    demand_at: datetime | None = None
    """When demand reached the alias while it was cold (the start of a cold start)."""
    fast_capacity: int | None = None
    """C_l as last reported by a llama.cpp instance of the alias."""
    vllm_capacity: int | None = None
    """C_vllm as last reported by a vLLM instance of the alias."""


@dataclass(frozen=True, slots=True)
class ScalerState:
    """What the replica-count policies (HeteroScale and the baselines of seed 001) remember."""

    kind: Literal["scaler"] = "scaler"
    demand_at: datetime | None = None
    """When demand reached the alias while it was cold (the start of a cold start)."""
    idle_since: datetime | None = None
    """Since when the alias has had no request at all."""


_NO_TIER_STATE = TierState()

PolicyMemory = Annotated[Union[HybridState, ScalerState], Field(discriminator="kind")]
"""The policy-specific part of the state, told apart by `kind`."""


@dataclass(frozen=True, slots=True)
class PolicyState:
    """Everything a policy carries from one tick to the next: its own memory and the shared rules'."""

    policy: PolicyMemory = field(default_factory=HybridState)  # type: ignore[assignment]
    tiers: dict[BackendType, TierState] = field(default_factory=dict)
    last_window_end: datetime | None = None
    """The newest metric window counted; a window counts once however many ticks see it."""

    def tier(self, backend: BackendType) -> TierState:
        return self.tiers.get(backend) or _NO_TIER_STATE


# --------------------------------------------------------------------------- operators


@dataclass(frozen=True, slots=True)
class OperatorHold:
    """What operators asked of the controller for one alias (`OperatorCommanded` events, the latest of each
    kind standing): a pause, and minimum replicas pinned per tier."""

    paused: str | None = None
    """Who paused the alias and why ("alice: load test until 14:00"): nothing is switched, scaled or
    commanded until it is resumed. None while the controller decides."""
    min_replicas: dict[BackendType, int] = field(default_factory=dict)
    """Per tier, a floor that replaces the configured `min_replicas` (never above `max_replicas`)."""


NO_HOLD = OperatorHold()


# --------------------------------------------------------------------------- snapshot


@dataclass(frozen=True)
class AliasSnapshot:
    """Everything one decision about one alias is made from.

    (Not slotted, unlike the others: it keeps indexes of its instances and commands beside its fields.)
    """

    alias: str
    version: int
    """The alias stream's version when the snapshot was taken: a decision is appended after it,
    and every id the decision makes (its own, its commands', new instances') derives from it."""
    config: AliasConfig
    controller: ControllerConfig
    """The controller's knobs every policy shares (retries, start timeouts); a policy's own are in `config`."""
    routing_state: RoutingState
    routing_since: datetime | None
    mix_weight: float
    """Share of traffic sent to vLLM (0..1)."""
    targets: dict[BackendType, int]
    state: PolicyState
    instances: tuple[InstanceView, ...] = ()
    pending: tuple[PendingCommand, ...] = ()
    metrics: MetricWindow | None = None
    """The newest merged window, None when no gateway has reported one."""
    demand: int = 0
    """Requests the gateways hold for this alias right now, waiting for an instance (the cold-start signal)."""
    start_failures: dict[BackendType, StartFailure] = field(default_factory=dict)
    operator: OperatorHold = NO_HOLD
    """What operators asked of the controller for this alias (a pause, pinned minimum replicas)."""

    @property
    def policy(self) -> str:
        """The policy that decides for this alias (its config's `autoscaling_policy`)."""
        return self.config.autoscaling_policy.name

    def __post_init__(self) -> None:
        # Indexes every decision reads many times, built once (not fields: never recorded).
        grouped: dict[BackendType, list[InstanceView]] = {}
        for i in self.instances:
            grouped.setdefault(i.backend, []).append(i)
        object.__setattr__(self, "_by_backend", {b: tuple(found) for b, found in grouped.items()})
        object.__setattr__(self, "pending_by_instance", {p.instance_id: p for p in self.pending})

    def of(self, backend: BackendType) -> tuple[InstanceView, ...]:
        return self._by_backend.get(backend, ())  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- decision


@dataclass(frozen=True, slots=True)
class RoutingChange:
    from_state: RoutingState
    to_state: RoutingState
    reason: str


@dataclass(frozen=True, slots=True)
class MixChange:
    from_weight: float
    to_weight: float
    reason: str


@dataclass(frozen=True, slots=True)
class PlannedAction:
    """One instance command, in the order the decision lists them (§12.3)."""

    action: Action
    backend: BackendType
    instance_id: str
    command_id: uuid.UUID
    reason: str
    worker_id: str | None = None
    """The instance's worker; None for a start, whose worker placement chooses."""
    level: int = 0
    """Sleep level, for a sleep."""
    substitute_for: Action | None = None
    """The action this one replaces because the backend cannot do it (e.g. a llama.cpp sleep)."""
    role: Role | None = None
    """For a start in a disaggregated alias: the role of the new instance."""


@dataclass(frozen=True, slots=True)
class NextStep:
    """What the controller will do next on its own, and when, if nothing changes."""

    what: str
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class ColdStart:
    """Demand reached the alias while it was cold; this instance was the first to serve."""

    backend: BackendType
    instance_id: str
    demand_at: datetime
    ready_at: datetime


@dataclass(frozen=True, slots=True)
class Decision:
    policy: str
    policy_version: int
    decision_id: uuid.UUID
    targets: dict[BackendType, int]
    targets_reason: str
    state: PolicyState
    """The policy state after this decision."""
    mix_weight: float
    """The share of traffic to vLLM after this decision."""
    routing: RoutingChange | None = None
    mix: MixChange | None = None
    actions: tuple[PlannedAction, ...] = ()
    outlook: tuple[NextStep, ...] = ()
    cold_start: ColdStart | None = None
    roles: dict[Role, int] = field(default_factory=dict)
    """Targets by role of the scaled tier, in a disaggregated alias."""

    def effective(self, snapshot: AliasSnapshot) -> bool:
        """Whether it changes anything and so is recorded; counters alone are not worth a log entry."""
        return bool(self.routing or self.mix or self.actions or self.cold_start or self.targets != snapshot.targets)


SNAPSHOT: TypeAdapter[AliasSnapshot] = TypeAdapter(AliasSnapshot)
DECISION: TypeAdapter[Decision] = TypeAdapter(Decision)
