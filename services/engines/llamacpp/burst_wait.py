"""Whether an idle engine waits for the rest of a burst before its first step.

Requests that arrive together (clients fanning out, a batch job, a cold start's
wave) reach the decode thread one by one, as the event loop parses them;
starting the first alone makes the others wait out its whole step. But waiting
costs a lone stream the window on every request, since each of its requests
finds the engine idle. So the engine waits only while bursts are what it sees:
when it last started from idle, another request arrived within the window of
the first, before the engine was idle again. A lone stream pays the wait once;
a burst after a quiet spell starts its first request alone (the rest join the
next step) and arms the wait for the next burst.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class BurstWait:
    window_s: float
    expecting: bool = True
    """Whether the next start from idle waits (true at first: an engine's first requests are a cold start's wave)."""
    _started_at: float | None = None
    """Arrival of the request that last started the engine from idle."""

    def wait_s(self, now: float, arrivals: Sequence[float]) -> float:
        """How much longer an idle engine with these queued requests (arrival times, oldest first) waits: 0 goes now."""
        if not self.window_s or not self.expecting or not arrivals:
            return 0.0
        return self.window_s - (now - arrivals[0])

    def started(self, arrivals: Sequence[float]) -> None:
        """The idle engine starts on these queued requests (arrival times, oldest first)."""
        self._started_at = arrivals[0]
        self.expecting = any(t - arrivals[0] <= self.window_s for t in arrivals[1:])

    def arrived(self, at: float, *, busy: bool) -> None:
        """A request arrived; while the engine is `busy` with the requests it started on from idle, and within the
        window of that start, it is their company (a lone stream's next request comes after the engine went idle)."""
        if busy and self._started_at is not None and 0 <= at - self._started_at <= self.window_s:
            self.expecting = True
