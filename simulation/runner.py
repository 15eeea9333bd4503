"""Drive a DecodeSystem offline: arrivals by time, one batch after another.

No I/O here: callers receive every StepResult through `on_step` and record
what they need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from simulation.core import DecodeSystem, SimRequest, StepResult


def run_until_idle(
    system: DecodeSystem,
    requests: Sequence[SimRequest],
    *,
    start_time: float = 0.0,
    on_arrival: Callable[[SimRequest, float], None] | None = None,
    on_step: Callable[[StepResult], None] | None = None,
    stop_after_batch: int | None = None,
) -> float:
    """Feed `requests` (sorted by arrival_time) and step until the system is idle.

    Returns the simulated time at the end. With `stop_after_batch`, stops right
    after that batch id executed (arrivals not yet fed are left untouched).
    """
    t = start_time
    i, n = 0, len(requests)
    while True:
        while i < n and requests[i].arrival_time <= t:
            system.add(requests[i])
            if on_arrival is not None:
                on_arrival(requests[i], requests[i].arrival_time)
            i += 1
        result = system.step(t)
        if result is None:
            if i < n:
                t = max(t, requests[i].arrival_time)
                continue
            return t
        if on_step is not None:
            on_step(result)
        t = result.end_time
        if stop_after_batch is not None and result.batch_id >= stop_after_batch:
            return t
