"""The autoscaler: the pool's one decision maker, as an adapter around `policy.decide`.

Each tick, for every alias (seed 000 §12.3): collect (read models + live facts
-> snapshot), decide (pure code), record (one append per effective decision,
at the alias stream version the snapshot was taken at), apply (commands with
ids derived from the decision). It is level-triggered: commands already on
their way are part of the snapshot, so a tick only sends the difference, and a
command whose effect has not shown up in the log is sent again with its own id,
which every receiver recognises.

Exactly one process decides: the holder of an advisory lease. Others follow the
bus and stand by; one takes over within a second of the leader's session ending.
The leader also records lost workers (no heartbeat for `worker_timeout_s`): one
writer for that fact too.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import socket
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from policy import decide
from services.autoscaler.facts import LiveFacts
from services.autoscaler.record import command_for, decision_events, operator_command, subject_for
from shared.projections.snapshot import InstanceViews, build_snapshot, recorded_state
from shared.bus.jetstream import publish
from shared.bus.subjects import Subjects
from shared.bus.telemetry import TelemetryBus
from shared.contracts.config import AliasConfig, PoolConfig
from shared.contracts.control import AliasSnapshot, Decision, PlannedAction, PolicyState
from shared.contracts.events import AliasConfigured, InstanceStateChanged, OperatorCommanded, WorkerLost, operator_event_id
from shared.contracts.messages import Envelope, derived_id, utcnow
from shared.contracts.states import InstanceState as S
from shared.contracts.states import instance_transition_allowed
from shared.contracts.telemetry import ControlOutlook
from shared.eventlog.lease import AdvisoryLease
from shared.eventlog.store import ConcurrencyError, EventStore
from shared.faults import Outage, describe, retry_until_done
from shared.projections.live import LiveView
from shared.projections.readmodels import CONTROL, INSTANCES, ROUTING, WORKERS
from shared.projections.rows import InstanceRow, PendingCommandRow, WorkerRow
from shared.telemetry import Telemetry

log = logging.getLogger(__name__)

OUTLOOK_REFRESH_S = 5.0
SHARED_SILENCE_FACTOR = 3.0
"""Timeouts a silence several workers share lasts before they are judged lost (`watch_workers`)."""


def leader_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def tune_collector() -> None:
    """Keep Python's cyclic garbage collector out of the ticks.

    A tick makes tens of thousands of short-lived objects (snapshots, views,
    decisions) and no reference cycles worth finding, over a view of the pool
    that lives as long as the process. With the default thresholds the collector
    runs every few hundred allocations and rescans that view each time: a third
    of a large pool's tick. Objects alive now are frozen out of its scans, and
    it runs far less often; reference counting frees the tick's garbage anyway.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside a tick: one that falls due runs after it, while the
    controller waits for the next, so it delays no decision (a full one costs a large
    pool's tick about as much again)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Controller:
    def __init__(
        self,
        *,
        store: EventStore,
        engine: AsyncEngine,
        js: JetStreamContext,
        subjects: Subjects,
        telemetry: Telemetry,
        telemetry_bus: TelemetryBus,
        lease: AdvisoryLease,
        pool: PoolConfig,
        tick_s: float,
        worker_timeout_s: float,
        name: str | None = None,
        clock: Callable[[], datetime] = utcnow,
        resend_after_s: float = 5.0,
        bus_up_for_s: Callable[[], float] = lambda: math.inf,
    ) -> None:
        self.store = store
        self.js = js
        self.subjects = subjects
        self.telemetry = telemetry
        self.telemetry_bus = telemetry_bus
        self.lease = lease
        self.pool = pool
        self.tick_s = tick_s
        self.worker_timeout_s = worker_timeout_s
        self.name = name or leader_name()
        self.clock = clock
        self.resend_after_s = resend_after_s
        """A command with no sign of arrival after this long is sent again, with its own id."""
        self.bus_up_for_s = bus_up_for_s
        """How long this process has reached NATS without a break: silence heard over a bus just back is no death."""
        self.view = LiveView(store, engine, [ROUTING, INSTANCES, WORKERS, CONTROL])
        self.touched_instances = self.view.watch_keys(INSTANCES)
        self.touched_aliases = self.view.watch_keys(CONTROL)
        self.rows_by_alias: dict[str, dict[str, InstanceRow]] = defaultdict(dict)
        """alias -> instance id -> its row in the view, kept up to date from the touched keys."""
        self.alias_of: dict[str, str] = {}
        self.facts = LiveFacts()
        self.views = InstanceViews()
        self.states: dict[str, PolicyState] = {}
        self.sent_at: dict[uuid.UUID, tuple[datetime, int]] = {}
        """When each command was last sent, and how many times."""
        self.outlooks: dict[str, tuple[Any, datetime]] = {}
        self.outlook_outage = Outage("publishing the controller's outlook", log)
        self.leading_since: datetime | None = None
        self.ticks = 0
        self.recorded = 0
        """Decisions this process recorded (each changed something)."""
        self.workers_lost = 0
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ running

    async def run(self, stop: asyncio.Event) -> None:
        await retry_until_done(self.view.load, "loading the controller's view", log, stop)
        tune_collector()
        followers = [
            asyncio.create_task(self.telemetry_bus.watch_heartbeats(
                lambda heartbeat: self.facts.heard(heartbeat, self.clock()), stop)),
            asyncio.create_task(self.telemetry_bus.follow_windows(self.facts.window, stop)),
        ]
        demand = await self.telemetry_bus.subscribe_demand(self._on_demand)
        # An operator's instance action, once relayed: sent now rather than at the next tick. Only a wake-up:
        # what there is to send is read from the log.
        operated = await self.telemetry_bus.nc.subscribe(self.subjects.event("alias:", OperatorCommanded.TYPE),
                                                         cb=self._on_operator)
        try:
            while not stop.is_set():
                if not await self.lease.acquire(stop):
                    break
                await self._lead(stop)
        finally:
            with contextlib.suppress(Exception):
                await demand.unsubscribe()
            with contextlib.suppress(Exception):
                await operated.unsubscribe()
            for task in followers:
                task.cancel()
            await asyncio.gather(*followers, return_exceptions=True)
            await self.lease.release()

    async def _lead(self, stop: asyncio.Event) -> None:
        self.leading_since = self.clock()
        self.states.clear()
        self.views = InstanceViews()  # everything looked at afresh by a new leader
        log.info("%s leads the pool's decisions", self.name)
        outage = Outage("deciding", log)
        try:
            await self.view.catch_up()
            await self.register_aliases()
        except Exception as exc:  # Postgres went away as we took over: try to lead again
            outage.failed(exc)
            self.leading_since = None
            return
        while not stop.is_set():
            if not await self.lease.alive():
                log.error("%s lost its lease; standing down", self.name)
                self.leading_since = None
                return
            try:
                with collector_paused():
                    await self.tick()
            except Exception as exc:
                outage.failed(exc)
            else:
                outage.succeeded()
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wait(stop), self.tick_s)

    async def _wait(self, stop: asyncio.Event) -> None:
        waits = {asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(stop.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _on_operator(self, msg) -> None:
        self._wake.set()

    def _on_demand(self, signal) -> None:
        self.facts.demanded(signal)
        # Demand on a cold alias does not wait for the next tick.
        self._wake.set()

    async def register_aliases(self) -> int:
        """Record AliasConfigured for each alias whose configuration is new or changed."""
        recorded = 0
        for alias in self.pool.aliases:
            routing, control = self.view[ROUTING].get(alias.alias), self.view[CONTROL].get(alias.alias)
            if routing is None or routing.config != alias:
                version = control.version if control else 0
                try:
                    await self.store.append(f"alias:{alias.alias}", [Envelope.wrap(AliasConfigured(alias=alias.alias, config=alias))],
                                            version, headers=self.telemetry.current_headers())
                    recorded += 1
                except ConcurrencyError:
                    log.warning("alias %s changed while registering; it is registered at the next start", alias.alias)
        await self.view.catch_up()
        return recorded

    # ------------------------------------------------------------------ one tick

    async def tick(self) -> list[Decision]:
        now = self.clock()
        await self.view.catch_up()
        await self.watch_workers(now)
        workers_up = {w for w, row in self.view[WORKERS].items() if row.up}
        self.views.begin(self.facts.statuses(), workers_up, self.facts.fresh_workers(now), self.facts.take_changes(),
                         self.index_rows())
        decisions = []
        for config in self.pool.aliases:
            snapshot = self.snapshot(config, now)
            decision = decide(snapshot, now)
            decisions.append(decision)
            recorded = None
            if decision.effective(snapshot):
                recorded = await self.record(snapshot, decision, now)
                if recorded is None:
                    self.states.pop(config.alias, None)  # start again from what the log says
                    continue
            self.states[config.alias] = decision.state
            await self.apply(config, decision, recorded)
            await self.publish_outlook(snapshot, decision, now)
        await self.send_operator_commands()
        await self.resend(now, workers_up)
        pending = {cid for row in self.view[CONTROL].values() for cid in row.pending}
        for cid in [c for c in self.sent_at if str(c) not in pending]:
            del self.sent_at[cid]
        self.ticks += 1
        return decisions

    def index_rows(self) -> set[str]:
        """Bring `rows_by_alias` up to date with the rows the log touched; the aliases whose rows or notes changed."""
        changed = set(self.touched_aliases)
        self.touched_aliases.clear()
        rows, gone = self.view[INSTANCES], []
        for instance_id in self.touched_instances:
            before = self.alias_of.pop(instance_id, None)
            if before is not None:
                self.rows_by_alias[before].pop(instance_id, None)
                changed.add(before)
            row = rows.get(instance_id)
            if row is None:
                gone.append(instance_id)
                continue
            self.alias_of[instance_id] = row.alias
            self.rows_by_alias[row.alias][instance_id] = row
            changed.add(row.alias)
        self.touched_instances.clear()
        self.views.forget(gone)
        return changed

    def snapshot(self, config: AliasConfig, now: datetime) -> AliasSnapshot:
        control = self.view[CONTROL].get(config.alias)
        state = self.states.get(config.alias)
        if state is None:
            state = recorded_state(control)
        instances = self.views.of(config.alias, self.rows_by_alias[config.alias].values(),
                                  control.notes if control else {})
        return build_snapshot(
            config=config, controller=self.pool.controller, routing_row=self.view[ROUTING].get(config.alias),
            control_row=control, instances=instances, metrics=self.facts.metrics(config.alias, now),
            demand=self.facts.waiting(config.alias, now), state=state, views=self.views,
        )

    async def record(self, snapshot: AliasSnapshot, decision: Decision, now: datetime) -> Envelope | None:
        """Append the decision's events; the stored PolicyDecided, or None if another writer got there first."""
        events = decision_events(snapshot, decision, now)
        try:
            stored = await self.store.append(f"alias:{snapshot.alias}", events, snapshot.version,
                                             headers=self.telemetry.current_headers())
        except ConcurrencyError as exc:
            log.warning("decision for %s not recorded: %s; deciding again from the log", snapshot.alias, exc)
            return None
        if stored[0].payload != events[0].payload:
            # The same decision id stored with other content: someone else decided at this version.
            log.error("another controller decided for %s at version %d; standing back this tick", snapshot.alias,
                      snapshot.version)
            return None
        log.info("%s: %s", snapshot.alias, stored[0].payload["summary"])
        self.recorded += 1
        return stored[0]

    async def apply(self, config: AliasConfig, decision: Decision, decided: Envelope | None) -> None:
        for action in decision.actions:
            await self._send(config, action, decided)

    async def _send(self, config: AliasConfig, action: PlannedAction, cause: Envelope | None) -> None:
        command = command_for(action, config, self.pool.controller.drain_timeout_s)
        envelope = Envelope.wrap(command, id=action.command_id, causation=cause)
        _, sends = self.sent_at.get(action.command_id, (None, 0))
        self.sent_at[action.command_id] = (self.clock(), sends + 1)
        try:
            await publish(self.js, subject_for(action, self.subjects), envelope, self.telemetry)
        except Exception as exc:  # the bus is away: the command is in the log, and is sent again
            log.warning("sending %s %s failed (%r); it will be sent again", action.action.value, action.instance_id, exc)

    async def send_operator_commands(self) -> int:
        """Send every operator's instance command recorded and not sent by this process yet.

        The gateway records it (`OperatorCommanded`) and may not publish commands;
        this is where it leaves for its worker, once. Level-triggered: a command
        recorded while no autoscaler led, or sent by a leader that then died, is in
        the control row until its outcome is, and is sent by whoever leads now; a copy
        its worker already has is dropped by JetStream by its id, or past JetStream's
        window recognised by the worker's markers.
        """
        sent = 0
        for alias, row in self.view[CONTROL].items():
            for command_id, c in row.pending.items():
                cid = uuid.UUID(command_id)
                if c.operator is None or c.acked or cid in self.sent_at:
                    continue
                await self._send_operator(alias, cid, c)
                sent += 1
        return sent

    async def _send_operator(self, alias: str, command_id: uuid.UUID, c: PendingCommandRow) -> None:
        if c.worker_id is None:  # recorded before events named the worker (v1): its gateway sent it then
            self.sent_at[command_id] = (self.clock(), 1)
            return
        cause = await self.store.get(operator_event_id(command_id))
        envelope = Envelope.wrap(operator_command(alias, c), id=command_id, causation=cause)
        _, sends = self.sent_at.get(command_id, (None, 0))
        self.sent_at[command_id] = (self.clock(), sends + 1)
        try:
            await publish(self.js, self.subjects.worker_commands(c.worker_id), envelope, self.telemetry)
        except Exception as exc:  # the bus is away: the command is in the log, and is sent again
            log.warning("sending operator %s %s failed (%r); it will be sent again", c.action.value, c.instance_id,
                        exc)
        else:
            log.info("%s: sent operator %s's %s %s", alias, c.operator.split(":", 1)[0], c.action.value,
                     c.instance_id)

    async def resend(self, now: datetime, workers_up: set[str]) -> int:
        """Send again every recorded command that shows no sign of having arrived.

        A command whose receiver never got it (lost between the append and the
        publish) arrives now; one that is waiting in its queue is dropped by
        JetStream as a repeat of its id, and past JetStream's window recognised by
        its receiver's markers. Commands for a worker that is not up wait in its queue.
        """
        configs = {a.alias: a for a in self.pool.aliases}
        resent = 0
        for alias, row in self.view[CONTROL].items():
            config = configs.get(alias)
            for command_id, c in row.pending.items():
                if c.acked or (c.worker_id and c.worker_id not in workers_up) or (config is None and not c.operator):
                    continue
                cid = uuid.UUID(command_id)
                last, sends = self.sent_at.get(cid) or (c.issued_at, 1)
                # Back off while its receiver stays away: 5 s, 10 s, 20 s ... at most a minute.
                if now - last < timedelta(seconds=min(self.resend_after_s * 2 ** (sends - 1), 60.0)):
                    continue
                action = PlannedAction(action=c.action, backend=c.backend, instance_id=c.instance_id, command_id=cid,
                                       reason="sent again: no sign it arrived", worker_id=c.worker_id, level=c.level,
                                       role=c.role)
                log.info("%s: sending %s %s again", alias, action.action.value, action.instance_id)
                if c.operator is not None:
                    await self._send_operator(alias, cid, c)
                    resent += 1
                    continue
                assert config is not None
                await self._send(config, action, None)
                resent += 1
        return resent

    async def publish_outlook(self, snapshot: AliasSnapshot, decision: Decision, now: datetime) -> None:
        state = decision.routing.to_state if decision.routing else snapshot.routing_state
        content = (state, tuple(sorted((b.value, n) for b, n in decision.targets.items())), decision.outlook)
        previous = self.outlooks.get(snapshot.alias)
        if previous and previous[0] == content and now - previous[1] < timedelta(seconds=OUTLOOK_REFRESH_S):
            return
        outlook = ControlOutlook(alias=snapshot.alias, at=now, leader=self.name, policy=decision.policy,
                                 routing_state=state, targets=decision.targets, next=list(decision.outlook),
                                 metrics=snapshot.metrics)
        try:
            await self.telemetry_bus.put_outlook(outlook)
            self.outlooks[snapshot.alias] = (content, now)
        except Exception as exc:  # for `modelpool status` only: the next tick publishes it again
            self.outlook_outage.failed(exc)
        else:
            self.outlook_outage.succeeded()

    # ------------------------------------------------------------------ lost workers

    async def watch_workers(self, now: datetime) -> list[str]:
        """Record each worker silent past the timeout as lost, and its instances as gone with it.

        Silence counts only when this controller could have heard: it has led for a
        whole timeout (a new leader first gives every worker the chance to be heard), it
        counts from the moment its own link to NATS last came back (a leader whose bus
        was away has not heard anyone: that is not their death), and a last look at the
        worker's heartbeat in the bucket finds nothing fresher. A silence that is shared
        is likelier the bus's than the workers': several workers silent at once (a NATS
        server of a cluster lost: the workers it served reconnect elsewhere while the
        streams elect new leaders, and no heartbeat can be written meanwhile), or a
        worker silent since before this controller's own link came back (each client
        finds a server again at its own moment). Such silence is judged only after
        `SHARED_SILENCE_FACTOR` timeouts; one silent worker among heard ones after one.
        """
        if self.leading_since is None or now - self.leading_since < timedelta(seconds=self.worker_timeout_s):
            return []
        bus_up_s = self.bus_up_for_s()
        bus_back = now - timedelta(seconds=bus_up_s) if math.isfinite(bus_up_s) else None

        def counted_s(last: datetime) -> float:
            return (now - (last if bus_back is None else max(last, bus_back))).total_seconds()

        up = {worker_id: row for worker_id, row in self.view[WORKERS].items() if row.up}
        last_of = {worker_id: max(filter(None, (self.facts.last_heard(worker_id), row.registered_at)))
                   for worker_id, row in up.items()}
        several = sum((now - last).total_seconds() > self.worker_timeout_s for last in last_of.values()) > 1
        lost = []
        for worker_id, row in up.items():
            last = last_of[worker_id]
            shared = several or (bus_back is not None and last < bus_back)
            timeout_s = self.worker_timeout_s * (SHARED_SILENCE_FACTOR if shared else 1.0)
            if counted_s(last) <= timeout_s:
                continue
            try:
                heartbeat = await self.telemetry_bus.heartbeat_of(worker_id)
            except Exception as exc:  # the bus cannot say: no verdict without it
                log.warning("worker %s silent, but its heartbeat cannot be read (%s): not judged now", worker_id,
                            describe(exc))
                continue
            if heartbeat is not None:
                self.facts.heard(heartbeat, now)  # the watch missed it: heard now, if it is news
                last = max(last, self.facts.last_heard(worker_id) or last)
            if counted_s(last) > timeout_s:
                await self.record_lost(worker_id, row, last, f"no heartbeat for {(now - last).total_seconds():.0f} s")
                lost.append(worker_id)
        if lost:
            await self.view.catch_up()
        return lost

    async def record_lost(self, worker_id: str, row: WorkerRow, last_seen: datetime, why: str) -> None:
        stream = f"worker:{worker_id}"
        version = await self.store.stream_version(stream)
        # One id per (worker, stream version): the same loss recorded twice is stored once.
        lost = Envelope.wrap(WorkerLost(worker_id=worker_id, reason=why, last_seen=last_seen),
                             id=uuid.uuid5(uuid.NAMESPACE_URL, f"modelpool:{stream}:{version}:lost"))
        try:
            await self.store.append(stream, [lost], version, headers=self.telemetry.current_headers())
        except ConcurrencyError:
            return  # the worker spoke up (or registered again) meanwhile
        log.warning("worker %s lost: %s", worker_id, why)
        self.workers_lost += 1
        for inst in [r for r in self.view[INSTANCES].values() if r.worker_id == worker_id]:
            await self._instance_lost(inst, lost, f"worker {worker_id} lost ({why})")

    async def _instance_lost(self, row: InstanceRow, cause: Envelope, reason: str) -> None:
        """By legal transitions only: ERROR where the lifecycle allows it, else on to ABSENT."""
        backend, state = row.backend_type, row.state
        path = [S.ERROR] if instance_transition_allowed(backend, state, S.ERROR) else \
            ([S.ABSENT] if state is S.DELETING else [S.DELETING, S.ABSENT])
        events = []
        for target in path:
            change = InstanceStateChanged(
                instance_id=row.instance_id, alias=row.alias, backend_type=backend, engine=row.engine,
                worker_id=row.worker_id, from_state=state, to_state=target, reason=reason, endpoint=row.endpoint,
            )
            events.append(Envelope.wrap(change, causation=cause, id=derived_id(cause.id, f"{row.instance_id}:{target.value}")))
            state = target
        await self.store.append(f"instance:{row.instance_id}", events, headers=self.telemetry.current_headers())
