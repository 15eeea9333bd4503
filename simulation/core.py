"""The decode system of seed 002: requests, KV memory, the three-phase scheduler.

A pure library: no clock, no I/O, no asyncio. The caller owns time. Offline
experiments (`simulation.runner`) feed arrivals and step batch by batch; the
simulated engine calls `step(now)` and sleeps for the returned duration.

Model (seed 002):
- a request is WAITING (no memory), RUNNING (KV in GPU memory), SWAPPED (KV on
  the CPU) or COMPLETED;
- GPU memory = sum over RUNNING of (prefill_length + current decode position),
  capacity `M_total`;
- each step runs three phases: (1) admission from SWAPPED/WAITING without
  preemption, (2) selection of the execution batch under the token budget `B`
  and batched memory-pressure handling (victims by `victim_policy`, LIFO by
  time of entering RUNNING by default), (3) queue update: swapped victims go to
  SWAPPED, sacrificed ones back to the front of WAITING with progress reset;
- the batch then runs for `d_0 + d_1 * batch_tokens`.

Serving extensions (off by default, used by the simulated engine): chunked
prefill whose prompt tokens count against `B`, and a prefix cache over token
blocks that lets repeated prompt prefixes skip prefill.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from enum import Enum

from simulation.prefix_cache import PrefixCache


class SimRequestState(str, Enum):
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    SWAPPED = "SWAPPED"
    COMPLETED = "COMPLETED"


class PreemptionMode(str, Enum):
    SWAP = "swap"  # KV copied to the CPU, progress kept
    SACRIFICE = "sacrifice"  # KV dropped, progress reset to 0 and recomputed


class Strategy(str, Enum):
    # Admission keeps one token of growth headroom per RUNNING request, so it
    # never causes a preemption by itself; SWAPPED is tried first but a blocked
    # SWAPPED head does not block WAITING.
    CONSERVATIVE = "conservative"
    # Admission packs memory (only the admitted request's next token is
    # reserved) and SWAPPED has strict priority: nothing leaves WAITING while
    # SWAPPED is non-empty. With `allow_waiting_preempt`, a blocked head may
    # preempt RUNNING requests that arrived after it.
    AGGRESSIVE = "aggressive"


class VictimPolicy(str, Enum):
    LIFO = "lifo"  # latest to enter RUNNING first
    LRU = "lru"  # least recently executed first; ties (same last batch) broken LIFO
    RANDOM = "random"


class DecodeCost(str, Enum):
    """Tokens a decoding request charges against the budget B."""

    ONE = "one"  # one new token per batch (seed 002, and vLLM's scheduler budget)
    CONTEXT = "context"  # its whole context (prefill_length + position), an attention-bound variant


@dataclass(frozen=True)
class SystemParams:
    """Seed 002 `system.*` and `control.*`, plus the serving extensions."""

    M_total: int
    B: int
    d_0: float
    d_1: float
    mode: PreemptionMode = PreemptionMode.SWAP
    strategy: Strategy = Strategy.CONSERVATIVE
    victim_policy: VictimPolicy = VictimPolicy.LIFO
    allow_waiting_preempt: bool = False
    prefill: bool = False
    decode_cost: DecodeCost = DecodeCost.ONE
    prefix_cache_blocks: int = 0
    block_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("mode", "strategy", "victim_policy"):
            enum = {"mode": PreemptionMode, "strategy": Strategy, "victim_policy": VictimPolicy}[name]
            value = getattr(self, name)
            if not isinstance(value, enum):
                object.__setattr__(self, name, enum(str(value).lower()))
        if not isinstance(self.decode_cost, DecodeCost):
            object.__setattr__(self, "decode_cost", DecodeCost(str(self.decode_cost).lower()))
        if self.M_total <= 0:
            raise ValueError(f"M_total must be positive, got {self.M_total}")
        if self.B <= 0:
            raise ValueError(f"B must be positive, got {self.B}")
        if self.d_0 < 0 or self.d_1 < 0:
            raise ValueError("d_0 and d_1 must be non-negative")
        if self.d_0 == 0 and self.d_1 == 0:
            raise ValueError("d_0 and d_1 cannot both be zero: time would not advance")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.prefix_cache_blocks < 0:
            raise ValueError("prefix_cache_blocks must be >= 0")
        if self.prefix_cache_blocks and not self.prefill:
            raise ValueError("the prefix cache needs prefill=True (pure-decode mode ignores prompts)")

    @property
    def cost(self) -> DecodeCost:
        return self.decode_cost


@dataclass(eq=False, slots=True)
class SimRequest:
    request_id: str
    arrival_time: float
    prefill_length: int
    decode_length: int
    prefix_hashes: tuple[int, ...] = ()
    # --- managed by DecodeSystem ---
    state: SimRequestState = SimRequestState.WAITING
    decoded: int = 0  # current decode position
    max_decoded: int = 0  # highest position ever reached (tokens the client has seen)
    prefilled: int = 0  # prompt tokens whose KV is computed (== prefill_length in pure-decode mode)
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    enter_running_time: float | None = None
    first_enter_running_time: float | None = None
    completion_time: float | None = None
    swapped_at: float | None = None
    total_swapped_time: float = 0.0
    swap_count: int = 0
    sacrifice_count: int = 0
    wasted_tokens: int = 0  # decode tokens lost to sacrifices (recomputed later)
    cancelled: bool = False
    order: int = 0  # arrival order, FCFS tie-break

    @property
    def footprint(self) -> int:
        """GPU memory held while RUNNING."""
        return self.prefill_length + self.decoded


@dataclass(frozen=True, slots=True)
class Preemption:
    request_id: str
    mode: PreemptionMode
    decode_position: int  # position when preempted (before a sacrifice resets it)
    memory_freed: int
    same_position_running: int  # RUNNING requests at that position, victim included
    total_running: int  # RUNNING requests before this step's preemptions
    phase: int  # 1: made room for a blocked head (aggressive), 2: memory pressure


@dataclass(frozen=True, slots=True)
class StepResult:
    batch_id: int
    start_time: float
    duration: float  # d_0 + d_1 * batch_tokens
    batch_tokens: int
    decoded: tuple[str, ...]  # requests that produced one token this batch
    prefilled: tuple[tuple[str, int], ...]  # (request id, prompt tokens computed this batch)
    completed: tuple[str, ...]
    preempted: tuple[str, ...]  # swapped out or sacrificed in this step
    memory_used: int  # after the batch, completed requests freed
    # --- details for traces and the engine ---
    emitted: tuple[str, ...] = ()  # subset of `decoded` at a position never reached before
    admitted: tuple[str, ...] = ()  # WAITING -> RUNNING
    swapped_in: tuple[str, ...] = ()  # SWAPPED -> RUNNING
    preemptions: tuple[Preemption, ...] = ()
    memory_peak: int = 0  # while the batch ran: new tokens written, nothing freed yet
    batch_count: int = 0  # requests executed
    running: int = 0  # RUNNING during the batch
    waiting: int = 0
    swapped: int = 0

    @property
    def end_time(self) -> float:
        return self.start_time + self.duration


COUNTER_NAMES = (
    "arrived",
    "admitted",
    "completed",
    "cancelled",
    "batches",
    "prompt_tokens",
    "generation_tokens",
    "emitted_tokens",
    "swap_out",
    "swap_in",
    "sacrifices",
    "preemptions",
    "wasted_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
)


class DecodeSystem:
    """One decode instance. All methods are O(work done), never O(requests in system)."""

    def __init__(self, params: SystemParams, *, rng: random.Random | None = None) -> None:
        self.params = params
        self._rng = rng if rng is not None else random.Random(params.seed)
        self._requests: dict[str, SimRequest] = {}  # every request not yet completed
        self._waiting: deque[SimRequest] = deque()  # FCFS; cancelled entries skipped lazily
        self._n_waiting = 0
        self._swapped: list[tuple[float, int, SimRequest]] = []  # heap by arrival (FCFS)
        self._n_swapped = 0
        self._running: dict[str, SimRequest] = {}  # insertion order = order of entering RUNNING
        self._lru: OrderedDict[str, SimRequest] | None = (
            OrderedDict() if params.victim_policy is VictimPolicy.LRU else None
        )
        self._memory = 0
        self._batch_id = 0
        self._order = itertools.count()
        self.prefix_cache = PrefixCache(params.prefix_cache_blocks) if params.prefix_cache_blocks else None
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self._finishing_prefill: set[str] = set()  # ids whose last prompt chunk is in the current batch

    # ---- read-only views ------------------------------------------------
    @property
    def memory_used(self) -> int:
        return self._memory

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return self._n_waiting

    @property
    def swapped(self) -> int:
        return self._n_swapped

    @property
    def in_system(self) -> int:
        return len(self._requests)

    @property
    def batches(self) -> int:
        return self._batch_id

    @property
    def apc(self) -> float:
        """Share of queried prompt tokens served from the prefix cache."""
        q = self.counters["prefix_cache_queries"]
        return self.counters["prefix_cache_hits"] / q if q else 0.0

    def get(self, request_id: str) -> SimRequest | None:
        return self._requests.get(request_id)

    def has_work(self) -> bool:
        return bool(self._requests)

    def members(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(WAITING in queue order, RUNNING in entry order, SWAPPED in priority order). O(n)."""
        waiting = tuple(r.request_id for r in self._waiting if not r.cancelled and r.state is SimRequestState.WAITING)
        running = tuple(self._running)
        swapped = tuple(r.request_id for _, _, r in sorted(self._swapped, key=lambda e: e[:2]) if not r.cancelled)
        return waiting, running, swapped

    def running_positions(self) -> Counter[int]:
        """Decode position -> RUNNING requests at it. O(running)."""
        return Counter(r.decoded for r in self._running.values())

    # ---- commands -------------------------------------------------------
    def add(self, request: SimRequest) -> None:
        """Enter WAITING (the caller adds it at its arrival time)."""
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.decode_length < 1:
            raise ValueError(f"request {request.request_id!r}: decode_length must be >= 1")
        if request.prefill_length < 0:
            raise ValueError(f"request {request.request_id!r}: prefill_length must be >= 0")
        if request.prefill_length + request.decode_length > self.params.M_total:
            raise ValueError(
                f"request {request.request_id!r} needs {request.prefill_length + request.decode_length} "
                f"tokens of KV memory, more than M_total={self.params.M_total}"
            )
        request.state = SimRequestState.WAITING
        request.order = next(self._order)
        request.prefilled = 0 if self.params.prefill else request.prefill_length
        self._requests[request.request_id] = request
        self._waiting.append(request)
        self._n_waiting += 1
        self.counters["arrived"] += 1

    def cancel(self, request_id: str) -> bool:
        """Remove a request from whatever state it is in; RUNNING memory is freed now."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.state is SimRequestState.RUNNING:
            del self._running[request_id]
            if self._lru is not None:
                self._lru.pop(request_id, None)
            self._memory -= req.footprint
        elif req.state is SimRequestState.WAITING:
            self._n_waiting -= 1
        elif req.state is SimRequestState.SWAPPED:
            self._n_swapped -= 1
        req.cancelled = True
        req.state = SimRequestState.COMPLETED
        self.counters["cancelled"] += 1
        return True

    def step(self, now: float) -> StepResult | None:
        """Schedule (three phases) and execute one batch starting at `now`; None when idle."""
        p = self.params
        admitted: list[str] = []
        swapped_in: list[str] = []
        preemptions: list[Preemption] = []
        victims: list[SimRequest] = []

        # Phase 1: admission
        self._admit(now, admitted, swapped_in, preemptions, victims)
        if not self._running:
            self._requeue(victims)
            return None

        # Phase 2: execution batch under B, then memory pressure
        batch, chunks, tokens, growth = self._select_batch()
        deficit = self._memory + growth - p.M_total
        if deficit > 0:
            running = self._running
            positions = Counter(r.decoded for r in running.values())
            total_running = len(running)
            members = None if len(batch) == total_running else {r.request_id for r in batch}
            removed: set[str] = set()
            while deficit > 0 and running:
                victim = self._pick_victim(running)
                in_batch = members is None or victim.request_id in members
                freed = victim.footprint
                deficit -= freed
                if in_batch:
                    removed.add(victim.request_id)
                    if self._produces_token(victim, chunks is not None):
                        deficit -= 1
                preemptions.append(
                    Preemption(victim.request_id, p.mode, victim.decoded, freed,
                               positions[victim.decoded], total_running, 2)
                )
                self._preempt(victim, now)
                victims.append(victim)
            if removed:
                keep = [i for i, r in enumerate(batch) if r.request_id not in removed]
                batch = [batch[i] for i in keep]
                if chunks is not None:
                    chunks = [chunks[i] for i in keep]
                    tokens = sum(self._charge(r, c) for r, c in zip(batch, chunks))
                else:
                    tokens = sum(self._charge(r, 0) for r in batch)
        # Phase 3: queue update
        self._requeue(victims)
        if not batch:
            # every request of the batch was preempted (random/LRU victims); nothing executes this step
            return self._result(now, 0.0, 0, (), (), (), admitted, swapped_in, preemptions, self._memory, 0)

        duration = p.d_0 + p.d_1 * tokens
        end = now + duration
        emitted: list[str] = []
        prefilled: list[tuple[str, int]] = []
        finished: list[SimRequest] = []
        lru = self._lru
        counters = self.counters
        if chunks is None:
            decoders = batch
        else:
            decoders = []
            cache = self.prefix_cache
            for req, chunk in zip(batch, chunks):
                if chunk:
                    req.prefilled += chunk
                    prefilled.append((req.request_id, chunk))
                    counters["prompt_tokens"] += chunk
                    if req.prefilled < req.prefill_length:
                        continue
                    if cache is not None and req.prefix_hashes:
                        cache.insert(req.prefix_hashes)
                decoders.append(req)
        for req in decoders:
            d = req.decoded + 1
            req.decoded = d
            if d > req.max_decoded:
                req.max_decoded = d
                emitted.append(req.request_id)
            if d >= req.decode_length:
                finished.append(req)
        decoded = [r.request_id for r in decoders]
        self._memory += len(decoders)
        if lru is not None:
            # ties within a batch break LIFO: the latest to enter RUNNING becomes the least recent
            for req in reversed(batch):
                lru.move_to_end(req.request_id)
        counters["generation_tokens"] += len(decoded)
        counters["emitted_tokens"] += len(emitted)
        memory_peak = self._memory
        for req in finished:
            del self._running[req.request_id]
            if lru is not None:
                del lru[req.request_id]
            del self._requests[req.request_id]
            self._memory -= req.footprint
            req.state = SimRequestState.COMPLETED
            req.completion_time = end
        counters["completed"] += len(finished)
        return self._result(
            now, duration, tokens, decoded, prefilled, [r.request_id for r in finished],
            admitted, swapped_in, preemptions, memory_peak, len(batch), emitted,
        )

    # ---- phases ---------------------------------------------------------
    def _result(self, now, duration, tokens, decoded, prefilled, completed, admitted, swapped_in,
                preemptions, memory_peak, batch_count, emitted=()) -> StepResult:
        batch_id = self._batch_id
        self._batch_id += 1
        self.counters["batches"] += 1
        return StepResult(
            batch_id=batch_id,
            start_time=now,
            duration=duration,
            batch_tokens=tokens,
            decoded=tuple(decoded),
            prefilled=tuple(prefilled),
            completed=tuple(completed),
            preempted=tuple(x.request_id for x in preemptions),
            memory_used=self._memory,
            emitted=tuple(emitted),
            admitted=tuple(admitted),
            swapped_in=tuple(swapped_in),
            preemptions=tuple(preemptions),
            memory_peak=memory_peak,
            batch_count=batch_count,
            running=len(self._running) + len(completed),
            waiting=self._n_waiting,
            swapped=self._n_swapped,
        )

    def _fits(self, req: SimRequest) -> bool:
        need = self._memory + req.footprint + 1
        if self.params.strategy is Strategy.CONSERVATIVE:
            need += len(self._running)  # one token of growth for every RUNNING request
        return need <= self.params.M_total

    def _peek_waiting(self) -> SimRequest | None:
        q = self._waiting
        while q:
            head = q[0]
            if not head.cancelled and head.state is SimRequestState.WAITING:
                return head
            q.popleft()
        return None

    def _peek_swapped(self) -> SimRequest | None:
        h = self._swapped
        while h:
            head = h[0][2]
            if not head.cancelled and head.state is SimRequestState.SWAPPED:
                return head
            heapq.heappop(h)
        return None

    def _admit(self, now, admitted, swapped_in, preemptions, victims) -> None:
        p = self.params
        aggressive = p.strategy is Strategy.AGGRESSIVE
        may_preempt = aggressive and p.allow_waiting_preempt
        while (head := self._peek_swapped()) is not None:
            if not self._fits(head) and not (may_preempt and self._make_room(head, now, preemptions, victims)):
                break
            heapq.heappop(self._swapped)
            self._n_swapped -= 1
            head.total_swapped_time += now - (head.swapped_at if head.swapped_at is not None else now)
            head.swapped_at = None
            self._enter_running(head, now)
            swapped_in.append(head.request_id)
            self.counters["swap_in"] += 1
        if aggressive and self._n_swapped:
            return  # strict priority: SWAPPED before WAITING
        while (head := self._peek_waiting()) is not None:
            if not self._fits(head) and not (may_preempt and self._make_room(head, now, preemptions, victims)):
                break
            self._waiting.popleft()
            self._n_waiting -= 1
            if p.prefill and head.prefilled == 0:
                self._lookup_prefix(head)
            if head.first_enter_running_time is None:
                self.counters["admitted"] += 1
                if not p.prefill:
                    self.counters["prompt_tokens"] += head.prefill_length
            self._enter_running(head, now)
            admitted.append(head.request_id)

    def _make_room(self, head: SimRequest, now: float, preemptions, victims) -> bool:
        """Preempt RUNNING requests that arrived after `head` until it fits; all or nothing."""
        rank = (head.arrival_time, head.order)
        lower = {rid: r for rid, r in self._running.items() if (r.arrival_time, r.order) > rank}
        slack = self.params.M_total - (self._memory + head.footprint + 1)
        if slack + sum(r.footprint for r in lower.values()) < 0:
            return False
        positions = Counter(r.decoded for r in self._running.values())
        total_running = len(self._running)
        while not self._fits(head) and lower:
            victim = self._pick_victim(lower)
            del lower[victim.request_id]
            preemptions.append(
                Preemption(victim.request_id, self.params.mode, victim.decoded, victim.footprint,
                           positions[victim.decoded], total_running, 1)
            )
            self._preempt(victim, now)
            victims.append(victim)
        return self._fits(head)

    def _lookup_prefix(self, req: SimRequest) -> None:
        cache = self.prefix_cache
        self.counters["prefix_cache_queries"] += req.prefill_length
        if cache is None or not req.prefix_hashes:
            req.cached_tokens = 0
            return
        matched = cache.match(req.prefix_hashes) * self.params.block_size
        # at least one prompt token is computed, so the prompt's last position yields the first token
        req.cached_tokens = max(0, min(matched, req.prefill_length - 1))
        req.prefilled = req.cached_tokens
        self.counters["prefix_cache_hits"] += req.cached_tokens

    def _enter_running(self, req: SimRequest, now: float) -> None:
        req.state = SimRequestState.RUNNING
        req.enter_running_time = now
        if req.first_enter_running_time is None:
            req.first_enter_running_time = now
        self._running[req.request_id] = req
        if self._lru is not None:
            self._lru[req.request_id] = req
        self._memory += req.footprint

    def _produces_token(self, req: SimRequest, prefill: bool) -> bool:
        # an in-batch request decodes unless its prompt is unfinished after this batch's chunk
        return not prefill or req.prefilled >= req.prefill_length or self._last_chunk(req)

    def _last_chunk(self, req: SimRequest) -> bool:
        return req.request_id in self._finishing_prefill

    def _charge(self, req: SimRequest, chunk: int) -> int:
        if chunk:
            return chunk
        if self.params.cost is DecodeCost.CONTEXT:
            return req.prefill_length + req.decoded
        return 1

    def _select_batch(self) -> tuple[list[SimRequest], list[int] | None, int, int]:
        """RUNNING requests in entry order while the budget B lasts (the first always runs).

        Returns (batch, prompt chunks aligned with it or None in pure-decode mode, tokens, growth).
        """
        budget = self.params.B
        running = self._running
        if not self.params.prefill and self.params.cost is DecodeCost.ONE:
            # the seed's model: one token per request, everyone up to B runs
            if len(running) <= budget:
                batch = list(running.values())
            else:
                batch = list(itertools.islice(running.values(), budget))
            return batch, None, len(batch), len(batch)
        context = self.params.cost is DecodeCost.CONTEXT
        batch: list[SimRequest] = []
        chunks: list[int] = []
        finishing: set[str] = set()
        tokens = 0
        growth = 0
        for req in running.values():
            remaining_prompt = req.prefill_length - req.prefilled
            if remaining_prompt > 0:
                chunk = min(remaining_prompt, budget - tokens)
                if chunk <= 0:
                    break
                cost = chunk
                if chunk == remaining_prompt:
                    growth += 1  # the last prompt chunk also yields the first token
                    finishing.add(req.request_id)
            else:
                chunk = 0
                cost = req.prefill_length + req.decoded if context else 1
                if tokens + cost > budget and batch:
                    break
                growth += 1
            batch.append(req)
            chunks.append(chunk)
            tokens += cost
            if tokens >= budget:
                break
        self._finishing_prefill = finishing
        return batch, chunks, tokens, growth

    def _pick_victim(self, pool: dict[str, SimRequest]) -> SimRequest:
        policy = self.params.victim_policy
        if policy is VictimPolicy.LIFO:
            return pool[next(reversed(pool))]
        if policy is VictimPolicy.LRU and self._lru is not None:
            for rid, req in self._lru.items():
                if rid in pool:
                    return req
        return pool[self._rng.choice(list(pool))]

    def _preempt(self, req: SimRequest, now: float) -> None:
        del self._running[req.request_id]
        if self._lru is not None:
            self._lru.pop(req.request_id, None)
        self._memory -= req.footprint
        self.counters["preemptions"] += 1
        if self.params.mode is PreemptionMode.SWAP:
            req.state = SimRequestState.SWAPPED
            req.swapped_at = now
            req.swap_count += 1
            self.counters["swap_out"] += 1
        else:
            req.state = SimRequestState.WAITING
            req.wasted_tokens += req.decoded
            self.counters["wasted_tokens"] += req.decoded
            self.counters["sacrifices"] += 1
            req.sacrifice_count += 1
            req.decoded = 0
            req.prefilled = 0 if self.params.prefill else req.prefill_length

    def _requeue(self, victims: list[SimRequest]) -> None:
        if not victims:
            return
        sacrificed = []
        for v in victims:
            if v.state is SimRequestState.SWAPPED:
                heapq.heappush(self._swapped, (v.arrival_time, v.order, v))
                self._n_swapped += 1
            else:
                sacrificed.append(v)
        if sacrificed:
            # recomputation has priority: back to the head of WAITING, in arrival order
            sacrificed.sort(key=lambda r: r.order)
            self._waiting.extendleft(reversed(sacrificed))
            self._n_waiting += len(sacrificed)
