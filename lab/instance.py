"""One simulated instance at event level: seed 002's batch timing without stepping batch by batch.

A running instance decodes its requests in batches of `d_0 + d_1 * n` seconds
(n: requests it holds), one token per request per batch, as the decode system
of `simulation/` does with a decode cost of one token; a request's prompt is
prefilled in the batch it joins, which stalls everyone by `d_1` per uncached
prompt token (chunked prefill inside the budget). Instead of stepping every
batch, the instance counts batches done (`steps`, a float) and moves on
analytically between events: a request that joins at step s with k tokens to
generate finishes at step s + k, so completions come off a heap in O(log n).
A day of traffic over a hundred instances runs in seconds; `tests/lab`
checks the timing against `simulation.core.DecodeSystem` on the same arrivals.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from routing.scheduler import Endpoint
from shared.contracts.backends import BackendType, Role
from shared.contracts.states import InstanceState


@dataclass(frozen=True, slots=True)
class TierModel:
    """A tier's timing, capacity and memory (seed 000 §13.1 `mu`, `tau`, `m`)."""

    startup_s: float
    wake_l1_s: float
    wake_l2_s: float
    d_0: float
    d_1: float
    capacity: int
    """Requests it takes at once (what its engine reports: llama.cpp slots, vLLM KV at max_model_len)."""
    kv_tokens: int
    """Prefix-cache room for session contexts (0: no cross-request cache)."""
    memory_gb: float
    """GPU memory while starting or awake (m_f, m_s_act)."""
    sleep_memory_gb: float
    """GPU memory asleep (m_s_slp)."""
    engine: str
    """What this tier models, said wherever results are shown."""


@dataclass(slots=True, eq=False)
class Job:
    """One request's stay on one instance."""

    request: "object"
    finish_step: float
    first_token_at: float
    prompt_tokens: int
    cached_tokens: int


@dataclass(slots=True, eq=False)
class LabInstance:
    instance_id: str
    backend: BackendType
    worker_id: str
    model: TierModel
    state: InstanceState
    since: float
    role: Role | None = None
    sleep_level: int = 0
    ready_at: float | None = None
    """When a start or a wake completes."""
    drain_deadline: float | None = None
    steps: float = 0.0
    t_ref: float = 0.0
    busy_until: float = 0.0
    """Prefill stalls decoding until then."""
    jobs: list[tuple[float, int, Job]] = field(default_factory=list)
    last_active: float | None = None
    forming: list[Job] = field(default_factory=list)
    """Jobs admitted for the next batch, not started yet (at `forming_at`): a later arrival joins them."""
    forming_at: float = -1.0
    prefilling: deque[tuple[float, int]] = field(default_factory=deque)
    """(first token at, prompt tokens to prefill) of jobs not yet past their first token, in that order."""
    version: int = 0
    """Bumped whenever its next completion time may have moved (older scheduled events are stale)."""
    cache: OrderedDict[str, int] = field(default_factory=OrderedDict)
    cached_total: int = 0
    served: int = 0
    _endpoint: Endpoint | None = None
    _endpoint_version: int = -1
    _endpoint_until: float = 0.0

    @property
    def inflight(self) -> int:
        return len(self.jobs)

    def batch_s(self, n: int | None = None) -> float:
        return self.model.d_0 + self.model.d_1 * (len(self.jobs) if n is None else n)

    def advance(self, now: float) -> float:
        """Bring `steps` up to `now`; the tokens generated meanwhile (for the decode rate)."""
        n = len(self.jobs)
        start = self.t_ref if self.t_ref > self.busy_until else self.busy_until
        if now <= start:
            self.t_ref = start
            return 0.0
        self.t_ref = now
        if n == 0:
            return 0.0
        done = (now - start) / (self.model.d_0 + self.model.d_1 * n)
        self.steps += done
        return done * n

    def cached_for(self, session: str, prompt_tokens: int) -> int:
        held = self.cache.get(session)
        return min(held, prompt_tokens) if held else 0

    def endpoint(self, now: float) -> Endpoint:
        """The instance as a router sees it (without cache hits), rebuilt only when it changed."""
        cached = self._endpoint
        if cached is not None and self._endpoint_version == self.version and now < self._endpoint_until:
            return cached
        n = len(self.jobs)
        self._endpoint = Endpoint(self.instance_id, n, n >= self.model.capacity, self.pending_prefill(now))
        self._endpoint_version = self.version
        self._endpoint_until = self.prefilling[0][0] if self.prefilling else math.inf
        return self._endpoint

    def pending_prefill(self, now: float) -> int:
        """Prompt tokens admitted and not yet past their first token (what EAR and kv-aware weigh)."""
        waiting = self.prefilling
        while waiting and waiting[0][0] <= now:
            waiting.popleft()
        return sum(tokens for _, tokens in waiting) if waiting else 0

    def admit(self, request: object, session: str, prompt_tokens: int, output_tokens: int, now: float,
              prefilled: bool = False) -> tuple[Job, float]:
        """Take a request (`prefilled`: its KV came from a prefill instance); its job and the tokens
        generated before it joined."""
        generated = self.advance(now)
        cached = prompt_tokens if prefilled else self.cached_for(session, prompt_tokens)
        prefill = prompt_tokens - cached
        forming = self.forming if now < self.forming_at else None
        if forming is None:
            start = max(now, self.busy_until)
            if self.jobs and now >= self.busy_until:
                # It joins at the end of the batch under way; the others finish that batch first.
                left = math.ceil(self.steps - 1e-9) - self.steps
                start = now + left * self.batch_s()
                self.steps += left
                generated += left * len(self.jobs)
                self.t_ref = start
            self.forming, self.forming_at = [], start
            forming = self.forming
            self.busy_until = start
        # Requests that arrive before that batch starts join it: one batch prefills them all.
        self.busy_until += self.model.d_1 * prefill
        n = len(self.jobs) + 1
        first = self.busy_until + self.model.d_0 + self.model.d_1 * n
        job = Job(request, self.steps + output_tokens, first, prompt_tokens, cached)
        for other in forming:
            other.first_token_at = first
        forming.append(job)
        heapq.heappush(self.jobs, (job.finish_step, id(job), job))
        if prefill:
            self.prefilling.append((first, prefill))
        self.last_active = now
        self.version += 1
        return job, generated

    def next_completion(self) -> float | None:
        if not self.jobs:
            return None
        start = self.t_ref if self.t_ref > self.busy_until else self.busy_until
        return start + max(0.0, self.jobs[0][0] - self.steps) * self.batch_s()

    def complete_due(self, now: float) -> tuple[list[Job], float]:
        """The jobs finished by `now`, taken off; the tokens generated up to `now`."""
        generated = self.advance(now)
        done: list[Job] = []
        while self.jobs and self.jobs[0][0] <= self.steps + 1e-9:
            job = heapq.heappop(self.jobs)[2]
            done.append(job)
        if done:
            self.last_active = now
            self.version += 1
        return done, generated

    def remember(self, session: str, context_tokens: int) -> None:
        """The session's context stays in the prefix cache, least recently used first out."""
        if self.model.kv_tokens <= 0:
            return
        old = self.cache.pop(session, 0)
        self.cached_total += context_tokens - old
        self.cache[session] = context_tokens
        while self.cached_total > self.model.kv_tokens and self.cache:
            _, dropped = self.cache.popitem(last=False)
            self.cached_total -= dropped

    def memory_gb(self) -> float:
        if self.state in (InstanceState.SLEEP_1, InstanceState.SLEEP_2):
            return self.model.sleep_memory_gb
        return self.model.memory_gb
