"""The load one decision works from: the merged gateway window, or the workers' view without one."""

from __future__ import annotations

from dataclasses import dataclass

from shared.contracts.backends import BackendType
from shared.contracts.control import AliasSnapshot
from shared.contracts.states import InstanceState

FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM
RUNNING = InstanceState.RUNNING


@dataclass(slots=True)
class Load:
    """The load one decision works from: the merged gateway window, or the workers' view without one."""

    inflight_fast: float
    inflight_slow: float
    waiting: int
    """Requests held at the gateways for an instance to start or wake."""
    arrivals: int
    queue_wait_p95: float | None = None
    e2e_p95_fast: float | None = None
    e2e_p95_slow: float | None = None
    slow_failures: int = 0
    """vLLM errors and timeouts in the window."""
    measured: bool = False
    queued: float = 0.0
    """Requests waiting in the gateways for a slot, averaged over the window: demand the instances
    have no room for yet (the gateways admit at most an instance's capacity), so it counts as load."""

    @property
    def total(self) -> float:
        """inflight_total of seed 000: every request in the system, on an instance or waiting for one."""
        return self.inflight_fast + self.inflight_slow + self.queued

    @property
    def fast_demand(self) -> float:
        """inflight_fast with the waiting requests: in the states where it is read (FAST_ONLY, DEGRADED_FAST)
        only the fast tier is routed, so the queue waits for it."""
        return self.inflight_fast + self.queued

    @property
    def busy(self) -> bool:
        return self.total > 0 or self.waiting > 0 or self.arrivals > 0


def load_of(s: AliasSnapshot) -> Load:
    m = s.metrics
    if m is None:
        running = [i for i in s.instances if i.state is RUNNING]
        return Load(
            inflight_fast=float(sum(i.inflight for i in running if i.backend is FAST)),
            inflight_slow=float(sum(i.inflight for i in running if i.backend is SLOW)),
            waiting=s.demand, arrivals=0,
        )
    return Load(
        inflight_fast=m.inflight_fast, inflight_slow=m.inflight_slow, waiting=max(s.demand, m.held),
        arrivals=m.arrivals, queue_wait_p95=m.queue_wait_p95_s, e2e_p95_fast=m.e2e_p95_fast_s,
        e2e_p95_slow=m.e2e_p95_slow_s, slow_failures=m.errors_slow + m.timeouts_slow, measured=True,
        # Waiting for a slot on a running instance is load; waiting for the first one to start is a cold start
        # (its demand starts one instance, and the held wave is served once it runs). So the queue counts
        # only in a window with an instance running from its start.
        queued=m.queue_len if m.queue_len and any(
            i.state is RUNNING and i.state_since <= m.window_start for i in s.instances) else 0.0,
    )
