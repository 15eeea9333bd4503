"""The simulated cluster: one alias's instances, workers, gateway and controller, in virtual time.

Everything that decides is the pool's own code, imported, never copied:
- the controller: `policy.decide` every `tick_s`, on a snapshot built the way
  the autoscaler builds it (instances, commands in flight, the newest metric
  window, held demand, start failures), its commands applied with the tiers'
  delays (a start takes `startup_s`, a wake `wake_l1_s`/`wake_l2_s`, a drain
  waits for the instance's requests);
- placement: `policy.placement.place` over the simulated workers;
- the gateway: `routing.backends.backend_order` picks the backend by routing
  state and mix weight, the alias's router plugin (`routing.registry`) picks
  the instance; a request that finds no room waits in the gateway's own
  admission queue (`routing.queue`: `queue_size`, `queue_timeout_s`), sessions
  and all.

What is modelled rather than run: each instance is `lab.instance.LabInstance`
(seed 002's batch timing at event level), and in a disaggregated alias a
request is prefilled on a prefill instance and decoded on a decode instance,
its KV handed over at once.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from lab.config import LabSettings
from lab.instance import LabInstance, TierModel
from lab.outcomes import LogLine, RequestResult, WindowSample
from lab.record import RunRecord, Transition, WindowRecord
from policy import decide
from policy.placement import Placed, PlacementRequest, WorkerView, place
from routing.backends import backend_order, taking_new
from routing.queue import AdmissionQueue, AdmissionQueueFull
from routing.registry import build_scheduler
from routing.scheduler import Endpoint, RoutingRequest, SessionState
from shared.contracts.backends import Action, BackendType, EngineKind, Role
from shared.contracts.building import new_snapshot
from shared.contracts.config import AliasConfig, ControllerConfig
from shared.contracts.control import (
    Decision,
    InstanceView,
    MetricWindow,
    PendingCommand,
    PlannedAction,
    PolicyState,
    StartFailure,
)
from shared.contracts.effects import CommandEffect, EngineStep, effect_of
from shared.contracts.states import IllegalTransition, InstanceState, RoutingState
from shared.contracts.telemetry import InstanceStatus, merge_windows
from shared.contracts.trace import TraceRequest
from shared.metering import AliasMeter, RequestOutcome, RequestTrace
from shared.projections.rows import InstanceRow
from shared.projections.snapshot import instance_view

S, R = InstanceState, RoutingState
FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM
EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)
"""Virtual time 0: a midnight, so a periodic schedule's time of day is the trace's."""
SERVING = (S.RUNNING,)
# Event kinds, in the order simultaneous events are handled.
READY, COMPLETE, TURN, WINDOW, TICK = range(5)


@dataclass(slots=True, eq=False)
class LabRequest:
    session: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    queued_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    decoding: bool = False
    """Past its prefill on a prefill instance, waiting for or on a decode instance."""
    trace: RequestTrace | None = None
    """Its moments in the alias's metric window, as the gateway records them."""


@dataclass
class Window:
    """What the lab measures of the current metric window beyond what the controller is given (`self.meter`): for
    the calibration record and the objective."""

    start: float
    e2e_total: float = 0.0
    inflight_fast_s: float = 0.0
    inflight_slow_s: float = 0.0
    running_fast_s: float = 0.0
    running_slow_s: float = 0.0
    decoded_by: dict[BackendType, float] = field(default_factory=lambda: {FAST: 0.0, SLOW: 0.0})


class Cluster:
    def __init__(self, alias: AliasConfig, controller: ControllerConfig, tiers: dict[BackendType, TierModel],
                 lab: LabSettings, trace: list[TraceRequest], *, progress: Callable[[float], None] | None = None,
                 on_decision: Callable[[float, Decision], None] | None = None) -> None:
        self.alias = alias
        self.controller = controller
        self.tiers = tiers
        self.lab = lab
        self.rng = random.Random(lab.seed)
        self.scheduler = build_scheduler(alias.router, random.Random(lab.seed + 1))
        self.progress = progress
        self.on_decision = on_decision
        # Controller state, as the log would hold it.
        self.routing = alias.routing_state
        self.routing_since: float | None = None
        self.mix_weight = 0.0
        self.targets: dict[BackendType, int] = {}
        self.state = PolicyState()
        self.version = 0
        self.pending: dict[str, PendingCommand] = {}
        self.start_failures: dict[BackendType, StartFailure] = {}
        self.last_window: MetricWindow | None = None
        # The cluster.
        self.instances: dict[str, LabInstance] = {}
        self.workers = {f"w{k:02}": [] for k in range(lab.workers)}  # worker -> instance ids
        self.queue: AdmissionQueue[LabRequest, bool] = AdmissionQueue(alias.alias, lab.queue_size)
        self.sessions: dict[str, SessionState] = {}
        self.events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        # The trace: first turns open loop, later turns after their previous answer and tool time.
        self.first_turns: list[TraceRequest] = []
        self.later: dict[str, deque[TraceRequest]] = {}
        for r in trace:
            if r.turn == 0:
                self.first_turns.append(r)
            else:
                self.later.setdefault(r.session_id, deque()).append(r)
        self.first_turns.sort(key=lambda r: r.delay_s)
        self.context: dict[str, int] = {}
        """Each session's context so far (its prompts and answers)."""
        # Measurements.
        self.served: list[RequestResult] = []
        self.samples: list[WindowSample] = []
        self.log: list[LogLine] = []
        self.commands = 0
        self.session_moves = 0
        self.memory_gb = 0.0
        self.memory_gb_s = 0.0
        self._level_at = 0.0
        self._inflight = {FAST: 0, SLOW: 0}
        self._running = {FAST: 0, SLOW: 0}
        self.now = 0.0
        """Virtual time of the event being handled: the clock of the alias's metric window."""
        self.meter = AliasMeter(self.clock)
        """The alias's metric window, added up as the gateway adds it up: the controller's input."""
        self.window = Window(0.0)
        self._actions_in_window = 0
        self._turns_due = 0
        self._serving: dict[tuple[BackendType, Role | None], list[LabInstance]] | None = None
        """Running instances by backend and role, rebuilt after any instance changes state."""
        self._views: dict[str, tuple[tuple[int, InstanceState, int], InstanceView]] = {}
        self.record = RunRecord(alias.model_dump(mode="json"))

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        end_of_trace = self.first_turns[-1].delay_s if self.first_turns else 0.0
        self._push(self.lab.window_s, WINDOW, None)
        self._push(0.0, TICK, None)
        arrivals = self.first_turns
        i, n = 0, len(arrivals)
        next_progress = 0.0
        while True:
            t_arrival = arrivals[i].delay_s if i < n else math.inf
            t_event = self.events[0][0] if self.events else math.inf
            now = min(t_arrival, t_event)
            if now == math.inf:
                break
            if self.progress and now >= next_progress:
                self.progress(now)
                next_progress = now + 60.0
            self.now = now
            if t_arrival <= t_event:
                self._arrive(arrivals[i], arrivals[i].delay_s)
                i += 1
                continue
            t, _, kind, payload = heapq.heappop(self.events)
            if kind == COMPLETE:
                self._complete(payload, t)  # type: ignore[arg-type]
            elif kind == READY:
                self._ready(payload, t)  # type: ignore[arg-type]
            elif kind == TURN:
                self._turns_due -= 1
                self._arrive(payload, t)  # type: ignore[arg-type]
            elif kind == WINDOW:
                self._close_window(t)
                if self._active(i, n, t, end_of_trace):
                    self._push(t + self.lab.window_s, WINDOW, None)
            elif kind == TICK:
                self._tick(t)
                if self._active(i, n, t, end_of_trace):
                    self._push(t + self.lab.tick_s, TICK, None)
        self.now = max(self._level_at, end_of_trace)
        self._level(self.now)
        for r in list(self.queue.waiting):
            self.queue.leave(r)
            self.meter.add_held(-1)
            self._lose(r, "unanswered at the end of the run", RequestOutcome.LEFT, self.now)

    def _active(self, i: int, n: int, t: float, end_of_trace: float) -> bool:
        """Ticks and windows go on while requests are due or in flight, then `drain_s` longer for scale-down."""
        busy = i < n or self.queue or self._turns_due or any(inst.jobs for inst in self.instances.values())
        return bool(busy) or t < end_of_trace + self.lab.drain_s

    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        if kind == TURN:
            self._turns_due += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload))

    # ------------------------------------------------------------------ levels (time integrals)

    def _level(self, now: float) -> None:
        dt = now - self._level_at
        if dt <= 0:
            return
        w = self.window
        w.inflight_fast_s += self._inflight[FAST] * dt
        w.inflight_slow_s += self._inflight[SLOW] * dt
        w.running_fast_s += self._running[FAST] * dt
        w.running_slow_s += self._running[SLOW] * dt
        self.memory_gb_s += self.memory_gb * dt
        self._level_at = now

    def _memory_changed(self, now: float, delta: float) -> None:
        self._level(now)
        self.memory_gb = max(0.0, self.memory_gb + delta)

    # ------------------------------------------------------------------ requests

    def _arrive(self, r: TraceRequest, now: float) -> None:
        self._level(now)
        prompt = self.context.get(r.session_id, 0) + r.new_input_tokens
        self.context[r.session_id] = prompt + r.output_tokens
        req = LabRequest(r.session_id, now, prompt, r.output_tokens, queued_at=now,
                         trace=RequestTrace(self.meter, self.clock))
        try:
            self._admit_or_queue(req, now)
        except AdmissionQueueFull:
            self._lose(req, "queue full (429)", RequestOutcome.QUEUE_FULL, now)

    def clock(self) -> float:
        return self.now

    def _admit_or_queue(self, req: LabRequest, now: float, readmitted: bool = False) -> None:
        """A slot now, or a place in the queue (counted as held, as the gateway counts its waiters)."""
        if self.queue.admit(req, now, self._taker(now), self.scheduler.per_session, readmitted) is None:
            self.meter.add_held(1)

    def _serving_by(self) -> dict[tuple[BackendType, Role | None], list[LabInstance]]:
        if self._serving is None:
            serving: dict[tuple[BackendType, Role | None], list[LabInstance]] = {}
            for inst in self.instances.values():
                if inst.state is S.RUNNING:
                    serving.setdefault((inst.backend, inst.role), []).append(inst)
                    if inst.role is not None:
                        serving.setdefault((inst.backend, Role.DECODE), [])
                        serving.setdefault((inst.backend, Role.PREFILL), [])
            for (backend, role), found in serving.items():
                if role is None:  # as the gateway: a tier's surplus takes nothing new
                    serving[(backend, role)] = taking_new(found, self.targets.get(backend), _running_since)
            self._serving = serving
        return self._serving

    def _route(self, req: LabRequest, now: float) -> bool:
        """Place `req` on an instance if one may take it now."""
        order = backend_order(self.routing, self.mix_weight, self.rng.random())
        serving = self._serving_by()
        for backend in order:
            role = (Role.DECODE if req.decoding else Role.PREFILL) if (backend, Role.PREFILL) in serving else None
            candidates = serving.get((backend, role))
            if not candidates:
                continue
            if self.scheduler.reads_cache:
                endpoints = [Endpoint(i.instance_id, len(i.jobs), len(i.jobs) >= i.model.capacity,
                                      i.pending_prefill(now), i.cached_for(req.session, req.prompt_tokens))
                             for i in candidates]
            else:
                endpoints = [i.endpoint(now) for i in candidates]
            session = self.sessions.get(req.session) or SessionState(req.session)
            choice = self.scheduler.choose(RoutingRequest(session, req.prompt_tokens, now), endpoints)
            if choice is None:
                continue
            if self.scheduler.binds_sessions:
                moved = choice.moved_from is not None
                self.session_moves += moved
                self.sessions[req.session] = SessionState(
                    req.session, choice.instance_id, now if moved else session.moved_at, req.prompt_tokens)
            self._admit(req, self.instances[choice.instance_id], now, role)
            return True
        return False

    def _admit(self, req: LabRequest, inst: LabInstance, now: float, role: Role | None) -> None:
        if req.admitted_at is None:
            req.admitted_at = now
            req.trace.dispatched(inst.backend)  # type: ignore[union-attr]
        output = 1 if role is Role.PREFILL else (req.output_tokens - 1 if role is Role.DECODE else req.output_tokens)
        job, generated = inst.admit(req, req.session, req.prompt_tokens, max(1, output), now,
                                    prefilled=role is Role.DECODE)
        self._generated(inst, generated)
        self._inflight[inst.backend] += 1
        self._schedule_completion(inst)

    def _generated(self, inst: LabInstance, tokens: float) -> None:
        self.window.decoded_by[inst.backend] += tokens

    def _schedule_completion(self, inst: LabInstance) -> None:
        at = inst.next_completion()
        if at is not None:
            self._push(at, COMPLETE, (inst, inst.version))

    def _complete(self, payload: tuple[LabInstance, int], now: float) -> None:
        inst, version = payload
        if inst.version != version or inst.instance_id not in self.instances:
            return  # stale: the instance's schedule moved since
        self._level(now)
        done, generated = inst.complete_due(now)
        self._generated(inst, generated)
        for job in done:
            req: LabRequest = job.request  # type: ignore[assignment]
            if inst.role is not Role.DECODE:
                req.first_token_at = job.first_token_at  # final now: later arrivals may have joined its batch
            self._inflight[inst.backend] -= 1
            inst.served += 1
            if inst.role is Role.PREFILL:  # prefilled: on to a decode instance, KV handed over
                req.decoding = True
                req.queued_at = now
                self._admit_or_queue(req, now, readmitted=True)  # admitted once: it does not queue behind new arrivals
                continue
            inst.remember(req.session, req.prompt_tokens + req.output_tokens)
            self._answer(req, now, inst.backend)
        self._schedule_completion(inst)
        if done:
            self._pump(now)
            self._drained(inst, now)

    def _answer(self, req: LabRequest, now: float, backend: BackendType) -> None:
        first = req.first_token_at if req.first_token_at is not None else now
        ttft = first - req.arrival
        e2e = now - req.arrival
        tbt = (now - first) / (req.output_tokens - 1) if req.output_tokens > 1 else None
        wait = (req.admitted_at or now) - req.arrival
        self.served.append(RequestResult(req.arrival, ttft, e2e, tbt, backend.value, wait, session=req.session))
        trace = req.trace
        assert trace is not None
        trace.content(1, first)  # the answer as the gateway reads it: the first token, then the rest
        if req.output_tokens > 1:
            trace.content(req.output_tokens - 1, now)
        trace.finished(RequestOutcome.OK, (req.prompt_tokens, req.output_tokens))
        self.window.e2e_total += e2e
        following = self.later.get(req.session)
        if following:
            turn = following.popleft()
            self._push(now + turn.delay_s, TURN, turn)

    def _lose(self, req: LabRequest, reason: str, outcome: RequestOutcome, now: float) -> None:
        self.served.append(RequestResult(req.arrival, None, None, None, None, now - req.arrival, reason, req.session))
        req.trace.finished(outcome, None)  # type: ignore[union-attr]
        self.later.pop(req.session, None)  # the agent gives up on its session

    def _pump(self, now: float) -> None:
        """Slots freed or instances came up: requests past their queue timeout leave, the rest go head first."""
        timeout = self.lab.queue_timeout_s
        self._level(now)
        for req in [r for r in self.queue.waiting if now - r.queued_at > timeout]:
            self.queue.leave(req)
            self.meter.add_held(-1)
            self._lose(req, "queue timeout (408)", RequestOutcome.QUEUE_TIMEOUT, now)
        granted = self.queue.pump(now, self._taker(now), self.scheduler.per_session)
        if granted:
            self.meter.add_held(-len(granted))

    def _taker(self, now: float) -> Callable[[LabRequest], bool | None]:
        """The queue's scheduler: places a request (True) if an instance may take it now."""
        return lambda req: self._route(req, now) or None

    # ------------------------------------------------------------------ instances

    def _ready(self, payload: tuple[str, int], now: float) -> None:
        instance_id, version = payload
        inst = self.instances.get(instance_id)
        if inst is None or inst.ready_at is None or inst.version != version:
            return
        inst.ready_at = None
        self._moved(inst, S.RUNNING, now)
        inst.sleep_level = 0
        self._serving = None
        inst.t_ref = inst.busy_until = now
        self.pending.pop(instance_id, None)  # a wake is done
        self._pump(now)

    def _drained(self, inst: LabInstance, now: float) -> None:
        command = self.pending.get(inst.instance_id)
        if command is not None and command.action is Action.DRAIN and not inst.jobs:
            del self.pending[inst.instance_id]  # the drain is done: the controller deletes it next

    def _apply(self, a: PlannedAction, now: float) -> None:
        """Carry out a command as a worker does (`shared.contracts.effects`), with the tiers' delays: a command the
        instance's state no longer allows is rejected, and the controller decides again."""
        self.commands += 1
        self._actions_in_window += 1
        inst = self.instances.get(a.instance_id)
        try:
            effect = effect_of(a.action, a.backend, inst.state if inst else S.ABSENT, a.level or 0)
        except IllegalTransition:
            return
        if effect.step is EngineStep.SPAWN:
            self._start(a, effect, now)
            return
        assert inst is not None
        model = inst.model
        match effect.step:
            case EngineStep.WAKE:  # RUNNING when the wake is done (`_ready`)
                delay = model.wake_l2_s if inst.sleep_level == 2 else model.wake_l1_s
                self._memory_changed(now, model.memory_gb - model.sleep_memory_gb)
                inst.ready_at = now + delay
                inst.version += 1
                self.pending[inst.instance_id] = PendingCommand(a.command_id, a.action, a.backend, a.instance_id, _at(now))
                self.record.wakes.append((now, inst.instance_id))
                self._push(now + delay, READY, (inst.instance_id, inst.version))
            case EngineStep.SLEEP:
                if inst.state is S.RUNNING:
                    self._memory_changed(now, model.sleep_memory_gb - model.memory_gb)
                self._moved(inst, effect.done, now)  # type: ignore[arg-type]
                inst.sleep_level = effect.sleep_level
                self._serving = None
            case EngineStep.WAIT_IDLE:
                self._moved(inst, effect.accepted, now)  # type: ignore[arg-type]
                self._serving = None
                if inst.jobs:
                    self.pending[inst.instance_id] = PendingCommand(a.command_id, a.action, a.backend, a.instance_id,
                                                                    _at(now))
            case EngineStep.STOP:
                self._memory_changed(now, -inst.memory_gb())
                for _, _, job in inst.jobs:  # a cancelled start or a forced delete: its requests go back to the queue
                    self._inflight[inst.backend] -= 1
                    self.queue.requeue(job.request)  # type: ignore[arg-type]
                self.meter.add_held(1)
                inst.jobs.clear()
                inst.version += 1
                del self.instances[inst.instance_id]
                self._views.pop(inst.instance_id, None)
                self._moved(inst, effect.accepted, now)  # type: ignore[arg-type]
                self._moved(inst, effect.done, now)  # type: ignore[arg-type]
                self._serving = None
                self.workers[inst.worker_id].remove(inst.instance_id)
                self.pending.pop(inst.instance_id, None)

    def _start(self, a: PlannedAction, effect: CommandEffect, now: float) -> None:
        model = self.tiers[a.backend]
        views = [WorkerView(w, self.lab.worker_gpu_memory_gb, self.lab.worker_slots, frozenset(EngineKind),
                            instances=tuple(Placed(i, self.alias.alias, self.instances[i].backend,
                                                   self.instances[i].model.memory_gb) for i in ids))
                 for w, ids in self.workers.items()]
        placed = place(PlacementRequest(self.alias.alias, a.backend, EngineKind.SIMULATOR, model.memory_gb), views)
        if placed.worker_id is None:
            self.start_failures[a.backend] = StartFailure(a.instance_id, _at(now), placed.reason)
            return
        inst = LabInstance(a.instance_id, a.backend, placed.worker_id, model, S.ABSENT, now, role=a.role,
                           ready_at=now + model.startup_s, t_ref=now, busy_until=now)
        self.instances[a.instance_id] = inst
        self._moved(inst, effect.accepted, now)  # type: ignore[arg-type]
        self.workers[placed.worker_id].append(a.instance_id)
        self._memory_changed(now, model.memory_gb)
        self._push(now + model.startup_s, READY, (inst.instance_id, inst.version))

    # ------------------------------------------------------------------ the controller

    def _view(self, inst: LabInstance) -> InstanceView:
        """The instance as the controller sees it, rebuilt only when it changed since the last tick."""
        key = (inst.version, inst.state, inst.sleep_level)
        cached = self._views.get(inst.instance_id)
        if cached is not None and cached[0] == key:
            return cached[1]
        view = self._new_view(inst)
        self._views[inst.instance_id] = (key, view)
        return view

    def _new_view(self, inst: LabInstance) -> InstanceView:
        """The instance's row as the log would have it and its status as its worker would report it (capacity once the
        engine has said it, kept while asleep), read by the autoscaler's own rules (`instance_view`)."""
        capacity = inst.model.capacity if inst.state is S.RUNNING or inst.sleep_level else None
        row = InstanceRow(inst.instance_id, self.alias.alias, inst.backend, EngineKind.SIMULATOR, inst.worker_id,
                          inst.state, inst.sleep_level, 0, capacity, None, None, inst.role, "", _at(inst.since))
        reported = InstanceStatus(
            instance_id=inst.instance_id, alias=self.alias.alias, backend_type=inst.backend, engine=EngineKind.SIMULATOR,
            status=inst.state, sleep_level=inst.sleep_level, inflight_requests=inst.inflight, capacity=capacity,
            last_active_at=_at(inst.last_active) if inst.last_active is not None else None)
        return instance_view(row, reported, worker_up=True, fresh=True, note=None)

    def _tick(self, now: float) -> None:
        self._level(now)
        held = len(self.queue) if not self._routable() else 0
        snapshot = new_snapshot(
            alias=self.alias.alias, version=self.version, config=self.alias, controller=self.controller,
            routing_state=self.routing, routing_since=_at(self.routing_since) if self.routing_since is not None else None,
            mix_weight=self.mix_weight, targets=dict(self.targets), state=self.state,
            instances=tuple(self._view(i) for _, i in sorted(self.instances.items())),
            pending=tuple(self.pending.values()), metrics=self.last_window, demand=held,
            start_failures=dict(self.start_failures),
        )
        decision = decide(snapshot, _at(now))
        self.state = decision.state
        if decision.routing:
            self.log.append(LogLine(now, "routing_switch", decision.routing.to_state.value,
                                    f"{decision.routing.from_state.value}->{decision.routing.to_state.value}",
                                    decision.routing.reason))
            self.routing, self.routing_since = decision.routing.to_state, now
        self.mix_weight = decision.mix_weight
        self._log_scaling(now, decision, snapshot.instances)
        if decision.effective(snapshot):
            self.version += 1 + bool(decision.routing) + bool(decision.mix)
            if decision.targets != self.targets:
                self._serving = None
            self.targets = dict(decision.targets)
            if self.on_decision:
                self.on_decision(now, decision)
        for action in decision.actions:
            self._apply(action, now)
        if self.queue:
            self._pump(now)  # new room, a new state, or requests waiting past their timeout

    def _log_scaling(self, now: float, d: Decision, before: tuple[InstanceView, ...]) -> None:
        """A scaling log line for a decision that starts or wakes instances (scale_out) or lets awake ones go
        (scale_in), with the awake counts before and after."""
        awake = {i.instance_id: i for i in before if i.state in (S.RUNNING, S.STARTING)}
        added = [a for a in d.actions if a.action in (Action.START, Action.WAKE)]
        removed = [a for a in d.actions if a.action in (Action.SLEEP, Action.DRAIN, Action.DELETE)
                   and a.instance_id in awake]
        if not added and not removed:
            return

        def count(key) -> tuple[int, int]:
            had = sum(1 for i in awake.values() if key(i.backend, i.role))
            gained = sum(1 for a in added if key(a.backend, a.role or self._role_of(a.instance_id)))
            lost = sum(1 for a in removed if key(a.backend, awake[a.instance_id].role))
            return had, had + gained - lost

        if d.roles:
            parts = [(name, count(lambda b, r, role=role: r is role)) for name, role in
                     (("prompt", Role.PREFILL), ("token", Role.DECODE))]
        else:
            parts = [(b.value, count(lambda bb, r, b=b: bb is b)) for b in sorted(self.alias.backends)]
        status = "_".join(f"{name}:{a}->{b}" for name, (a, b) in parts)
        self.log.append(LogLine(now, "autoscaling_decision", "scale_out" if added else "scale_in", status,
                                d.targets_reason))

    def _role_of(self, instance_id: str) -> Role | None:
        inst = self.instances.get(instance_id)
        return inst.role if inst else None

    def _moved(self, inst: LabInstance, state: InstanceState, now: float) -> None:
        if (inst.state is S.RUNNING) != (state is S.RUNNING):
            self._level(now)
            self._running[inst.backend] += 1 if state is S.RUNNING else -1
        self.record.transitions.append(Transition(now, inst.instance_id, inst.backend, inst.state, state))
        inst.state, inst.since = state, now

    def _routable(self) -> bool:
        return any(i.state is S.RUNNING for i in self.instances.values())

    def _close_window(self, now: float) -> None:
        self._level(now)
        w = self.window
        for inst in self.instances.values():
            if inst.jobs:
                self._generated(inst, inst.advance(now))  # tokens generated up to the window's end count in it
        seconds = max(1e-9, now - w.start)
        window = self.meter.close("lab", self.alias.alias, _at(w.start), _at(now))
        self.last_window = merge_windows([window])  # as the controller merges its gateways' windows
        answered = window.requests_fast + window.requests_slow
        self._sample(now, w.e2e_total / max(1, answered), answered / seconds, window.arrivals / seconds)
        running = {FAST.value: w.running_fast_s / seconds, SLOW.value: w.running_slow_s / seconds}
        self.record.windows.append(WindowRecord(
            w.start, now, window.arrivals, window.requests_fast, window.requests_slow, running,
            {FAST.value: w.inflight_fast_s / seconds, SLOW.value: w.inflight_slow_s / seconds},
            {FAST.value: w.decoded_by[FAST], SLOW.value: w.decoded_by[SLOW]}))
        self.window = Window(now)

    def _sample(self, now: float, e2e: float, rate: float, arrivals: float) -> None:
        """The cluster at a window's end, and the window's term of seed 000 §13.4's objective."""
        awake: dict[str, int] = {}
        asleep: dict[str, int] = {}
        for inst in self.instances.values():
            key = inst.backend.value + (f":{inst.role.value}" if inst.role else "")
            if inst.state in (S.RUNNING, S.STARTING):
                awake[key] = awake.get(key, 0) + 1
            elif inst.state in (S.SLEEP_1, S.SLEEP_2):
                asleep[key] = asleep.get(key, 0) + 1
        o = self.lab.objective
        j = o.beta * e2e + o.gamma * self.memory_gb - o.alpha * rate + o.eta * self._actions_in_window
        self.samples.append(WindowSample(now, self.routing.value, awake, asleep, arrivals, self.memory_gb,
                                   self._actions_in_window, j))
        self._actions_in_window = 0


def _running_since(inst: LabInstance) -> tuple[float, str]:
    return inst.since, inst.instance_id


def _at(t: float) -> datetime:
    return EPOCH + timedelta(seconds=t)

