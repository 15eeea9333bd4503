"""Before a request is sent: its prompt's prefix pulled from another instance, its session bound to the instance
it goes to, or moved there with its KV.

A router with `pull_prefix` may name an instance holding more of the prompt than the one chosen: its cached
prefix is exported there and imported here first (`kv_moves.py`), or computed here when that fails.
Binding is only for routers that bind sessions (affinity, EAR). A new session is
bound to the slot's instance, unless its key has bound its `sessions_per_minute`
already (then it is served unbound, and its next request placed anew: a flood
of new session ids cannot grow the log without bound); a session the router moved (`Slot.moved_from`)
brings its KV along from the old host where the router's `move_kv` and both
engines allow (`kv_moves.py`), and the move is recorded with what it carried.
The log records bindings behind the request (`sessions.py`): nothing here
waits for the database. The session's request is kept, to export its KV by if
its host is drained (`handoff.py`).
"""

from __future__ import annotations

import logging

from services.gateway.context import RequestContext
from services.gateway.kv_moves import KVMove, KVMover
from services.gateway.metrics import GatewayMetrics
from services.gateway.quotas import Quotas
from services.gateway.routing import Router, Slot
from services.gateway.sessions import Sessions
from shared.projections.live import LiveView
from shared.projections.readmodels import INSTANCES

log = logging.getLogger(__name__)


class PreRequest:
    def __init__(self, router: Router, sessions: Sessions, view: LiveView, mover: KVMover,
                 metrics: GatewayMetrics, quotas: Quotas) -> None:
        self.router = router
        self.sessions = sessions
        self.view = view
        self.mover = mover
        self.metrics = metrics
        self.quotas = quotas

    async def prepare(self, ctx: RequestContext) -> None:
        slot = ctx.slot
        assert slot is not None
        if slot.prefix_from is not None:
            await self._pull_prefix(ctx, slot)
        if not slot.binds:
            return
        session_id = ctx.ask.prompt.session_id
        config = self.router.router_config(ctx.alias)
        if config.drain_handoff_s and config.move_kv:
            self.sessions.keep_request(session_id, ctx.path, ctx.payload)
        if slot.moved_from is not None:
            self.metrics.session_moved(ctx.alias, slot.reason)
            move = await self._move_kv(ctx, slot)
            self.sessions.migrate(session_id, ctx.alias, slot.moved_from, slot.instance_id, slot.reason, move.metrics())
        elif session_id not in self.sessions.bindings:
            if ctx.quota is None or self.quotas.may_bind(ctx.quota):
                self.sessions.bind(session_id, ctx.alias, slot.instance_id)
            else:
                self.metrics.session_unbound(ctx.alias)

    async def _pull_prefix(self, ctx: RequestContext, slot: Slot) -> None:
        """The prompt's cached prefix exported by the instance holding most of it and imported here; on failure
        the instance computes it (logged, counted)."""
        assert slot.prefix_from is not None
        held = slot.ask.tokens - slot.pending  # what the instance was expected to hold itself
        move = await self.mover.move(self.view[INSTANCES].get(slot.prefix_from), slot.instance,
                                     ctx.ask.prompt.session_id, ctx.path, ctx.payload,
                                     self.router.router_config(ctx.alias).kv_move_timeout_s)
        self.metrics.prefix_pull(ctx.alias, move.tokens if move.moved else None, move.seconds)
        if move.moved:
            self.router.kv_moved(slot, max(0, move.tokens - held))
        else:
            log.info("prefix of session %s not pulled from %s to %s: %s", ctx.ask.prompt.session_id,
                     slot.prefix_from, slot.instance_id, move.detail)

    async def _move_kv(self, ctx: RequestContext, slot: Slot) -> KVMove:
        config = self.router.router_config(ctx.alias)
        if not config.move_kv:
            return KVMove(False, detail="move_kv is off")
        assert slot.moved_from is not None
        move = await self.mover.move(self.view[INSTANCES].get(slot.moved_from), slot.instance,
                                     ctx.ask.prompt.session_id, ctx.path, ctx.payload, config.kv_move_timeout_s)
        self.metrics.kv_move(ctx.alias, move.moved, move.seconds)
        if move.moved:
            self.router.kv_moved(slot, move.tokens)
        else:
            log.info("session %s moved to %s without its KV: %s", ctx.ask.prompt.session_id, slot.instance_id,
                     move.detail)
        return move
