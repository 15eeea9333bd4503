"""Scale-down hands sessions over: a host leaving service passes its sessions on before it goes.

When the log says an instance left RUNNING for a drain (scale-down, a sleep the
backend cannot take, an operator's drain) or for sleep, each gateway replica
re-binds the sessions it served there, the most recently active first, to the
instances that will serve them next (`Router.successor`: the running one
holding the fewest sessions' tokens, so they spread as their KV fits). A drained
host still holds their KV: where both engines can (`kv_moves.py`), it is moved
before the re-binding, exported by the session's last request; the controller
deletes the host only after the router's `drain_handoff_s`, the budget the moves
share (a move never outlasts it; sessions past it, or whose move fails,
recompute at their next turn on the new host). A host gone to sleep has already
lost its KV (vLLM keeps none in sleep mode): its sessions are re-bound only.
Every handoff is a `SessionMigrated` with reason `drain` and what it carried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence


from services.gateway.kv_moves import KVMove, KVMover
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import Router
from services.gateway.sessions import Sessions
from shared.contracts.config import RouterConfig
from shared.contracts.events import InstanceStateChanged
from shared.contracts.states import InstanceState
from shared.eventlog.store import StoredEvent
from shared.projections.live import LiveView
from shared.projections.readmodels import INSTANCES
from shared.projections.rows import InstanceRow

log = logging.getLogger(__name__)

S = InstanceState
LEAVING = frozenset({S.DRAINING, S.SLEEP_1, S.SLEEP_2})
"""From RUNNING to these, an instance takes no new requests: its sessions are handed over."""
REASON = "drain"
MAX_TARGETS = 3
"""Successors tried for one session when each leaves RUNNING while its KV moves there."""


class Handoff:
    """The handoffs of one gateway replica: one task per instance leaving service, cancelled when the replica stops."""

    def __init__(self, router: Router, sessions: Sessions, view: LiveView, mover: KVMover,
                 metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.router = router
        self.sessions = sessions
        self.view = view
        self.mover = mover
        self.metrics = metrics
        self.clock = clock
        self.wall = wall
        self.tasks: set[asyncio.Task] = set()

    def view_advanced(self, events: Sequence[StoredEvent]) -> None:
        for stored in events:
            e = stored.event
            if not (isinstance(e, InstanceStateChanged) and e.from_state is S.RUNNING and e.to_state in LEAVING):
                continue
            config = self.router.router_config(e.alias)
            if not (config.binds_sessions and config.drain_handoff_s) or not self.sessions.served_on(e.instance_id):
                continue
            ends = stored.occurred_at.timestamp() + config.drain_handoff_s  # when the controller may delete it
            task = asyncio.get_running_loop().create_task(
                self.hand_over(e.alias, e.instance_id, e.to_state is S.DRAINING, ends))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def hand_over(self, alias: str, instance_id: str, kv_kept: bool, ends: float) -> None:
        """Re-bind the sessions this replica served on `instance_id`, moving their KV first if `kv_kept`, until the
        wall clock reaches `ends` (then the rest are re-bound without it)."""
        started, moved, recomputed = self.clock(), 0, 0
        source = self.view[INSTANCES].get(instance_id)
        if source is None:
            return  # deleted already: each session is placed anew at its next turn
        config = self.router.router_config(alias)
        handed: set[str] = set()
        while waiting := [s for s in self.sessions.served_on(instance_id) if s not in handed]:
            # Again until none is left: another host's handoff may have sent a session here meanwhile (the log
            # had not yet said that this one drains too).
            done = await self._hand_over(alias, source, config, waiting, kv_kept, ends)
            if done is None:
                break
            handed.update(waiting)
            moved += done[0]
            recomputed += done[1]
        if moved or recomputed:
            log.info("%s handed over %d session(s) in %.2f s: %d with their KV, %d to recompute", instance_id,
                     moved + recomputed, self.clock() - started, moved, recomputed)

    async def _hand_over(self, alias: str, source: InstanceRow, config: RouterConfig, sessions: list[str],
                         kv_kept: bool, ends: float) -> tuple[int, int] | None:
        """Re-bind `sessions`; how many with their KV and without it, None when no other instance runs."""
        instance_id, moved, recomputed = source.instance_id, 0, 0
        for session_id in sessions:
            binding = self.sessions.bindings.get(session_id)
            if binding is None or binding.host != instance_id:
                continue  # a turn of the session moved it meanwhile
            for _ in range(MAX_TARGETS):
                target = self.router.successor(alias, source.backend_type, self.sessions.state(session_id))
                if target is None:
                    log.info("%s: no other instance runs; its sessions are placed anew at their next turns",
                             instance_id)
                    return None
                move = await self._move(session_id, source, target, kv_kept, config.move_kv,
                                        min(config.kv_move_timeout_s, ends - self.wall()))
                if self._running(target.instance_id):
                    break
                # It left RUNNING while the KV moved (scaled in at the same time): the next pick excludes it.
            binding = self.sessions.bindings.get(session_id)
            if binding is None or binding.host != instance_id or not self._running(target.instance_id):
                continue
            self.sessions.migrate(session_id, alias, instance_id, target.instance_id, REASON, move.metrics())
            self.metrics.session_moved(alias, REASON)
            if move.moved:
                moved += 1
            else:
                recomputed += 1
        return moved, recomputed

    def _running(self, instance_id: str) -> bool:
        row = self.view[INSTANCES].get(instance_id)
        return row is not None and row.state is S.RUNNING

    async def _move(self, session_id: str, source: InstanceRow, target: InstanceRow, kv_kept: bool, move_kv_on: bool,
                    budget_s: float) -> KVMove:
        if not kv_kept:
            return KVMove(False, detail="the host went to sleep: its KV is gone")
        if not move_kv_on:
            return KVMove(False, detail="move_kv is off")
        if budget_s <= 0:
            return KVMove(False, detail="the handoff's time is up: the new host recomputes")
        kept = self.sessions.last_requests.get(session_id)
        if kept is None:
            return KVMove(False, detail="no request of the session kept to export its KV by")
        move = await self.mover.move(source, target, session_id, kept[0], kept[1], budget_s)
        self.metrics.kv_move(target.alias, move.moved, move.seconds)
        return move

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
