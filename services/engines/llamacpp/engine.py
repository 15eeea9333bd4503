"""The engine: one decode thread that owns the llama.cpp context and drives the scheduler.

Each loop turn: timeout scan and KV cleanup when due, `BatchScheduler.schedule`
(admission, sequence ids, batch formation), clear released sequences, ONE
`llama_decode` carrying every sequence's tokens, per-sequence sampling, then
results back to the scheduler and to each request's event sink. The HTTP edge
only calls `submit`, `cancel` and the read-only views, all under one lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .burst_wait import BurstWait
from .kv_cache import MIB, KVCacheManager, KVLimits
from .llama_backend import LlamaModelConfig, DecodeError, LlamaBackend, Sampler
from .metrics import EngineMetrics, render_prometheus
from .model_files import default_model_path
from .requests import (
    EngineEvent,
    EventSink,
    FinishEvent,
    GenerationRequest,
    RequestState,
    SamplingParams,
    TokenEvent,
    Tracked,
)
from .prompt_cache import HostPromptCache
from .scheduler import BatchScheduler, KVOp, SchedulerLimits, StepPlan
from .seq_ids import SequenceIdPool
from .settings import EngineSettings
from .text_stream import TextAssembler

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class StepRecord(NamedTuple):
    """Batch composition of one llama_decode call (a named tuple: one is made per step, on the decode thread)."""

    step_id: int
    started_at: float
    duration_s: float
    seqs: tuple[tuple[int, int, int, str], ...]
    """(seq_id, request_id, n_tokens, kind) per sequence in the batch."""

    @property
    def request_ids(self) -> set[int]:
        return {rid for _, rid, _, _ in self.seqs}


@dataclass(frozen=True)
class SequenceState:
    """A cached sequence's KV as llama.cpp exports it, with the tokens it holds."""

    tokens: list[int]
    state: bytes
    session: str = ""


class KVBusy(RuntimeError):
    """Every sequence id is decoding: no room to import a sequence now."""


@dataclass
class _Generation:
    """Decode-thread state of one PROCESSING request."""

    sampler: Sampler
    text: TextAssembler
    first_token_at: float | None = None
    last_token_at: float | None = None


@dataclass
class _Outbox:
    events: list[tuple[EventSink, EngineEvent]] = field(default_factory=list)

    def add(self, sink: EventSink, event: EngineEvent) -> None:
        self.events.append((sink, event))

    def deliver(self) -> None:
        for sink, event in self.events:
            try:
                sink(event)
            except Exception:  # a sink belongs to a client that may be gone
                log.exception("event sink failed")
        self.events.clear()


class LlamaEngine:
    def __init__(self, settings: EngineSettings, *, clock: Clock = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.model_path = settings.model_path or default_model_path()
        self.backend: LlamaBackend | None = None
        self.load_error: str | None = None
        self.metrics = EngineMetrics()
        self.step_log: deque[StepRecord] = deque(maxlen=settings.step_log_size or None)
        self._lock = threading.Condition()
        self._ids = itertools.count(1)
        self._scheduler: BatchScheduler | None = None
        self._generations: dict[int, _Generation] = {}
        self._ready = threading.Event()
        self._jobs: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._saved_states: dict[int, bytes] = {}
        """The host-memory prompt cache's sequence states by key (the decode thread's alone)."""
        self._burst = BurstWait(settings.admission_wait_ms / 1000)
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        """Start the decode thread; the model loads there (`ready` turns true when done)."""
        self._thread = threading.Thread(target=self._run, name="llamacpp-decode", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        if self.load_error:
            raise RuntimeError(self.load_error)
        return self.ready

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.load_error is None

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        while self._jobs:
            self._jobs.popleft()[1].set_exception(RuntimeError("the engine stopped"))
        if self.backend is not None:
            for gen in self._generations.values():
                gen.sampler.free()
            self._generations.clear()
            self.backend.close()
            self.backend = None

    # -- the HTTP edge's side ------------------------------------------------------
    def submit(
        self, prompt_tokens: list[int], sampling: SamplingParams, sink: EventSink, *, reuse_prefix: bool = True,
        session: str = "",
    ) -> int:
        """Queue a request; raises `QueueFull` when the RequestQueue is at its bound."""
        assert self._scheduler is not None, "engine not ready"
        with self._lock:
            request = GenerationRequest(
                next(self._ids), list(prompt_tokens), sampling, sink, self.clock(), reuse_prefix=reuse_prefix,
                session=session,
            )
            try:
                self._scheduler.submit(request)
            except Exception:
                self.metrics.rejected_429 += 1
                raise
            self._burst.arrived(request.arrived_at, busy=bool(self._scheduler.running))
            self.metrics.prompt_tokens += len(prompt_tokens)
            self._lock.notify_all()
            return request.request_id

    def cancel(self, request_id: int) -> bool:
        """The client disconnected: the sequence leaves the batch at the next step."""
        if self._scheduler is None:
            return False
        with self._lock:
            tracked = self._scheduler.cancel(request_id, self.clock())
            if tracked is None:
                return False
            self.metrics.cancelled += 1
            self._lock.notify_all()
            return True

    # -- KV moves (the internal port's side) --------------------------------------
    def export_kv(self, prompt_tokens: list[int], session: str) -> "Future[SequenceState | None]":
        """`session`'s cached sequence sharing the longest prefix with `prompt_tokens`; None when none does.
        Only that session's: a conversation is never handed out because another's prompt starts like it."""

        def export() -> SequenceState | None:
            assert self.backend is not None and self._scheduler is not None
            entry, common = self._scheduler.kv.best_prefix(
                prompt_tokens, range(self._scheduler.seq_ids.n_seq_max), include_running=True, session=session
            )
            if entry is None or common == 0:
                return None
            self.metrics.kv_exports += 1
            return SequenceState(list(entry.tokens), self.backend.export_seq(entry.seq_id), session)

        return self._on_decode_thread(export)

    def import_kv(self, moved: SequenceState) -> "Future[int]":
        """Park a sequence exported by another engine of the same model; its sequence id.

        Raises `KVBusy` when every sequence id is decoding, `DecodeError` when
        llama.cpp refuses the state.
        """

        def import_() -> int:
            assert self.backend is not None and self._scheduler is not None
            if len(moved.tokens) >= self.backend.n_ctx_seq:
                raise ValueError(f"{len(moved.tokens)} tokens do not fit a sequence of {self.backend.n_ctx_seq}")
            request_id = next(self._ids)
            seq_id = self._scheduler.adopt(request_id, list(moved.tokens), self.clock(), moved.session)
            if seq_id is None:
                raise KVBusy("every sequence id is decoding")
            self._apply(self._scheduler.take_kv_ops())  # the entry it evicts is saved before the import overwrites it
            try:
                self.backend.import_seq(seq_id, moved.state, len(moved.tokens))
            except DecodeError:
                self._scheduler.kv.drop(request_id)
                raise
            self.metrics.kv_imports += 1
            return seq_id

        return self._on_decode_thread(import_)

    def _on_decode_thread(self, job: Callable[[], Any]) -> "Future[Any]":
        """Run `job` on the decode thread between two steps: only that thread may touch the context."""
        future: Future[Any] = Future()
        with self._lock:
            if self._stopping or not self.ready:
                future.set_exception(RuntimeError("the engine is not serving"))
                return future
            self._jobs.append((job, future))
            self._lock.notify_all()
        return future

    def _run_jobs(self) -> None:
        """Jobs see the KV exactly as the scheduler books it: pending trims and copies are applied first."""
        assert self.backend is not None and self._scheduler is not None
        if not self._jobs:
            return
        try:
            self._apply(self._scheduler.take_kv_ops())
        except DecodeError:
            log.exception("applying KV operations before a KV move failed")
        while self._jobs:
            job, future = self._jobs.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except Exception as exc:
                    future.set_exception(exc)

    def slots(self) -> list[dict[str, object]]:
        if self._scheduler is None:
            return []
        with self._lock:
            return self._scheduler.snapshot_slots()

    def request_state(self, request_id: int) -> RequestState | None:
        if self._scheduler is None:
            return None
        with self._lock:
            return next((t.state for t in self._scheduler.iter_active() if t.request_id == request_id), None)

    def status(self) -> dict[str, float | int]:
        if self._scheduler is None:
            return {"running": 0, "waiting": 0, "kv_usage_ratio": 0.0, "kv_tokens": 0, "free_seq_ids": 0, "queued": 0}
        with self._lock:
            s = self._scheduler
            return {
                "running": s.processing(),
                "waiting": s.waiting(),
                "kv_usage_ratio": s.kv.usage_ratio,
                "kv_tokens": s.kv.used_items,
                "free_seq_ids": len(s.seq_ids.free_ids()),
                "queued": len(s.queue),
            }

    def prometheus(self, labels: dict[str, str]) -> str:
        st = self.status()
        with self._lock:
            return render_prometheus(
                self.metrics,
                running=int(st["running"]),
                waiting=int(st["waiting"]),
                kv_usage_ratio=float(st["kv_usage_ratio"]),
                kv_tokens=int(st["kv_tokens"]),
                labels=labels,
                prompt_cache_bytes=self._scheduler.prompts.used_bytes if self._scheduler and self._scheduler.prompts else 0,
            )

    # -- the decode thread -----------------------------------------------------------
    def _load(self) -> None:
        s = self.settings
        backend = LlamaBackend(
            LlamaModelConfig(self.model_path, n_ctx=s.total_ctx, n_seq_max=s.n_seq_max, n_batch=s.n_batch, threads=s.threads)
        )
        kv = KVCacheManager(
            KVLimits(
                max_items=min(s.kv_cache_max_items, backend.n_ctx),
                max_memory_mb=s.kv_cache_max_memory_mb,
                bytes_per_token=backend.kv_bytes_per_token(),
                eviction_threshold=s.kv_cache_eviction_threshold,
            )
        )
        self._scheduler = BatchScheduler(
            SchedulerLimits(
                max_queue=s.max_queue,
                max_running=s.max_running,
                max_batch_size=s.batch_width,
                batch_tokens=s.n_batch,
                request_timeout_s=s.request_timeout_s,
                prefix_cache=s.prefix_cache,
            ),
            SequenceIdPool(s.n_seq_max),
            kv,
            HostPromptCache(int(s.prompt_cache_mb * MIB), backend.kv_bytes_per_token()),
        )
        self.backend = backend

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:  # reported through /health
            log.exception("model load failed")
            self.load_error = f"{type(exc).__name__}: {exc}"
            self._ready.set()
            return
        self._ready.set()
        last_scan = last_cleanup = self.clock()
        outbox = _Outbox()
        while True:
            with self._lock:
                if self._stopping:
                    return
                self._run_jobs()
                now = self.clock()
                if now - last_scan >= self.settings.timeout_scan_interval_s:
                    last_scan = now
                    for tracked in self._scheduler.expire(now):  # type: ignore[union-attr]
                        self.metrics.timeouts_408 += 1
                        self._end(tracked, outbox, f"the request timed out after {self.settings.request_timeout_s:g} s")
                if now - last_cleanup >= self.settings.kv_cache_cleanup_interval_s:
                    last_cleanup = now
                    self._scheduler.cleanup_kv()  # type: ignore[union-attr]
                self._drop_orphans()
                gathering = self._gathering(now)
                if gathering > 0:
                    self._lock.wait(timeout=gathering)
                    continue
                plan = self._scheduler.schedule(now)  # type: ignore[union-attr]
                self.metrics.prefix_copies += sum(1 for op, _, _ in plan.kv_ops if op == "copy")
                if not plan.work and not plan.kv_ops:
                    outbox.deliver()
                    wait = self.settings.timeout_scan_interval_s - (now - last_scan)
                    self._lock.wait(timeout=max(0.01, wait))
                    continue
                for item in plan.work:
                    if item.request_id not in self._generations:
                        tracked = self._scheduler.running[item.request_id]  # type: ignore[union-attr]
                        self._generations[item.request_id] = _Generation(
                            self.backend.new_sampler(tracked.request.sampling),  # type: ignore[union-attr]
                            TextAssembler(tracked.request.sampling.stop),
                        )
            outbox.deliver()
            self._step(plan, outbox)
            outbox.deliver()

    def _gathering(self, now: float) -> float:
        """How much longer an idle engine waits for more of a burst before its first step (0: it goes now; see
        `BurstWait`). A busy engine never waits, arrivals join its next step anyway; nor does a full batch."""
        s = self._scheduler
        assert s is not None
        if not s.queue or s.processing():
            return 0.0
        arrivals = [t.request.arrived_at for t in s.queue]
        wait = 0.0 if s.waiting() >= self.settings.batch_width else self._burst.wait_s(now, arrivals)
        if wait <= 0:
            self._burst.started(arrivals)
        return wait

    def _step(self, plan: StepPlan, outbox: _Outbox) -> None:
        backend = self.backend
        assert backend is not None and self._scheduler is not None
        try:
            self._apply(plan.kv_ops)
            if not plan.work:
                return
            t0 = self.clock()
            out_index = backend.decode(plan.work)
            t1 = self.clock()
            sampled: list[tuple[int, int]] = []
            n_outputs = len(out_index) - out_index.count(-1)
            if n_outputs:
                rows = iter(backend.output_logits(n_outputs))
                for item, idx in zip(plan.work, out_index):
                    if idx >= 0:
                        sampler = self._generations[item.request_id].sampler
                        sampled.append((item.request_id, sampler.sample(idx, next(rows))))
        except DecodeError as exc:
            log.error("decode step %d failed: %s", plan.step_id, exc)
            with self._lock:
                for item in plan.work:
                    if item.request_id in self._scheduler.running:
                        tracked = self._scheduler.finish(item.request_id, RequestState.FAILED, self.clock())
                        self.metrics.failures_500 += 1
                        self._end(tracked, outbox, f"the llama.cpp engine failed: {exc}")
            return
        with self._lock:
            now = self.clock()
            self.metrics.decode_steps += 1
            self.metrics.decode_seconds += t1 - t0
            self.step_log.append(
                StepRecord(
                    plan.step_id, t0, t1 - t0, tuple((w.seq_id, w.request_id, len(w.tokens), w.kind) for w in plan.work)
                )
            )
            for item in plan.work:
                self._scheduler.record_decoded(item, now)
            for request_id, token in sampled:
                if request_id in self._scheduler.running:
                    self._accept_token(self._scheduler.running[request_id], token, now, outbox)

    def _apply(self, kv_ops: list[KVOp]) -> None:
        """The scheduler's KV operations, in order: llama.cpp's own, and the host-memory prompt cache's (the
        states saved by key live here; the scheduler books which tokens each holds)."""
        backend = self.backend
        assert backend is not None
        for op in kv_ops:
            kind, seq_id, key = op
            if kind == "save":
                try:
                    self._saved_states[key] = backend.export_seq(seq_id)
                except DecodeError:
                    log.exception("sequence %d could not be saved to host memory", seq_id)
                    with self._lock:
                        self._scheduler.prompts.forget(key)  # type: ignore[union-attr]  # it booked the save
            elif kind == "restore":
                state = self._saved_states.get(key)
                if state is None:
                    raise DecodeError(f"no state saved under key {key} to restore sequence {seq_id} from")
                backend.import_seq(seq_id, state, backend.n_ctx_seq)
                self.metrics.prompt_cache_restores += 1
            elif kind == "free":
                self._saved_states.pop(key, None)
            else:
                backend.apply([op])

    def _accept_token(self, tracked: Tracked, token: int, now: float, outbox: _Outbox) -> None:
        assert self.backend is not None and self._scheduler is not None
        gen = self._generations[tracked.request_id]
        sink = tracked.request.sink
        if gen.first_token_at is None:
            gen.first_token_at = now
            self.metrics.ttft_s.observe(now - tracked.request.arrived_at)
            self.metrics.reused_tokens += tracked.cached_tokens
        elif gen.last_token_at is not None:
            self.metrics.itl_s.observe(now - gen.last_token_at)
        gen.last_token_at = now
        if self.backend.is_eog(token):
            self._complete(tracked, "stop", outbox, flush=True)
            return
        self._scheduler.add_generated(tracked.request_id, token)
        self.metrics.generated_tokens += 1
        text, stopped = gen.text.feed(self.backend.piece(token))
        if stopped:
            if text:
                outbox.add(sink, TokenEvent(text, len(tracked.generated)))
            self._complete(tracked, "stop", outbox, flush=False)
            return
        if len(tracked.generated) >= tracked.request.sampling.max_tokens:
            if text:
                outbox.add(sink, TokenEvent(text, len(tracked.generated)))
            self._complete(tracked, "length", outbox, flush=True)
            return
        outbox.add(sink, TokenEvent(text, len(tracked.generated)))

    def _complete(self, tracked: Tracked, reason: str, outbox: _Outbox, *, flush: bool) -> None:
        assert self._scheduler is not None
        gen = self._generations.pop(tracked.request_id)
        gen.sampler.free()
        # Text held back as a possible stop sequence is released when generation ends otherwise.
        tail = gen.text.flush() if flush else ""
        self._scheduler.finish(tracked.request_id, RequestState.COMPLETED, self.clock())
        self.metrics.completed += 1
        outbox.add(
            tracked.request.sink,
            FinishEvent(
                RequestState.COMPLETED,
                reason,
                tail,
                len(tracked.request.prompt_tokens),
                len(tracked.generated),
                tracked.cached_tokens,
            ),
        )

    def _end(self, tracked: Tracked, outbox: _Outbox, message: str) -> None:
        """A request left without completing (timeout, failure): tell its client."""
        gen = self._generations.pop(tracked.request_id, None)
        if gen is not None:
            gen.sampler.free()
        outbox.add(
            tracked.request.sink,
            FinishEvent(
                tracked.state,
                None,
                "",
                len(tracked.request.prompt_tokens),
                len(tracked.generated),
                tracked.cached_tokens,
                message,
            ),
        )

    def _drop_orphans(self) -> None:
        """Free samplers of requests that left the running set from another thread (cancel)."""
        assert self._scheduler is not None
        for request_id in [r for r in self._generations if r not in self._scheduler.running]:
            self._generations.pop(request_id).sampler.free()
