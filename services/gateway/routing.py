"""Which instance serves a request: the routing state picks the backend, the alias's router plugin the instance.

Seed 000 §12.4 (`routing/backends.py`): fast only in FAST_ONLY / WARMING_VLLM /
DEGRADED_FAST, split by the mix weight (the share sent to vLLM) in MIXED, vLLM
first with llama.cpp as the floor in VLLM_PRIMARY. A COLD alias takes whatever instance comes up first,
so a request held through a cold start is served as soon as one runs, before the
controller has recorded the switch. Within the backend the alias's router
(`routing/plugins/`, chosen in the pool file) picks from what this gateway
counts on each instance and, for routers that bind sessions, the session table
(`sessions.py`). An alias of the gateway's pool file that the
controller has not registered yet (the pool is starting) is COLD. The gateway
decides nothing about states or replicas; it follows what its live view of the
log says.

A request waiting on an instance the log has given up (ERROR or gone: its engine
died, or its worker was lost to a partition) is withdrawn from it at once, so
the proxy sends it elsewhere instead of waiting out its timeouts (`Slot.watch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

from routing.backends import backend_order, taking_new
from routing.fairness import DEFAULT_TENANCY, Tenancy
from routing.registry import build_scheduler
from routing.scheduler import Endpoint, RoutingRequest, Scheduler, SessionState
from services.gateway.prompts import BLOCK_BYTES, PrefixIndex, Prompt, TokensPerByte
from services.gateway.sessions import Sessions
from shared.contracts.backends import BackendType
from shared.contracts.config import AliasConfig, RouterConfig
from shared.contracts.states import InstanceState, RoutingState
from shared.projections.live import LiveView
from shared.projections.readmodels import INSTANCES, ROUTING
from shared.projections.rows import InstanceRow


def _running_since(row: InstanceRow) -> tuple[datetime, str]:
    return row.updated_at, row.instance_id


@dataclass(frozen=True, slots=True)
class Ask:
    """What the router knows of a request before it is sent: its prompt's session and blocks, its tokens, its
    tenant (which orders its alias's queue); for a request sent again, the backend it stays on and the instances
    that failed it."""

    prompt: Prompt
    tokens: int
    backend: BackendType | None = None
    avoid: frozenset[str] = frozenset()
    tenancy: Tenancy = DEFAULT_TENANCY


NO_PROMPT = Ask(Prompt("", (), 0), 0)


@dataclass(eq=False, slots=True)
class Slot:
    """One request's place on an instance: taken from the router's count, given back with `Router.release`."""

    backend: BackendType
    instance: InstanceRow
    ask: Ask = NO_PROMPT
    pending: int = 0
    """Prompt tokens this request adds to the instance's pending prefill until its first token."""
    moved_from: str | None = None
    """Set when the router moves the request's session here from another host."""
    prefix_from: str | None = None
    """Set when the prompt's cached prefix is to be pulled from that instance before the request is sent."""
    reason: str = ""
    route: str = ""
    """Why this instance, as the answer explains it (`x-modelpool-route`): the router's reason, the tier's."""
    binds: bool = False
    """The alias's router binds sessions: the session's host is recorded."""
    withdrawn: bool = False
    """The log gave the instance up while the request was on it."""
    deadline: asyncio.Timeout | None = None
    """What the proxy is waiting for on the instance (`watch`), ended at once when the slot is withdrawn."""

    @property
    def instance_id(self) -> str:
        return self.instance.instance_id

    def watch(self, deadline: asyncio.Timeout | None) -> None:
        """The proxy waits on the instance within `deadline` (None: no longer waits)."""
        self.deadline = deadline
        if deadline is not None and self.withdrawn:
            self.withdraw()

    def withdraw(self) -> None:
        self.withdrawn = True
        if self.deadline is not None:
            with contextlib.suppress(RuntimeError):  # the wait has just ended on its own
                self.deadline.reschedule(asyncio.get_running_loop().time())


GIVEN_UP = frozenset({InstanceState.ERROR, InstanceState.ABSENT})
"""Instance states in which an engine answers nothing more: requests waiting on it are withdrawn."""


def tier_reason(state: RoutingState, mix_weight: float, first: BackendType, backend: BackendType) -> str:
    """Why the request went to `backend`'s tier, where the routing state left a choice (else nothing)."""
    if state is RoutingState.MIXED:
        share = f"mix: {BackendType.VLLM.value} step {round(mix_weight * 100)} %"
        return share if backend is first else f"{share}, {first.value} full"
    if state is RoutingState.COLD:
        return "cold: the first tier up"
    if backend is not first:
        return f"{state.value}: {first.value} full, {backend.value} the floor"
    return ""


BORROW_FRACTION = 4
"""A request borrowing past an instance's capacity (a tenant below its fair share, `admission.py`) may take up to
a quarter of its capacity (at least one) more: the overcommit is bounded, and passes as those requests end."""


def _has_room(row: InstanceRow, inflight: int, borrow: bool = False) -> bool:
    if not row.capacity:
        return True  # an instance that has not said its capacity takes what comes
    return inflight < row.capacity + (max(1, row.capacity // BORROW_FRACTION) if borrow else 0)


class Router:
    """Picks instances with the alias's router plugin and counts what this gateway has in flight on each.

    An instance takes at most its reported capacity of this gateway's requests at
    once (`take` answers None when no instance the routing state allows may take
    the request; admission queues it). The counts are the gateway's own: requests
    in flight and pending prefill tokens (prompt tokens sent and not yet past
    their first token, less what the instance was expected to have cached). With
    several replicas each balances its own share, which evens out the total.
    """

    def __init__(self, view: LiveView, rng: random.Random, configured: dict[str, AliasConfig] | None = None,
                 sessions: Sessions | None = None, wall: Callable[[], float] = time.time) -> None:
        self.view = view
        self.rng = rng
        self.configured = configured or {}
        self.sessions = sessions
        self.wall = wall
        self.inflight: dict[str, int] = {}
        self.pending: dict[str, int] = {}
        self.slots: dict[str, set[Slot]] = {}
        """The slots taken on each instance and not given back."""
        self.index = PrefixIndex()
        self.tokens = TokensPerByte()
        self._routable: dict[tuple[str, BackendType], list[InstanceRow]] | None = None
        self._schedulers: dict[str, tuple[RouterConfig, Scheduler]] = {}

    def view_advanced(self) -> None:
        self._routable = None
        rows = self.view[INSTANCES]
        for instance_id, slots in self.slots.items():
            row = rows.get(instance_id)
            if row is None or row.state in GIVEN_UP:
                for slot in slots:
                    if not slot.withdrawn:
                        slot.withdraw()

    def _instances(self, alias: str, backend: BackendType) -> list[InstanceRow]:
        if self._routable is None:
            # Rebuilt once per change of the view, not per request: the instance table spans every alias.
            index: dict[tuple[str, BackendType], list[InstanceRow]] = {}
            for row in self.view[INSTANCES].values():
                if row.state is InstanceState.RUNNING and row.endpoint:
                    index.setdefault((row.alias, row.backend_type), []).append(row)
            routing = self.view[ROUTING]
            for (name, tier), rows in index.items():
                alias_routing = routing.get(name)
                target = alias_routing.targets.get(tier) if alias_routing else None
                index[(name, tier)] = taking_new(rows, target, _running_since)
            self._routable = index
            self.index.forget({row.instance_id for rows in index.values() for row in rows})
        return self._routable.get((alias, backend), [])

    def known(self, alias: str) -> bool:
        return alias in self.view[ROUTING] or alias in self.configured

    def state(self, alias: str) -> tuple[RoutingState, float]:
        routing = self.view[ROUTING].get(alias)
        return (RoutingState.COLD, 0.0) if routing is None else (routing.state, routing.mix_weight)

    def config(self, alias: str) -> AliasConfig | None:
        """The alias's configuration as the controller registered it, else as the pool file has it."""
        routing = self.view[ROUTING].get(alias)
        return (routing.config if routing else None) or self.configured.get(alias)

    def router_config(self, alias: str) -> RouterConfig:
        config = self.config(alias)
        return config.router if config else RouterConfig()

    def scheduler(self, alias: str) -> Scheduler:
        config = self.router_config(alias)
        known = self._schedulers.get(alias)
        if known is None or known[0] != config:  # built once per configuration, not per request
            known = self._schedulers[alias] = (config, build_scheduler(config, self.rng))
        return known[1]

    def max_model_len(self, alias: str, backend: BackendType) -> int | None:
        config = self.config(alias)
        tier = config.backends.get(backend) if config else None
        return tier.max_model_len if tier else None

    def take(self, alias: str, ask: Ask = NO_PROMPT, borrow: bool = False) -> Slot | None:
        """A slot for one request of `alias`, or None when no instance it may use may take it now; `borrow`: past
        an instance's capacity, within `BORROW_FRACTION` of it."""
        if ask.backend:
            return self.take_in(alias, ask.backend, ask, ask.avoid, borrow)
        state, weight = self.state(alias)
        backends = backend_order(state, weight, self.rng.random())
        for backend in backends:
            slot = self.take_in(alias, backend, ask, ask.avoid, borrow)
            if slot is not None:
                tier = tier_reason(state, weight, backends[0], backend)
                if tier:
                    slot.route = f"{slot.route}; {tier}"
                return slot
        return None

    def has_other(self, alias: str, backend: BackendType, avoid: frozenset[str]) -> bool:
        """Whether an instance of `backend` other than those in `avoid` runs, full or not."""
        return any(row.instance_id not in avoid for row in self._instances(alias, backend))

    def take_in(self, alias: str, backend: BackendType, ask: Ask = NO_PROMPT,
                exclude: frozenset[str] = frozenset(), borrow: bool = False) -> Slot | None:
        """A slot on the instance of `backend` the alias's router picks, if one may take the request."""
        rows = {row.instance_id: row for row in self._instances(alias, backend) if row.instance_id not in exclude}
        if not rows:
            return None
        scheduler = self.scheduler(alias)
        kv_len = self.max_model_len(alias, backend)
        endpoints = {i: self._endpoint(row, ask, scheduler.reads_cache, kv_len, borrow) for i, row in rows.items()}
        if scheduler.binds_sessions and self.sessions is not None:
            session = self.sessions.state(ask.prompt.session_id)
        else:
            session = SessionState(ask.prompt.session_id)
        choice = scheduler.choose(RoutingRequest(session, ask.tokens, self.wall()), list(endpoints.values()))
        if choice is None:
            return None
        instance_id = choice.instance_id
        row = rows[instance_id]
        cached = endpoints[instance_id].cached_tokens if scheduler.reads_cache else self._cached_tokens(alias, instance_id, ask)
        pending = max(0, ask.tokens - cached)
        self.inflight[instance_id] = self.inflight.get(instance_id, 0) + 1
        self.pending[instance_id] = self.pending.get(instance_id, 0) + pending
        limit = row.capacity and kv_len and self._blocks_of(alias, row.capacity * kv_len)
        self.index.sent(instance_id, ask.prompt.blocks, limit or None)
        slot = Slot(backend, row, ask, pending, choice.moved_from, choice.prefix_from, choice.reason,
                    f"{backend.value} {instance_id}; {scheduler.name}: {choice.why}", scheduler.binds_sessions)
        self.slots.setdefault(instance_id, set()).add(slot)
        return slot

    def successor(self, alias: str, backend: BackendType, session: SessionState) -> InstanceRow | None:
        """Where a session leaving its host (drained, or put to sleep) will be served next: among the running
        instances the routing state allows, on the host's backend if it may take requests (its KV can move
        there), the one holding the fewest sessions' tokens (where its KV fits best: a handoff moves many
        sessions at once, and piling them on one host would evict them), the alias's router deciding ties.
        None when nothing else runs."""
        allowed = backend_order(*self.state(alias), 0.0)  # a draw of 0 lists every backend the state allows
        for tier in sorted(allowed, key=lambda b: b is not backend):
            rows = [row for row in self._instances(alias, tier) if row.instance_id != session.host]
            if not rows:
                continue
            resident = {row.instance_id: self.sessions.kv_resident(row.instance_id) if self.sessions else 0
                        for row in rows}
            least = min(resident.values())
            roomiest = {row.instance_id: row for row in rows if resident[row.instance_id] == least}
            kv_len = self.max_model_len(alias, tier)
            # Room or not: no request goes now.
            endpoints = [replace(self._endpoint(row, NO_PROMPT, False, kv_len), full=False) for row in roomiest.values()]
            choice = self.scheduler(alias).choose(RoutingRequest(session, session.context_tokens, self.wall()),
                                                  endpoints)
            return roomiest[choice.instance_id] if choice is not None else next(iter(roomiest.values()))
        return None

    def _endpoint(self, row: InstanceRow, ask: Ask, reads_cache: bool, kv_len: int | None,
                  borrow: bool = False) -> Endpoint:
        instance_id = row.instance_id
        inflight = self.inflight.get(instance_id, 0)
        kv_free = None
        if row.capacity and kv_len:
            resident = self.sessions.kv_resident(instance_id) if self.sessions is not None else 0
            kv_free = row.capacity * kv_len - resident
        return Endpoint(instance_id, inflight, not _has_room(row, inflight, borrow), self.pending.get(instance_id, 0),
                        self._cached_tokens(row.alias, instance_id, ask) if reads_cache else 0, kv_free, row.capacity,
                        moves_kv=bool(row.internal_endpoint))

    def _cached_tokens(self, alias: str, instance_id: str, ask: Ask) -> int:
        blocks = self.index.matched(instance_id, ask.prompt.blocks)
        return min(ask.tokens, self.tokens.tokens(alias, blocks * BLOCK_BYTES)) if blocks else 0

    def _blocks_of(self, alias: str, tokens: int) -> int:
        per_block = max(1, self.tokens.tokens(alias, BLOCK_BYTES))
        return max(1, tokens // per_block)

    def first_token(self, slot: Slot) -> None:
        """The slot's prompt is computed: it no longer weighs on the instance's pending prefill."""
        if slot.pending:
            self._unpend(slot)

    def kv_moved(self, slot: Slot, tokens: int) -> None:
        """`tokens` of the slot's prompt were brought along (its session's KV, or a pulled prefix beyond what the
        instance held): they need no prefill there."""
        done = min(slot.pending, tokens)
        if done:
            left = self.pending.get(slot.instance_id, 0) - done
            slot.pending -= done
            if left > 0:
                self.pending[slot.instance_id] = left
            else:
                self.pending.pop(slot.instance_id, None)

    def capacity(self, alias: str) -> int | None:
        """The concurrent requests the instances the routing state allows take in all; None when one of them has
        not said (it takes what comes)."""
        rows = [row for b in backend_order(*self.state(alias), 0.0) for row in self._instances(alias, b)]
        return None if any(not row.capacity for row in rows) else sum(row.capacity for row in rows)

    def routable(self, alias: str) -> bool:
        """Whether any instance the routing state allows is running, full or not."""
        # A draw of 0 lists every backend the state allows (MIXED lists both whatever the weight).
        return any(self._instances(alias, b) for b in backend_order(*self.state(alias), 0.0))

    def release(self, slot: Slot) -> None:
        instance_id = slot.instance_id
        if slot.pending:
            self._unpend(slot)
        left = self.inflight[instance_id] - 1
        if left:
            self.inflight[instance_id] = left
            self.slots[instance_id].discard(slot)
        else:
            del self.inflight[instance_id]  # instances come and go: keep only those with requests
            del self.slots[instance_id]

    def _unpend(self, slot: Slot) -> None:
        instance_id = slot.instance_id
        left = self.pending.get(instance_id, 0) - slot.pending
        slot.pending = 0
        if left > 0:
            self.pending[instance_id] = left
        else:
            self.pending.pop(instance_id, None)
