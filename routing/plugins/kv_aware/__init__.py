"""kv-aware: a linear combination of the expected prefix-cache hit and the load (llm-d's prefix and load scorers).

The expected hit is the share of the prompt's leading blocks the gateway has
already sent to the instance (its index of what each instance was asked to
cache); the load is least-load's pending prefill score. The weights are the
router's `kv_weight` and `load_weight` (2 and 1 by default, as llm-d weighs its
prefix-cache scorer over its load scorer).
"""

from __future__ import annotations

from routing.scheduler import Endpoint, RoutingRequest


def prefix_hit(request: RoutingRequest, endpoints: list[Endpoint]) -> list[float]:
    """The share of the prompt each instance is expected to hold in its prefix cache."""
    if request.prompt_tokens <= 0:
        return [0.0] * len(endpoints)
    return [min(1.0, e.cached_tokens / request.prompt_tokens) for e in endpoints]
