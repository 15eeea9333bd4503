"""EAR, the Elastic Affinity Router (seed 004 §4): affinity by default, a hot host's session moved away.

- A new session goes to the instance with the fewest pending prefill tokens.
- Later turns go to the session's host, where its KV is.
- When the host's pending prefill tokens exceed `T_hot` (or it is full), and the
  session has not moved within `T_cool`, the session moves: to the instance with
  the fewest pending prefill tokens among those that can hold its context in KV
  and are strictly less loaded than the host. None qualifies: it stays (the move
  is opportunistic, never forced).

The load is what the router observes (pending prefill), not a predicted transfer
time (§4.3.2). With `migrate` off this is the "affinity" router: a session never
leaves a host that runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.scheduler import Endpoint, RoutingRequest


@dataclass(frozen=True, slots=True)
class SessionHost:
    """The filter: the host alone, or the instances the session may move to, or (new session) everyone."""

    t_hot_tokens: int
    t_cool_s: float
    migrate: bool = True

    def __call__(self, request: RoutingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        session = request.session
        host = next((e for e in endpoints if e.instance_id == session.host), None)
        if host is None:
            return endpoints  # a new session, or its host is gone: placed by load
        hot = host.full or host.pending_prefill > self.t_hot_tokens
        cooling = session.moved_at is not None and request.now - session.moved_at < self.t_cool_s
        if not (hot and self.migrate) or cooling:
            return [host]
        # Strictly less loaded: less pending prefill, or, from a full host, room and no more pending prefill.
        targets = [e for e in endpoints if e is not host and not e.full
                   and (e.pending_prefill < host.pending_prefill or (host.full and e.pending_prefill == host.pending_prefill))
                   and (e.kv_free_tokens is None or e.kv_free_tokens >= session.context_tokens)]
        return targets or [host]
