"""EAR, the Elastic Affinity Router (seed 004 §4): affinity by default, a hot host's session moved where it waits less.

- A new session is placed as least-load places a request, by the fewest
  pending prefill tokens (the seed's rule). Where prompts open with a prefix
  many sessions share (a tool description), that spreads the prefix over
  every instance, each computing it once, and a warm pool then serves it from
  every instance's cache: load decides alone, as it should for a first token
  (the trade against keeping the prefix on fewer instances is measured in
  docs/benchmarks.md, the tool-and-agent slice).
- Later turns go to the session's host, where its KV is.
- When the host's pending prefill tokens exceed `T_hot` (or it is full), and the
  session has not moved within `T_cool`, the session may move: to an instance
  that can hold its context in KV and where the move costs fewer prefill tokens
  than staying. Staying costs the host's queue and the turn's new tokens. A
  move costs the target's queue and what it must compute of the prompt (all of
  it less what it holds, or less the context carried along when both engines
  move KV), and the context it recomputes once more: that work delays the
  target's other requests, so a move must save the request more than it adds.
  The cheapest wins. None qualifies: it stays (the move is opportunistic, never
  forced).
- Moves that recompute spend a budget: all of them together may recompute at
  most `recompute_budget` (2 %) of the prefix-cache hits the router's
  placements expect, so EAR where KV cannot move (vLLM) keeps at least 98 % of
  the cache hits affinity would keep, however hot its hosts run. A move that
  carries the KV recomputes nothing and spends nothing.

Every quantity is one the router observes in tokens (pending prefill, the
prefix index's expected hits, the session's context), not a predicted transfer
time (§4.3.2). Counting the recompute is what keeps EAR from moving a session
off its cache to save less wait than the move costs: with long prompts (a
Mooncake conversation's are 12,000 tokens) a host is over `T_hot` with one
prompt in prefill, and a move that recomputes can cost more than it saves.
Where the KV moves along nothing is recomputed, and the rule is the seed's:
strictly less pending prefill.

With `migrate` off this is the "affinity" router: a session never leaves a host
that runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from routing.scheduler import Choice, Endpoint, RoutingRequest


def prefill_wait(endpoint: Endpoint, prompt_tokens: int, held: int) -> int:
    """Prefill tokens the request waits for on `endpoint`: those queued there, then its own less the `held` ones."""
    return endpoint.pending_prefill + max(0, prompt_tokens - held)


@dataclass(slots=True)
class RecomputeLedger:
    """What moves that recompute may still spend: `budget` of every expected cache hit earned, less what they
    recomputed (no bound when `budget` is None)."""

    budget: float | None
    earned: float = 0.0
    spent: int = 0
    owed: dict[str, int] = field(default_factory=dict)
    """The recompute a move to each target the filter offered would cost, until the scheduler picks one."""

    @property
    def allowance(self) -> float:
        return math.inf if self.budget is None else self.budget * self.earned - self.spent


@dataclass(frozen=True, slots=True)
class SessionHost:
    """The filter: the host alone, or the instances the session may move to, or (new session) everyone."""

    t_hot_tokens: int
    t_cool_s: float
    migrate: bool = True
    move_kv: bool = True
    """A move carries the session's KV where both engines can (`Endpoint.moves_kv`); otherwise the target
    recomputes what it does not hold."""
    ledger: RecomputeLedger = field(default_factory=lambda: RecomputeLedger(None))
    """The budget moves that recompute spend (`RouterConfig.recompute_budget`)."""

    def __call__(self, request: RoutingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        session = request.session
        host = next((e for e in endpoints if e.instance_id == session.host), None)
        if host is None:
            return endpoints  # a new session, or its host is gone: placed by load
        hot = host.full or host.pending_prefill > self.t_hot_tokens
        cooling = session.moved_at is not None and request.now - session.moved_at < self.t_cool_s
        if not (hot and self.migrate) or cooling:
            return [host]
        here = prefill_wait(host, request.prompt_tokens, host.cached_tokens)
        carried = host.cached_tokens if self.move_kv and host.moves_kv else 0
        costs, recomputes = {}, {}
        for e in endpoints:
            if e is host or e.full or (e.kv_free_tokens is not None and e.kv_free_tokens < session.context_tokens):
                continue
            held = max(e.cached_tokens, carried if e.moves_kv else 0)
            recompute = max(0, host.cached_tokens - held)
            if recompute > self.ledger.allowance:
                continue
            # The prefill the move adds to the pool (the context recomputed) counts once more: a move must save
            # the request more wait than the work it makes the target's other requests wait behind.
            costs[e.instance_id] = prefill_wait(e, request.prompt_tokens, held) + recompute
            recomputes[e.instance_id] = recompute
        least = min(costs.values(), default=None)
        # Strictly cheaper; from a full host, which cannot take the request now, no dearer.
        if least is None or least > here or (least == here and not host.full):
            return [host]
        targets = [e for e in endpoints if costs.get(e.instance_id) == least]
        self.ledger.owed = {e.instance_id: recomputes[e.instance_id] for e in targets}
        return targets

    def settle(self, choice: Choice, picked: Endpoint) -> None:
        """The scheduler placed a request: its expected cache hit earns budget, and a move off a hot host spends
        what it recomputes."""
        self.ledger.earned += picked.cached_tokens
        if choice.reason == "host_hot":
            self.ledger.spent += self.ledger.owed.get(choice.instance_id, 0)
        self.ledger.owed = {}
