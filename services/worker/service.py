"""The worker: executes instance commands on its machine and records the facts.

Seed 000 §3: one unified interface (`start / wake / sleep / drain / delete /
status`) over every engine, cut by the capability matrix; an action a backend
cannot do is answered `unsupported` (the controller picks the substitute), an
action illegal in the instance's state is answered `rejected`. The worker keeps
no replica counts, only the instances it runs.

Idempotency: every event a command causes has an id derived from the command
id. Before acting, the worker looks for the command's marker event (the
accepted transition, or the outcome); if the log has it, the command was
handled and a redelivery is acked without a second effect.

Facts it reports besides: every `report_interval_s` a `WorkerHeartbeat` on the
bus with each instance's status read from its engine's own API (telemetry, not
events: it changes with load); and, within moments, an engine that exits on its
own, recorded with its exit code and the last lines of its output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from nats.errors import Error as NatsError

from shared.bus.telemetry import TelemetryBus
from shared.contracts.backends import Action, BackendType, EngineKind, CommandOutcome, Role, substitute, supports
from shared.contracts.commands import (
    DeleteInstance,
    DrainInstance,
    InstanceCommand,
    ProbeInstance,
    SleepInstance,
    StartInstance,
    WakeInstance,
)
from shared.contracts.events import (
    AliasConfigured,
    InstanceCommandCompleted,
    InstanceLoading,
    InstanceStateChanged,
    WorkerDeregistered,
    WorkerLost,
    WorkerRegistered,
)
from shared.contracts.effects import CommandEffect, command_effect, effect_of
from shared.contracts.messages import Envelope, Event, derived_id
from shared.contracts.states import (
    IllegalTransition,
    InstanceState as S,
    check_instance_transition,
    instance_transition_allowed,
)
from shared.contracts.telemetry import InstanceStatus, WorkerHeartbeat
from shared.eventlog.store import EventStore
from shared.faults import Backoff, Outage, describe, is_transient
from shared.projections.projector import rebuild
from shared.projections.readmodels import INSTANCES
from shared.telemetry import Telemetry
from services.worker.allowed import start_refusal
from services.worker.engines import EngineError, EngineLauncher, EngineProcess

log = logging.getLogger(__name__)


@dataclass
class Instance:
    """What this worker knows of one instance it runs."""

    instance_id: str
    alias: str
    backend_type: BackendType
    engine: EngineKind
    state: S
    sleep_level: int = 0
    process: EngineProcess | None = None
    endpoint: str | None = None
    error: str | None = None
    """Why it is in ERROR, for its status reports."""
    role: Role | None = None


REGISTERED = "registered"
"""The first word of the line a worker logs once the log has its registration (`LocalPool` waits for it)."""


class Worker:
    def __init__(
        self,
        *,
        worker_id: str,
        store: EventStore,
        launcher: EngineLauncher,
        telemetry: Telemetry,
        gpu_memory_gb: float,
        slots: int,
        host: str | None = None,
        health_timeout_s: float = 180.0,
        hang_timeout_s: float = 10.0,
        drain_poll_s: float = 0.5,
        report_interval_s: float = 1.0,
    ) -> None:
        self.worker_id = worker_id
        self.store = store
        self.launcher = launcher
        self.telemetry = telemetry
        self.gpu_memory_gb = gpu_memory_gb
        self.slots = slots
        self.host = host or socket.gethostname()
        self.health_timeout_s = health_timeout_s
        self.hang_timeout_s = hang_timeout_s
        """An engine whose /health has not answered for this long is hung: recorded ERROR and killed."""
        self.drain_poll_s = drain_poll_s
        self.report_interval_s = report_interval_s
        self.instances: dict[str, Instance] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.heartbeats_sent = 0
        self.heartbeats_missed = 0

    # ------------------------------------------------------------------ lifecycle

    async def register(self, engines: list[EngineKind]) -> None:
        await self._record(
            WorkerRegistered(worker_id=self.worker_id, host=self.host, gpu_memory_gb=self.gpu_memory_gb,
                             slots=self.slots, engines=engines)
        )
        log.info("%s as worker %s on %s: %g GB of GPU memory, %d slots, engines %s", REGISTERED, self.worker_id,
                 self.host, self.gpu_memory_gb, self.slots, ", ".join(e.value for e in engines))

    async def keep_registered(self, engines: list[EngineKind], stop: asyncio.Event, every_s: float = 2.0) -> None:
        """Register again whenever the log says this worker was lost (or deregistered by someone else).

        A worker cut off from the bus for longer than the controller's timeout is
        recorded lost with its instances; once it can be heard again it comes back on
        its own. Its instances are not: the log gave them up (ERROR or ABSENT), so their
        engines are stopped and the controller starts what the load needs afresh.
        """
        outage = Outage("checking this worker's registration", log)
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
            if stop.is_set():
                return
            try:
                last = await self.store.last_of(f"worker:{self.worker_id}")
                gone = self.store.fact(last)
                if isinstance(gone, (WorkerLost, WorkerDeregistered)):
                    log.warning("the log says this worker is %s (%s); registering again",
                                "lost" if isinstance(gone, WorkerLost) else "deregistered", gone.reason)
                    await self.follow_the_log()
                    await self.register(engines)
            except Exception as exc:
                outage.failed(exc)
            else:
                outage.succeeded()

    async def follow_the_log(self) -> None:
        """Bring each instance in line with the log where the log moved it without this worker (a loss):
        its engine is stopped, and it is ERROR (to be released) or gone, as recorded."""
        for inst in list(self.instances.values()):
            async with self._lock(inst.instance_id):
                last = await self.store.last_of(f"instance:{inst.instance_id}")
                moved = self.store.fact(last)
                if not isinstance(moved, InstanceStateChanged):
                    continue
                recorded = moved.to_state
                if recorded is inst.state or moved.worker_id != self.worker_id:
                    continue
                log.warning("instance %s is %s in the log (%s), %s here: stopping its engine", inst.instance_id,
                            recorded.value, moved.reason, inst.state.value)
                if inst.process is not None:
                    await inst.process.stop()
                    inst.process = None
                inst.state, inst.error = recorded, moved.reason
                if recorded is S.ABSENT:
                    self.instances.pop(inst.instance_id, None)

    async def reconcile(self) -> None:
        """After a restart: instances the log places here have lost their engine process.

        Engines die with their worker (see `engines.py`), so nothing is adopted;
        each such instance is moved, by legal transitions only, to where the facts are:
        ERROR if it was starting or serving, ABSENT if it was asleep or on its way out.
        """
        rows, _, _ = await rebuild(self.store, [INSTANCES])
        for row in rows[INSTANCES.name].values():
            if row.worker_id != self.worker_id or row.instance_id in self.instances:
                continue
            inst = Instance(row.instance_id, row.alias, row.backend_type, row.engine, row.state, sleep_level=row.sleep_level,
                            role=row.role)
            self.instances[inst.instance_id] = inst
            if inst.state is not S.ERROR:
                await self._engine_gone(inst, None)

    async def shutdown(self, reason: str = "worker stopped", record_within_s: float = 5.0) -> None:
        for task in list(self._tasks):
            task.cancel()
        for inst in list(self.instances.values()):
            if inst.process is not None:
                await inst.process.stop()
                inst.process = None
        try:
            await asyncio.wait_for(self._record(WorkerDeregistered(worker_id=self.worker_id, reason=reason)),
                                   record_within_s)
        except Exception as exc:  # the log is away: the controller will find this worker silent instead
            log.warning("stopping without recording it (%s)", describe(exc))

    # ------------------------------------------------------------------ commands

    async def handle(self, envelope: Envelope, command: InstanceCommand) -> None:
        if command.worker_id != self.worker_id:
            await self._outcome(envelope, command, CommandOutcome.REJECTED, f"addressed to worker {command.worker_id}")
            return
        action = command.ACTION
        if not supports(command.backend_type, action):
            alternative = "+".join(a.value for a in substitute(command.backend_type, action)) or "none"
            await self._outcome(
                envelope, command, CommandOutcome.UNSUPPORTED,
                f"{command.backend_type.value} does not support {action.value} (substitute: {alternative})",
            )
            return
        execute: dict[type[InstanceCommand], Callable] = {
            StartInstance: self._start,
            WakeInstance: self._wake,
            SleepInstance: self._sleep,
            DrainInstance: self._drain,
            DeleteInstance: self._delete,
            ProbeInstance: self._probe,
        }
        # Under the instance's lock, so a copy of this command delivered at the same
        # time waits here and then finds the first one's marker in the log.
        async with self._lock(command.instance_id):
            if await self._handled(envelope):
                log.info("command %s (%s) already handled; ignoring the redelivery", envelope.id, command.TYPE)
                return
            try:
                await execute[type(command)](envelope, command)
            except IllegalTransition as exc:
                await self._outcome(envelope, command, CommandOutcome.REJECTED, str(exc))

    async def _handled(self, envelope: Envelope) -> bool:
        for marker in ("accepted", "outcome"):
            if await self.store.contains(derived_id(envelope.id, marker)):
                return True
        return False

    async def _start(self, envelope: Envelope, cmd: StartInstance) -> None:
        recorded = await self.store.of_type(AliasConfigured.TYPE, alias=cmd.alias)
        configured = [fact.config for _, fact in self.store.typed(recorded) if isinstance(fact, AliasConfigured)]
        if refusal := start_refusal(cmd, configured[-1] if configured else None):
            log.warning("refusing to start %s: %s", cmd.instance_id, refusal)
            await self._outcome(envelope, cmd, CommandOutcome.REJECTED, refusal)
            return
        inst = self.instances.get(cmd.instance_id)
        if inst is None:
            inst = Instance(cmd.instance_id, cmd.alias, cmd.backend_type, cmd.engine, S.ABSENT, role=cmd.role)
        effect = effect_of(cmd.ACTION, inst.backend_type, inst.state)
        self.instances[inst.instance_id] = inst
        await self._transition(inst, effect.accepted, cmd.reason or "start requested", envelope, marker="accepted")
        # Launched here, under the instance's lock, so a delete that follows always
        # finds the process it has to stop; only the wait for health goes on in the background.
        try:
            process = await self.launcher.launch(cmd)
        except EngineError as exc:
            await self._transition(inst, S.ERROR, f"start failed: {exc}", envelope, outcome=(CommandOutcome.FAILED, str(exc)))
            return
        inst.process, inst.endpoint = process, process.endpoint
        self._spawn(self._watch(inst, process))
        self._spawn(self._guard(inst, process))
        self._spawn(self._finish_start(envelope, inst, process, effect.done))

    async def _finish_start(self, envelope: Envelope, inst: Instance, process: EngineProcess, healthy: S) -> None:
        failure = None

        async def loading() -> None:
            async with self._lock(inst.instance_id):
                if inst.process is process and inst.state is S.STARTING:
                    await self._append(f"instance:{inst.instance_id}", [Envelope.wrap(InstanceLoading(
                        instance_id=inst.instance_id, alias=inst.alias, backend_type=inst.backend_type,
                        worker_id=self.worker_id), causation=envelope, id=derived_id(envelope.id, "loading"))])

        try:
            await process.wait_healthy(self.health_timeout_s, loading)
        except EngineError as exc:
            failure = str(exc)
        else:
            try:
                await process.read_capacity()
            except Exception as exc:  # not worth failing the start for: status reports keep asking
                log.warning("instance %s: capacity not known yet: %s", inst.instance_id, exc)
        async with self._lock(inst.instance_id):
            if inst.process is not process or inst.state is not S.STARTING:
                return  # deleted while starting: the delete recorded everything
            if failure is None and not process.alive:
                failure = f"engine exited with code {process.exit_code} as it became healthy"
            if failure is None:
                await self._transition(inst, healthy, "engine healthy", envelope, outcome=(CommandOutcome.OK, inst.endpoint or ""))
                return
            # The exit code only of an engine that exited by itself; one that never got healthy is stopped here.
            exit_code = None if process.alive else process.exit_code
            await process.stop()
            inst.process = None
            await self._transition(inst, S.ERROR, f"start failed: {failure}", envelope, outcome=(CommandOutcome.FAILED, failure),
                                   exit_code=exit_code, log_tail=process.log_tail())

    async def _watch(self, inst: Instance, process: EngineProcess) -> None:
        """Record an engine that exits on its own the moment it does."""
        await process.wait_exit()
        async with self._lock(inst.instance_id):
            # Not a failure if the worker stopped it; and an exit while starting is the
            # start's to record, with the start command's outcome.
            if process.stop_requested or inst.process is not process or inst.state is S.STARTING:
                return
            await self._engine_gone(inst, None)

    async def _guard(self, inst: Instance, process: EngineProcess) -> None:
        """Record an engine that is alive but no longer answers (hung, stopped, deadlocked), and kill it.

        Judged only while the instance serves or rests (a start has its own timeout)
        and no command of it is under way (a long wake may keep an engine busy).
        """
        loop = asyncio.get_running_loop()
        answered = loop.time()
        while process.alive and inst.process is process:
            await asyncio.sleep(min(1.0, self.hang_timeout_s / 4))
            serving = inst.state in (S.RUNNING, S.SLEEP_1, S.SLEEP_2, S.DRAINING)
            probe_s = min(2.0, self.hang_timeout_s / 3)
            if not serving or self._lock(inst.instance_id).locked() or await process.answers(probe_s):
                answered = loop.time()
                continue
            silent = loop.time() - answered
            if silent < self.hang_timeout_s:
                continue
            async with self._lock(inst.instance_id):
                if inst.process is not process or not process.alive:
                    return
                log.error("instance %s: engine has not answered /health for %.0f s; killing it", inst.instance_id, silent)
                process.kill()
                await self._engine_gone(inst, None, f"engine hung: no answer from /health for {silent:.0f} s; killed")
            return

    async def _wake(self, envelope: Envelope, cmd: WakeInstance) -> None:
        inst, effect = self._known(cmd)
        await self._engine_call(envelope, cmd, inst, lambda p: p.wake(), effect)

    async def _sleep(self, envelope: Envelope, cmd: SleepInstance) -> None:
        inst, effect = self._known(cmd)

        async def change_level(process: EngineProcess) -> None:
            if effect.wake_first:
                await process.wake()
            await process.sleep(cmd.level)

        await self._engine_call(envelope, cmd, inst, change_level, effect)

    async def _engine_call(self, envelope, cmd, inst: Instance, call, effect: CommandEffect) -> None:
        if inst.process is None or not inst.process.alive:
            await self._engine_gone(inst, envelope)
            return
        try:
            await call(inst.process)
        except Exception as exc:  # whatever the engine answered, the outcome records it
            await self._outcome(envelope, cmd, CommandOutcome.FAILED, str(exc))
            return
        inst.sleep_level = effect.sleep_level
        await self._transition(inst, effect.done, cmd.reason or f"{cmd.ACTION.value} requested", envelope,
                               outcome=(CommandOutcome.OK, ""))

    async def _engine_gone(self, inst: Instance, cause: Envelope | None, why: str | None = None) -> None:
        """Record that an instance's engine process is gone, by legal transitions only:
        ERROR where the lifecycle allows it, else on to ABSENT; with how it ended, when known."""
        process, inst.process = inst.process, None
        exit_code = log_tail = None
        reason = why or "engine process is gone"
        if process is not None:
            await process.stop()  # reaps it and closes its HTTP client
            exit_code, log_tail = process.exit_code, process.log_tail()
            reason = why or f"engine exited with code {exit_code}"
        failed = (CommandOutcome.FAILED, reason)
        if instance_transition_allowed(inst.backend_type, inst.state, S.ERROR):
            await self._transition(inst, S.ERROR, reason, cause, outcome=failed, exit_code=exit_code, log_tail=log_tail)
            return
        if inst.state is not S.DELETING:
            await self._transition(inst, S.DELETING, reason, cause, exit_code=exit_code, log_tail=log_tail)
        await self._transition(inst, S.ABSENT, reason, cause, outcome=failed, exit_code=exit_code, log_tail=log_tail)
        self.instances.pop(inst.instance_id, None)

    async def _drain(self, envelope: Envelope, cmd: DrainInstance) -> None:
        inst, effect = self._known(cmd)
        await self._transition(inst, effect.accepted, cmd.reason or "drain requested", envelope, marker="accepted")
        self._spawn(self._finish_drain(envelope, cmd, inst))

    async def _finish_drain(self, envelope: Envelope, cmd: DrainInstance, inst: Instance) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cmd.timeout_s
        remaining = 0
        while inst.state is S.DRAINING and inst.process is not None and inst.process.alive:
            with contextlib.suppress(Exception):  # an engine that does not answer this time may next time
                remaining = await inst.process.inflight()
            if remaining == 0 or loop.time() > deadline:
                break
            await asyncio.sleep(self.drain_poll_s)
        detail = "drained" if remaining == 0 else f"drain timed out with {remaining} requests in flight"
        await self._outcome(envelope, cmd, CommandOutcome.OK if remaining == 0 else CommandOutcome.FAILED, detail)

    async def _delete(self, envelope: Envelope, cmd: DeleteInstance) -> None:
        """Also cancels a start: the background start then finds its process gone and records nothing."""
        inst, effect = self._known(cmd)
        await self._transition(inst, effect.accepted, cmd.reason or "delete requested", envelope, marker="accepted")
        if inst.process is not None:
            await inst.process.stop()
            inst.process = None
        await self._transition(inst, effect.done, "engine stopped, resources released", envelope, outcome=(CommandOutcome.OK, ""))
        self.instances.pop(inst.instance_id, None)

    async def _probe(self, envelope: Envelope, cmd: ProbeInstance) -> None:
        inst = self.instances.get(cmd.instance_id)
        if inst is None:
            await self._outcome(envelope, cmd, CommandOutcome.OK, "ABSENT")
            return
        detail = inst.state.value
        if inst.process is not None and inst.process.alive and inst.state is S.RUNNING:
            with contextlib.suppress(Exception):  # the state alone is still an answer
                detail += f", inflight {await inst.process.inflight()}"
        await self._outcome(envelope, cmd, CommandOutcome.OK, detail)

    # ------------------------------------------------------------------ status reports

    async def status_of(self, inst: Instance) -> InstanceStatus:
        """One instance in the unified fields of seed 000 §12.5, read from its engine now."""
        known = dict(instance_id=inst.instance_id, alias=inst.alias, backend_type=inst.backend_type,
                     engine=inst.engine, status=inst.state, sleep_level=inst.sleep_level)
        process = inst.process
        if process is None or not process.alive:
            return InstanceStatus(**known, healthy=False, error=inst.error or "no engine process")
        try:
            engine = await process.read_status()
        except Exception as exc:  # whatever went wrong, the status says it
            return InstanceStatus(**known, capacity=process.capacity, healthy=False,
                                  error=f"engine API did not answer: {type(exc).__name__}: {exc}"[:1000])
        error = None
        if process.capacity is None and inst.state is not S.STARTING:
            try:
                await process.read_capacity()
            except Exception as exc:
                error = f"capacity unknown: {exc}"[:1000]
        return InstanceStatus(
            **known, inflight_requests=engine.inflight, capacity=process.capacity, kv_usage=engine.kv_usage,
            decode_tokens_per_s=engine.decode_tokens_per_s, ttft_p95_s=engine.ttft_p95_s, e2e_p95_s=engine.e2e_p95_s,
            last_active_at=engine.last_active_at, healthy=True, error=error,
        )

    async def heartbeat(self) -> WorkerHeartbeat:
        statuses = await asyncio.gather(*(self.status_of(inst) for inst in list(self.instances.values())))
        return WorkerHeartbeat(worker_id=self.worker_id, at=datetime.now(timezone.utc),
                               interval_s=self.report_interval_s, instances=list(statuses))

    async def send_heartbeats(self, telemetry_bus: TelemetryBus, stop: asyncio.Event) -> None:
        """Every `report_interval_s` until `stop`: the heartbeat, which is also this worker's sign of life."""
        loop = asyncio.get_running_loop()
        outage = Outage("sending heartbeats", log)
        while not stop.is_set():
            started = loop.time()
            try:
                await telemetry_bus.put_heartbeat(await self.heartbeat())
            except (NatsError, asyncio.TimeoutError) as exc:  # NATS is reconnecting: the next beat tries again
                outage.failed(exc)
                self.heartbeats_missed += 1
            else:
                outage.succeeded()
                self.heartbeats_sent += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, self.report_interval_s - (loop.time() - started)))

    # ------------------------------------------------------------------ helpers

    def _known(self, cmd: InstanceCommand) -> tuple[Instance, CommandEffect]:
        """The command's instance on this worker and what the command does to it; `IllegalTransition` if it may not."""
        inst = self.instances.get(cmd.instance_id)
        level = getattr(cmd, "level", 0)
        if inst is None:
            requested = command_effect(cmd.ACTION, level).first
            raise IllegalTransition("instance", S.ABSENT, requested, f"instance {cmd.instance_id} is not on this worker")
        if inst.backend_type is not cmd.backend_type:
            requested = command_effect(cmd.ACTION, level).first
            raise IllegalTransition("instance", inst.state, requested, f"instance is {inst.backend_type.value}, command says {cmd.backend_type.value}")
        return inst, effect_of(cmd.ACTION, inst.backend_type, inst.state, level)

    def _lock(self, instance_id: str) -> asyncio.Lock:
        return self._locks.setdefault(instance_id, asyncio.Lock())

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _record(self, event: Event, *, causation: Envelope | None = None, id=None) -> None:
        envelope = Envelope.wrap(event, causation=causation, id=id)
        await self._append(envelope.stream_id or "", [envelope])

    async def _append(self, stream_id: str, events: list[Envelope]) -> None:
        """Append until it is recorded: a fact this worker saw (an engine up, gone, drained) is never dropped
        because the log was away. The same events are sent each time, so an append that did commit before
        its answer was lost is recognised by its ids and stored once."""
        outage, backoff = Outage(f"recording {events[0].type} of {stream_id}", log), Backoff(cap_s=2.0)
        while True:
            try:
                await self.store.append(stream_id, events, headers=self.telemetry.current_headers())
            except Exception as exc:
                if not is_transient(exc):
                    raise
                outage.failed(exc)
                await backoff.wait()
            else:
                outage.succeeded()
                return

    async def _transition(
        self,
        inst: Instance,
        to_state: S,
        reason: str,
        cause: Envelope | None,
        *,
        marker: str | None = None,
        outcome: tuple[CommandOutcome, str] | None = None,
        exit_code: int | None = None,
        log_tail: str | None = None,
    ) -> None:
        """Record a state change (and the command's outcome with it, atomically)."""
        check_instance_transition(inst.backend_type, inst.state, to_state)
        change = InstanceStateChanged(
            instance_id=inst.instance_id, alias=inst.alias, backend_type=inst.backend_type, engine=inst.engine,
            worker_id=self.worker_id, from_state=inst.state, to_state=to_state, reason=reason,
            # A drain from sleep stays at its level: the engine is still asleep, its KV gone (no handoff to wait for).
            sleep_level=inst.sleep_level if to_state in (S.SLEEP_1, S.SLEEP_2, S.DRAINING) else 0,
            capacity=inst.process.capacity if inst.process else None,
            endpoint=inst.endpoint, internal_endpoint=inst.process.internal_endpoint if inst.process else None,
            role=inst.role, command_id=cause.id if cause else None, exit_code=exit_code, log_tail=log_tail,
        )
        events = [Envelope.wrap(change, causation=cause,
                                id=derived_id(cause.id, marker or to_state.value) if cause else None)]
        if outcome is not None and cause is not None:
            events.append(self._outcome_envelope(cause, inst.instance_id, inst.alias, Action(_action_of(cause)), *outcome))
        await self._append(f"instance:{inst.instance_id}", events)
        inst.state = to_state
        inst.error = reason if to_state is S.ERROR else None

    def _outcome_envelope(self, cause: Envelope, instance_id: str, alias: str, action: Action, outcome: CommandOutcome, detail: str) -> Envelope:
        return Envelope.wrap(
            InstanceCommandCompleted(command_id=cause.id, instance_id=instance_id, alias=alias, worker_id=self.worker_id,
                                     action=action, outcome=outcome, detail=detail),
            causation=cause, id=derived_id(cause.id, "outcome"),
        )

    async def _outcome(self, cause: Envelope, cmd: InstanceCommand, outcome: CommandOutcome, detail: str) -> None:
        envelope = self._outcome_envelope(cause, cmd.instance_id, cmd.alias, cmd.ACTION, outcome, detail)
        await self._append(f"instance:{cmd.instance_id}", [envelope])


_ACTIONS = {c.TYPE: c.ACTION for c in (StartInstance, WakeInstance, SleepInstance, DrainInstance, DeleteInstance, ProbeInstance)}


def _action_of(envelope: Envelope) -> str:
    return _ACTIONS[envelope.type].value
