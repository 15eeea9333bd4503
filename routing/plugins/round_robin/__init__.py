"""round-robin: each request to the next instance in turn, whatever their load or cache."""

from __future__ import annotations

from routing.scheduler import Endpoint, RoutingRequest


class NextInTurn:
    """Scores 1 the instance after the last one picked, in instance-id order; 0 the others."""

    def __init__(self) -> None:
        self.last: str | None = None

    def __call__(self, _: RoutingRequest, endpoints: list[Endpoint]) -> list[float]:
        ids = sorted(e.instance_id for e in endpoints)
        following = next((i for i in ids if self.last is None or i > self.last), ids[0])
        self.last = following
        return [1.0 if e.instance_id == following else 0.0 for e in endpoints]
