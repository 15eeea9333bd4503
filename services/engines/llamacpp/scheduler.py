"""Request management of seed 003, as a pure state machine (no threads, no llama.cpp, no clock).

RequestQueue (bounded) -> running set (bounded, PENDING) -> batch (PROCESSING,
holding a sequence id) -> COMPLETED / TIMEOUT / FAILED / CANCELLED. Every call
takes `now`; every effect on llama.cpp is returned as data (`StepPlan.kv_ops`,
`StepPlan.work`) for the decode thread to carry out. The engine serialises
calls with one lock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from .kv_cache import KVCacheManager, KVEntry
from .prompt_cache import HostPromptCache
from .requests import GenerationRequest, RequestState, Tracked
from .seq_ids import SequenceIdPool


@dataclass(frozen=True)
class SchedulerLimits:
    max_queue: int = 256
    max_running: int = 8
    max_batch_size: int = 8
    batch_tokens: int = 512
    request_timeout_s: float = 60.0
    prefix_cache: bool = True


class QueueFull(Exception):
    def __init__(self, queued: int, retry_after_s: float) -> None:
        super().__init__(f"the request queue is full ({queued} requests waiting); retry later")
        self.queued = queued
        self.retry_after_s = retry_after_s


class LengthLimitExceeded(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def effective_max_tokens(
    prompt_tokens: int, requested: int | None, *, max_input: int, max_output: int, ctx_per_seq: int
) -> int:
    """The output budget of a request, or LengthLimitExceeded naming the limit and the excess.

    A request that cannot fit is refused, never truncated.
    """
    if prompt_tokens < 1:
        raise LengthLimitExceeded("the prompt is empty", "prompt")
    if prompt_tokens > max_input:
        raise LengthLimitExceeded(
            f"the prompt has {prompt_tokens} tokens, {prompt_tokens - max_input} over the input limit "
            f"of {max_input} tokens",
            "messages",
        )
    if prompt_tokens >= ctx_per_seq:
        raise LengthLimitExceeded(
            f"the prompt has {prompt_tokens} tokens and leaves no room in the per-sequence context of "
            f"{ctx_per_seq} tokens (over by {prompt_tokens - ctx_per_seq + 1})",
            "messages",
        )
    room = ctx_per_seq - prompt_tokens
    if requested is None:
        return min(max_output, room)
    if requested > max_output:
        raise LengthLimitExceeded(
            f"max_tokens is {requested}, {requested - max_output} over the output limit of {max_output} tokens",
            "max_tokens",
        )
    if requested > room:
        raise LengthLimitExceeded(
            f"this model's context per sequence is {ctx_per_seq} tokens, but {prompt_tokens + requested} were "
            f"requested ({prompt_tokens} in the prompt, {requested} for the completion): "
            f"over by {prompt_tokens + requested - ctx_per_seq}",
            "max_tokens",
        )
    return requested


class SeqWork(NamedTuple):
    """The tokens one sequence contributes to a decode step (a named tuple: one is made per sequence per step, on
    the decode thread, and a tuple is made in a third of a frozen dataclass's time)."""

    request_id: int
    seq_id: int
    tokens: list[int]
    pos0: int
    wants_logits: bool
    """True when the last token's logits are sampled (the prompt is complete, or a decode token)."""
    kind: str  # "prefill" | "decode"


KVOp = tuple[str, int, int]
"""("trim", seq_id, from_pos): drop positions >= from_pos (0: the whole sequence);
("copy", src_seq, dst_seq): make dst a copy of src (then trimmed to the shared prefix);
("save", seq_id, key): keep the sequence's state in host memory under `key` (before it is cleared);
("restore", seq_id, key): replace the sequence with the state saved under `key` (then trimmed);
("free", 0, key): the state saved under `key` is no longer needed."""

MIN_COPY_TOKENS = 8
"""A shared prefix shorter than this is recomputed rather than copied from another sequence."""
STATE_TOKENS_PER_TOKEN_SAVED = 64
"""A sequence is restored from host memory when it spares at least one token of compute per this many tokens of
state it copies: recomputing a token costs milliseconds here (about 3 ms with two threads, docs/engine-llamacpp.md),
copying one's state (23 KB for SmolLM2-135M) microseconds."""
TAKE_OVER_SHARE = 0.5
"""A new prompt keeping at least this share of a parked entry continues its conversation: among
equally compact ids, that entry's id is preferred and the entry taken over in place (no copy)."""


@dataclass
class StepPlan:
    step_id: int
    kv_ops: list[KVOp] = field(default_factory=list)
    """Applied in order before the step's llama_decode."""
    work: list[SeqWork] = field(default_factory=list)

    @property
    def clears(self) -> list[tuple[int, int]]:
        return [(a, b) for op, a, b in self.kv_ops if op == "trim"]

    @property
    def n_tokens(self) -> int:
        return sum(len(w.tokens) for w in self.work)


class BatchScheduler:
    def __init__(self, limits: SchedulerLimits, seq_ids: SequenceIdPool, kv: KVCacheManager,
                 prompts: HostPromptCache | None = None) -> None:
        self.limits = limits
        self.seq_ids = seq_ids
        self.kv = kv
        self.prompts = prompts if limits.prefix_cache else None
        """Parked entries evicted from the KV, kept in host memory (None: not kept)."""
        self.queue: deque[Tracked] = deque()
        self.running: dict[int, Tracked] = {}  # insertion order = admission order
        self._kv_ops: list[KVOp] = []
        self._step_id = 0
        self._mean_service_s = 1.0
        self.counts: dict[str, int] = {"rejected_queue_full": 0}
        for state in RequestState:
            if state.terminal:
                self.counts[state.value] = 0

    # -- intake ------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> Tracked:
        if len(self.queue) >= self.limits.max_queue:
            self.counts["rejected_queue_full"] += 1
            raise QueueFull(len(self.queue), self.retry_after_s())
        tracked = Tracked(request)
        self.queue.append(tracked)
        return tracked

    def retry_after_s(self) -> float:
        """How long until the queue has drained by one batch, from recent service times."""
        width = max(1, min(self.limits.max_batch_size, self.seq_ids.n_seq_max))
        return max(1.0, math.ceil(len(self.queue) / width) * self._mean_service_s)

    # -- leaving -----------------------------------------------------------
    def cancel(self, request_id: int, now: float) -> Tracked | None:
        """The client went away: free everything the request holds."""
        for tracked in self.queue:
            if tracked.request_id == request_id:
                self.queue.remove(tracked)
                tracked.state = RequestState.CANCELLED
                self.counts[RequestState.CANCELLED.value] += 1
                return tracked
        if request_id in self.running:
            return self.finish(request_id, RequestState.CANCELLED, now)
        return None

    def expire(self, now: float) -> list[Tracked]:
        """Timeout scan: every request older than the timeout, queued or running, becomes TIMEOUT.

        Seed 003 scans PROCESSING requests only; a queued request's client waits
        just as long, so the scan covers the queue and the running set, measured
        from arrival.
        """
        deadline = now - self.limits.request_timeout_s
        expired: list[Tracked] = []
        for tracked in [t for t in self.queue if t.request.arrived_at <= deadline]:
            self.queue.remove(tracked)
            tracked.state = RequestState.TIMEOUT
            self.counts[RequestState.TIMEOUT.value] += 1
            expired.append(tracked)
        for request_id in [rid for rid, t in self.running.items() if t.request.arrived_at <= deadline]:
            expired.append(self.finish(request_id, RequestState.TIMEOUT, now))
        return expired

    def finish(self, request_id: int, state: RequestState, now: float) -> Tracked:
        """Leave the running set in a terminal state, releasing the sequence id and KV.

        A COMPLETED request's KV stays parked for reuse (when the prefix cache is
        on); any other end clears it, as seed 003 prescribes.
        """
        if not state.terminal:
            raise ValueError(f"{state} is not a terminal state")
        tracked = self.running.pop(request_id)
        tracked.state = state
        self.counts[state.value] += 1
        seq_id = self.seq_ids.release(request_id)
        if seq_id is not None:
            if state == RequestState.COMPLETED and self.limits.prefix_cache and tracked.request_id in self.kv:
                self.kv.set_state(request_id, RequestState.COMPLETED, now)
            else:
                self.kv.drop(request_id)
                self._kv_ops.append(("trim", seq_id, 0))
        if state == RequestState.COMPLETED and tracked.running_since is not None:
            self._mean_service_s = 0.8 * self._mean_service_s + 0.2 * max(0.0, now - tracked.running_since)
        return tracked

    # -- the step ----------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        """Admit, activate and form the next batch."""
        self._admit(now)
        self._activate(now)
        plan = StepPlan(step_id=self._step_id, kv_ops=self._kv_ops)
        self._kv_ops = []
        budget = self.limits.batch_tokens
        prefilling: list[Tracked] = []
        # Decode tokens first: one per generating sequence keeps every stream moving.
        for tracked in self.running.values():
            if tracked.state != RequestState.PROCESSING:
                continue
            if not tracked.prefill_done:
                prefilling.append(tracked)
            elif tracked.generated and budget > 0:
                entry = self.kv.get(tracked.request_id)
                assert entry is not None and tracked.seq_id is not None
                plan.work.append(
                    SeqWork(tracked.request_id, tracked.seq_id, [tracked.generated[-1]], len(entry.tokens), True, "decode")
                )
                budget -= 1
        # New prompts join the same batch, chunked within what is left of the token budget.
        for tracked in prefilling:
            if budget <= 0:
                break
            prompt = tracked.request.prompt_tokens
            chunk = prompt[tracked.n_prefilled : tracked.n_prefilled + budget]
            completes = tracked.n_prefilled + len(chunk) == len(prompt)
            assert tracked.seq_id is not None
            plan.work.append(SeqWork(tracked.request_id, tracked.seq_id, chunk, tracked.n_prefilled, completes, "prefill"))
            budget -= len(chunk)
        # llama.cpp batches consecutive sequence ids together only in ascending batch order.
        plan.work.sort(key=lambda w: w.seq_id)
        if plan.work:
            self._step_id += 1
        return plan

    def record_decoded(self, work: SeqWork, now: float) -> bool:
        """The step carrying `work` ran; False if the request left meanwhile (its result is void)."""
        tracked = self.running.get(work.request_id)
        if tracked is None or tracked.seq_id != work.seq_id:
            return False
        self.kv.append(work.request_id, work.tokens, now)
        if work.kind == "prefill":
            tracked.n_prefilled += len(work.tokens)
        return True

    def add_generated(self, request_id: int, token: int) -> Tracked:
        tracked = self.running[request_id]
        tracked.generated.append(token)
        return tracked

    def adopt(self, request_id: int, tokens: list[int], now: float, session: str = "") -> int | None:
        """Park `tokens` as a finished request's KV on a free sequence id, for the next turn to reuse.

        The KV itself arrives from another engine (a session's move); this only
        books it: an id no running request holds, an empty one first, else the
        one whose parked entry was used least recently (evicted). None when
        every id is busy. The caller writes the state into the returned id.
        """
        free = self.seq_ids.free_ids()
        if not free:
            return None

        def last_used(seq_id: int) -> float:
            parked = self.kv.parked_on(seq_id)
            return float("-inf") if parked is None else parked.last_used

        seq_id = min(free, key=last_used)
        victim = self.kv.parked_on(seq_id)
        if victim is not None:
            self._evict(victim, clear=False)  # the import replaces the whole sequence
        self.kv.open(request_id, seq_id, now, tokens, session)
        self.kv.set_state(request_id, RequestState.COMPLETED, now)
        return seq_id

    def take_kv_ops(self) -> list[KVOp]:
        """The KV operations not yet applied, for the decode thread to apply now (before it reads KV state)."""
        ops, self._kv_ops = self._kv_ops, []
        return ops

    def cleanup_kv(self) -> list[KVEntry]:
        """Periodic KV cleanup: LRU-evict parked entries above the eviction threshold."""
        evicted = self.kv.evict_over_threshold()
        for entry in evicted:
            self._save(entry)
            self._kv_ops.append(("trim", entry.seq_id, 0))
        return evicted

    # -- internals ---------------------------------------------------------
    def _admit(self, now: float) -> None:
        while self.queue and len(self.running) < self.limits.max_running:
            tracked = self.queue.popleft()
            tracked.state = RequestState.PENDING
            tracked.running_since = now
            self.running[tracked.request_id] = tracked

    def _activate(self, now: float) -> None:
        width = self.limits.max_batch_size
        n_processing = sum(1 for t in self.running.values() if t.state == RequestState.PROCESSING)
        for tracked in self.running.values():
            if n_processing >= width:
                return
            if tracked.state != RequestState.PENDING:
                continue
            if not self._bind(tracked, now):
                return  # no sequence id free: stay PENDING
            tracked.state = RequestState.PROCESSING
            n_processing += 1

    def _bind(self, tracked: Tracked, now: float) -> bool:
        """Give a PENDING request a sequence id, reusing a cached prefix when one matches.

        The id is chosen by `_place`. The longest prefix match over all entries
        (parked or running) is then reused: taken over in place when it is
        parked on the chosen id, otherwise copied into it (a shared system
        prompt, or a conversation whose id is not the one chosen), so the entry
        it came from stays cached for its own conversation. A longer match in
        host memory (`prompt_cache.py`: entries evicted earlier) is restored
        into the id instead. A parked entry the id held is saved there first.
        """
        free = self.seq_ids.free_ids()
        if not free:
            return False
        prompt = tracked.request.prompt_tokens
        rid = tracked.request_id
        session = tracked.request.session
        source: KVEntry | None = None
        saved = None
        keep = 0
        if self.limits.prefix_cache and tracked.request.reuse_prefix:
            source, common = self.kv.best_prefix(prompt, range(self.seq_ids.n_seq_max), include_running=True)
            # At least one prompt token must be decoded to get logits for the first sample.
            keep = min(common, len(prompt) - 1)
            if keep <= 0:
                source = None
            if self.prompts is not None:
                saved, in_host = self.prompts.best_prefix(prompt)
                spared = min(in_host, len(prompt) - 1) - keep
                if saved is not None and spared >= max(1, len(saved.tokens) // STATE_TOKENS_PER_TOKEN_SAVED):
                    source, keep = None, min(in_host, len(prompt) - 1)  # restored from host memory
                else:
                    saved = None
        seq_id = self._place(free, source, keep)
        got = self.seq_ids.acquire(rid, prefer=seq_id)
        assert got == seq_id
        tracked.seq_id = seq_id
        if source is not None and source.seq_id == seq_id:
            if keep < TAKE_OVER_SHARE * len(source.tokens):
                self._save(source)  # another conversation keeps only its opening: the rest is kept in host memory
            self.kv.take_over(source.request_id, rid, keep, now, session)
            self._kv_ops.append(("trim", seq_id, keep))
            tracked.cached_tokens = tracked.n_prefilled = keep
            return True
        victim = self.kv.parked_on(seq_id)
        if victim is not None:
            self._evict(victim, clear=True)
        if saved is not None:
            self._kv_ops += [("restore", seq_id, saved.key), ("trim", seq_id, keep)]
            self.prompts.restored(saved.key)  # type: ignore[union-attr]  # set whenever `saved` is
            self.kv.open(rid, seq_id, now, saved.tokens[:keep], session)
            tracked.cached_tokens = tracked.n_prefilled = keep
            return True
        if source is not None and keep >= MIN_COPY_TOKENS:
            self._kv_ops.append(("copy", source.seq_id, seq_id))
            self._kv_ops.append(("trim", seq_id, keep))
            self.kv.open(rid, seq_id, now, source.tokens[:keep], session)
            source.last_used = now
            tracked.cached_tokens = tracked.n_prefilled = keep
        else:
            self.kv.open(rid, seq_id, now, session=session)
        return True

    def _evict(self, entry: KVEntry, *, clear: bool) -> None:
        """A parked entry leaves the KV for another sequence: kept in host memory first, then its cells cleared
        (`clear`; an import that replaces the whole sequence needs no clearing)."""
        self.kv.drop(entry.request_id)
        self.kv.evictions += 1
        self._save(entry)
        if clear:
            self._kv_ops.append(("trim", entry.seq_id, 0))

    def _save(self, entry: KVEntry) -> None:
        if self.prompts is None or len(entry.tokens) < MIN_COPY_TOKENS:
            return
        key, freed = self.prompts.save(entry.tokens)
        self._kv_ops += [("free", 0, k) for k in freed]
        if key is not None:
            self._kv_ops.append(("save", entry.seq_id, key))

    def _place(self, free: list[int], source: KVEntry | None, keep: int) -> int:
        """The free sequence id a new request decodes under.

        First, keep the busy ids in as few runs of consecutive ids as possible:
        with one KV stream per sequence, llama.cpp splits a batch into one
        ubatch, and so one pass over the weights, per run of consecutive ids
        (8 sequences on ids 0,2,..,14 cost 8 passes, on 0..7 one). Then prefer
        the id holding the conversation the prompt continues (no copy), then an
        empty id, then the least recently used parked entry.
        """
        busy = {s for s in range(self.seq_ids.n_seq_max) if self.seq_ids.owner(s) is not None}
        continues = source is not None and keep >= TAKE_OVER_SHARE * len(source.tokens)

        def cost(seq_id: int) -> tuple[int, int, float, int]:
            new_runs = 1 - ((seq_id - 1) in busy) - ((seq_id + 1) in busy)
            parked = self.kv.parked_on(seq_id)
            if parked is None:
                return (new_runs, 1, 0.0, seq_id)
            if continues and parked is source:
                return (new_runs, 0, 0.0, seq_id)
            return (new_runs, 2, parked.last_used, seq_id)

        return min(free, key=cost)

    def snapshot_slots(self) -> list[dict[str, object]]:
        slots: list[dict[str, object]] = []
        for seq_id in range(self.seq_ids.n_seq_max):
            owner = self.seq_ids.owner(seq_id)
            entry = self.kv.get(owner) if owner is not None else self.kv.parked_on(seq_id)
            slots.append(
                {
                    "id": seq_id,
                    "state": "busy" if owner is not None else "free",
                    "request_id": owner,
                    "n_tokens": len(entry.tokens) if entry is not None else 0,
                    "cached_request_id": entry.request_id if (entry is not None and owner is None) else None,
                }
            )
        return slots

    def waiting(self) -> int:
        """Requests not yet decoding: queued, plus PENDING in the running set."""
        return len(self.queue) + sum(1 for t in self.running.values() if t.state == RequestState.PENDING)

    def processing(self) -> int:
        return sum(1 for t in self.running.values() if t.state == RequestState.PROCESSING)

    def iter_active(self) -> Iterable[Tracked]:
        yield from self.queue
        yield from self.running.values()
