"""The router as plugins, in the shape of llm-d's scheduler: filters, weighted scorers, a picker.

A request's candidates are the instances its backend may use. Filters narrow
them, in order; each scorer rates every remaining candidate in [0, 1]; the
picker takes the highest weighted sum (ties at random, so gateway replicas that
each see only their own requests do not all pick the same instance). A filter
that leaves nothing means no candidate may take the request now: it waits in
the gateway's queue.

Everything here is pure: the gateway (and the policy lab's simulated cluster)
gathers the state into `Endpoint`s and a `RoutingRequest`, asks `Scheduler.choose`,
and applies the `Choice`, binding or moving the session when it says so.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One instance as the router sees it when a request arrives."""

    instance_id: str
    inflight: int = 0
    """Requests of this gateway on the instance."""
    full: bool = False
    """The instance has as many of this gateway's requests as its capacity."""
    pending_prefill: int = 0
    """Prompt tokens dispatched to it and not yet past their first token, less what its cache was expected to hold."""
    cached_tokens: int = 0
    """Tokens of this request's prompt the instance is expected to hold in its prefix cache."""
    kv_free_tokens: int | None = None
    """KV room left for another session's context; None when unknown (taken as enough)."""
    capacity: int | None = None
    """Concurrent requests the instance takes, as its engine reported; None when it has not said."""
    moves_kv: bool = False
    """The instance's engine exports and imports a session's KV (it has an internal KV port)."""


@dataclass(frozen=True, slots=True)
class SessionState:
    """A request's session, and where it is bound if it is."""

    session_id: str
    host: str | None = None
    """The instance holding the session's KV, for routers that bind sessions."""
    moved_at: float | None = None
    """When the session last migrated, in the clock of `RoutingRequest.now`."""
    context_tokens: int = 0
    """Tokens of context the session holds on its host (what a move would carry)."""


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    session: SessionState
    prompt_tokens: int
    now: float


@dataclass(frozen=True, slots=True)
class Choice:
    """Where the request goes; `moved_from` set when a bound session leaves its host."""

    instance_id: str
    moved_from: str | None = None
    reason: str = ""
    why: str = ""
    """Why this instance, in one short phrase (`session bound`, `2 of 8 slots busy`)."""
    prefix_from: str | None = None
    """The instance to pull the prompt's cached prefix from before the request is sent (`pulls_prefix`)."""


MIN_PULL_TOKENS = 512
"""A held prefix shorter than this (one block of a Mooncake trace) is computed again rather than pulled: the pull's
two calls cost more than so little prefill."""

Filter = Callable[[RoutingRequest, list[Endpoint]], list[Endpoint]]
Scorer = Callable[[RoutingRequest, list[Endpoint]], list[float]]


@runtime_checkable
class Settles(Protocol):
    """A filter that keeps account of the placements it took part in."""

    def settle(self, choice: Choice, picked: Endpoint) -> None: ...


def has_room(_: RoutingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
    """Instances below their capacity of this gateway's requests (admission's bound, applied by every router)."""
    return [e for e in endpoints if not e.full]


def fewest(values: Sequence[float]) -> list[float]:
    """1 for the smallest value, falling linearly to 0 for the largest (all 1 when they are equal)."""
    low, high = min(values), max(values)
    if high == low:
        return [1.0] * len(values)
    return [(high - v) / (high - low) for v in values]


@dataclass(frozen=True, slots=True)
class Weighted:
    scorer: Scorer
    weight: float
    describe: Callable[[Endpoint], str] | None = None
    """What this scorer saw of the instance it decided for, in a few words."""


class Scheduler:
    """Filters, then weighted scorers, then the highest total; `binds_sessions` routers keep a session's host."""

    def __init__(self, name: str, filters: Sequence[Filter], scorers: Sequence[Weighted], rng: random.Random, *,
                 binds_sessions: bool = False, per_session: bool = False, reads_cache: bool = False,
                 pulls_prefix: bool = False) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.rng = rng
        self.binds_sessions = binds_sessions
        self.per_session = per_session or binds_sessions
        """Where a request may go depends on its session: one that must wait does not make the next wait."""
        self.reads_cache = reads_cache
        """Its filters or scorers read `Endpoint.cached_tokens` (worked out only for routers that do)."""
        self._settling = [f for f in self.filters if isinstance(f, Settles)]
        """Filters told of every placement (a budget they keep)."""
        self.pulls_prefix = pulls_prefix
        """A request placed where less of its prompt is held than on another instance pulls the difference from
        it, where both move KV; a session's later turns and moves do not (its host holds, or carries, its KV)."""

    def choose(self, request: RoutingRequest, endpoints: Sequence[Endpoint]) -> Choice | None:
        """The instance for `request`, or None when no candidate may take it now."""
        holder = self._prefix_holder(request, endpoints)
        candidates = list(endpoints)
        if holder is not None:  # every instance that can pull sees the prefix as its own
            candidates = [replace(e, cached_tokens=max(e.cached_tokens, holder.cached_tokens)) if e.moves_kv else e
                          for e in candidates]
        for narrow in self.filters:
            candidates = narrow(request, candidates)
            if not candidates:
                return None
        totals = [0.0] * len(candidates)
        scores = []
        for weighted in self.scorers:
            scored = weighted.scorer(request, candidates)
            scores.append(scored)
            for i, score in enumerate(scored):
                totals[i] += weighted.weight * score
        top = max(totals)
        ties = [i for i, total in enumerate(totals) if total == top]
        best = ties[0] if len(ties) == 1 else ties[self.rng.randrange(len(ties))]
        choice = self._choice(request, endpoints, holder, candidates, scores, best, len(ties))
        for narrow in self._settling:
            narrow.settle(choice, candidates[best])
        return choice

    def _choice(self, request: RoutingRequest, endpoints: Sequence[Endpoint], holder: Endpoint | None,
                candidates: list[Endpoint], scores: list[list[float]], best: int, tied: int) -> Choice:
        picked = candidates[best].instance_id
        host = request.session.host
        if not self.binds_sessions or host is None or host == picked:
            if host == picked and self.binds_sessions:
                return Choice(picked, reason="bound", why="session bound")
            why = self._why(candidates, scores, best, tied)
            chosen = next(e for e in endpoints if e.instance_id == picked)
            if (holder is not None and chosen.moves_kv and chosen is not holder
                    and holder.cached_tokens - chosen.cached_tokens >= MIN_PULL_TOKENS):
                return Choice(picked, reason="scored", why=f"{why}, {tokens_text(holder.cached_tokens)} pulled",
                              prefix_from=holder.instance_id)
            return Choice(picked, reason="scored", why=why)
        if all(e.instance_id != host for e in endpoints):
            return Choice(picked, moved_from=host, reason="host_gone", why="session's host gone, placed anew")
        return Choice(picked, moved_from=host, reason="host_hot",
                      why=f"moved off hot instance with {tokens_text(request.session.context_tokens)} of KV")

    def _prefix_holder(self, request: RoutingRequest, endpoints: Sequence[Endpoint]) -> Endpoint | None:
        """The instance to pull the request's prompt prefix from: the one holding most of it among those that move
        KV, for a request not bound to a live host. None when nothing is worth pulling."""
        if not self.pulls_prefix:
            return None
        if self.binds_sessions and any(e.instance_id == request.session.host for e in endpoints):
            return None
        holder = max((e for e in endpoints if e.moves_kv), key=lambda e: e.cached_tokens, default=None)
        return holder if holder is not None and holder.cached_tokens >= MIN_PULL_TOKENS else None

    def _why(self, candidates: list[Endpoint], scores: list[list[float]], best: int, tied: int) -> str:
        """The scorer that set the pick apart (the widest weighted lead over the runner-up), and what it saw."""
        if len(candidates) == 1:
            return "session hash" if self.per_session and not self.binds_sessions else "the only instance with room"
        lead, decisive = 0.0, None
        for weighted, scored in zip(self.scorers, scores):
            runner_up = max(score for i, score in enumerate(scored) if i != best)
            if weighted.weight * (scored[best] - runner_up) > lead:
                lead, decisive = weighted.weight * (scored[best] - runner_up), weighted
        if decisive is None:  # no scorer told them apart: the draw did
            first = self.scorers[0] if self.scorers else None
            seen = first.describe(candidates[best]) + ", " if first is not None and first.describe else ""
            return f"{seen}{tied} of {len(candidates)} tied, drawn"
        return decisive.describe(candidates[best]) if decisive.describe else "highest score"


def tokens_text(tokens: int) -> str:
    """3.1k tokens, 512 tokens."""
    return f"{tokens / 1000:.1f}k tokens" if tokens >= 1000 else f"{tokens} tokens"
