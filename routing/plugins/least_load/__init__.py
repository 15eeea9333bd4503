"""least-load: the instance with the fewest pending prefill tokens (LMetric-like), then the fewest requests.

Agentic requests are prefill-heavy (seed 004 §2.1: 75 input tokens per output
token), so what delays a new request's first token is the prompt work queued
ahead of it: prompt tokens dispatched and not yet past their first token, less
what each instance's prefix cache was expected to hold. Requests in flight
break ties, so decode-only load still spreads.
"""

from __future__ import annotations

from routing.scheduler import Endpoint, RoutingRequest, fewest

INFLIGHT_WEIGHT = 0.01
"""Small beside the prefill score: it only orders instances whose pending prefill is equal."""


def least_pending_prefill(_: RoutingRequest, endpoints: list[Endpoint]) -> list[float]:
    return fewest([e.pending_prefill for e in endpoints])


def least_inflight(_: RoutingRequest, endpoints: list[Endpoint]) -> list[float]:
    return fewest([e.inflight for e in endpoints])
