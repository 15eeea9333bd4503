"""Runs the decode model of seed 002 (`simulation.core.DecodeSystem`) in real time.

One asyncio task owns the decode system. Each turn it executes one batch
(`step(now)`), sleeps until the batch's end (`duration / speedup` after its
start), then hands one token to every request that produced one and finishes
the completed ones. Delivery is a counter bump plus the resolution of one
future per waiting stream, so a batch of N streams costs N cheap wake-ups and
no per-token tasks; streams render and write their own bytes.

Deadlines are kept on the schedule rather than on the actual wake-up time, so
the time spent delivering a batch is absorbed by the next batch's sleep. If
delivery takes longer than a batch, the engine falls behind: the scheduled
batch time (`EngineStats.scheduled_wall_s`) then advances slower than the wall
clock, which is how the benchmark sees the simulator stop keeping its own time.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass

from services.engines.simulated.config import EngineConfig
from services.engines.simulated.metrics import EngineStats
from simulation.core import DecodeSystem, PreemptionMode, SimRequest, Strategy, SystemParams

log = logging.getLogger(__name__)

# If the engine is this far behind its schedule (wall seconds), it stops trying
# to catch up with back-to-back batches and restarts its schedule from now.
_MAX_CATCH_UP_S = 0.25


def system_params(config: EngineConfig) -> SystemParams:
    """The decode model of one engine: prefill is simulated, decodes cost one token of B."""
    caching = config.enable_prefix_caching
    return SystemParams(
        M_total=config.kv_tokens,
        B=config.max_num_batched_tokens,
        d_0=config.d_0,
        d_1=config.d_1,
        mode=PreemptionMode(config.preemption_mode),
        strategy=Strategy(config.preemption_strategy),
        prefill=True,
        prefix_cache_blocks=config.kv_tokens // config.block_size if caching else 0,
        block_size=config.block_size,
        seed=config.seed,
    )


@dataclass(eq=False, slots=True)
class Generation:
    """One request's progress as its stream sees it."""

    request_id: str
    prompt_tokens: int
    decode_length: int
    stop_reason: str
    """Finish reason when all `decode_length` tokens are out: "length" if the client's limit cut it."""
    text_seed: int
    prefix_hashes: tuple[int, ...] = ()
    submitted_sim: float = 0.0
    emitted: int = 0
    cached_tokens: int = 0
    last_token_sim: float = 0.0
    admitted: bool = False
    finish_reason: str | None = None
    waiter: asyncio.Future[None] | None = None
    sim_request: SimRequest | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


class RealTimeDriver:
    def __init__(self, config: EngineConfig, stats: EngineStats) -> None:
        self.config = config
        self.stats = stats
        self.params = system_params(config)
        self.system = DecodeSystem(self.params)
        self._retired: dict[str, int] = {}
        self.active: dict[str, Generation] = {}
        self.deferred: deque[Generation] = deque()
        self._speedup = config.speedup
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._kick: asyncio.Event | None = None
        self._empty: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._kick = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self._task = self._loop.create_task(self._run(), name="simulated-engine-driver")
        self._task.add_done_callback(self._on_exit)

    def _on_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # A bug in the loop must not leave streams hanging: fail them and refuse new work.
        self.failure = task.exception()
        log.error("decode loop failed; aborting %d requests", len(self.active), exc_info=self.failure)
        for gen in list(self.active.values()):
            self._finish(gen, "abort", self.sim_now())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for gen in list(self.active.values()):
            self._finish(gen, "abort", self.sim_now())

    def reset(self) -> None:
        """A fresh decode system (empty KV and prefix cache) for an idle engine, counters kept."""
        if self.active:
            raise RuntimeError("reset needs an idle engine")
        for name, value in self.system.counters.items():
            self._retired[name] = self._retired.get(name, 0) + value
        self.system = DecodeSystem(self.params)

    # ------------------------------------------------------------ views

    def sim_now(self) -> float:
        assert self._loop is not None, "driver not started"
        return (self._loop.time() - self._t0) * self._speedup

    def counter(self, name: str) -> int:
        return self._retired.get(name, 0) + self.system.counters.get(name, 0)

    @property
    def running(self) -> int:
        return self.system.running

    @property
    def waiting(self) -> int:
        return self.system.waiting + self.system.swapped

    @property
    def idle(self) -> bool:
        return not self.active

    # ------------------------------------------------------------ requests

    def submit(self, gen: Generation) -> None:
        """Queue a request; ValueError if the decode system cannot ever hold it."""
        assert self._kick is not None and self._empty is not None, "driver not started"
        if self.failure is not None:
            raise RuntimeError(f"the decode loop failed: {self.failure!r}")
        gen.submitted_sim = self.sim_now()
        self.active[gen.request_id] = gen
        self._empty.clear()
        if self.system.in_system < self.config.max_num_seqs:
            self._enter_system(gen)
        else:
            self.deferred.append(gen)
        self._kick.set()

    def cancel(self, gen: Generation) -> bool:
        """Stop a request now (client gone): its KV memory is freed before the next batch."""
        if gen.finish_reason is not None:
            return False
        if not self.system.cancel(gen.request_id):
            try:
                self.deferred.remove(gen)
            except ValueError:
                pass
        self._finish(gen, "abort", self.sim_now())
        self._admit_deferred()
        return True

    def abort_all(self) -> int:
        """Stop every request under way (vLLM's sleep in its default `mode=abort`); how many were stopped."""
        aborted = [gen for gen in list(self.active.values()) if self.cancel(gen)]
        return len(aborted)

    async def wait(self, gen: Generation) -> None:
        """Until the next batch gives `gen` a token or finishes it; the caller re-checks its counters."""
        assert self._loop is not None
        waiter = self._loop.create_future()
        gen.waiter = waiter
        await waiter

    async def drained(self) -> None:
        assert self._empty is not None
        await self._empty.wait()

    def _enter_system(self, gen: Generation) -> None:
        request = SimRequest(
            request_id=gen.request_id,
            arrival_time=self.sim_now(),
            prefill_length=gen.prompt_tokens,
            decode_length=gen.decode_length,
            prefix_hashes=gen.prefix_hashes,
        )
        gen.sim_request = request
        self.system.add(request)

    def _admit_deferred(self) -> None:
        limit = self.config.max_num_seqs
        while self.deferred and self.system.in_system < limit:
            self._enter_system(self.deferred.popleft())

    def _finish(self, gen: Generation, reason: str, now_sim: float) -> None:
        self.active.pop(gen.request_id, None)
        gen.finish_reason = reason
        stats = self.stats
        stats.requests_finished[reason] = stats.requests_finished.get(reason, 0) + 1
        if reason != "abort":
            stats.e2e.observe(now_sim - gen.submitted_sim)
        gen.wake()
        if not self.active and self._empty is not None:
            self._empty.set()

    # ------------------------------------------------------------ the loop

    async def _run(self) -> None:
        loop = self._loop
        assert loop is not None and self._kick is not None
        speedup = self._speedup
        stats = self.stats
        next_start = loop.time()
        while True:
            if not self.system.has_work():
                self._kick.clear()
                await self._kick.wait()
                next_start = loop.time()
                continue
            wall = loop.time()
            if wall - next_start < _MAX_CATCH_UP_S:
                start = next_start if next_start < wall else wall
            else:
                start = wall
                stats.schedule_resets += 1
            result = self.system.step((start - self._t0) * speedup)
            if result is None:
                # work exists but nothing can run (cannot happen with a valid config); do not spin
                await asyncio.sleep(0.001)
                next_start = loop.time()
                continue
            deadline = start + result.duration / speedup
            delay = deadline - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            end_sim = (deadline - self._t0) * speedup
            self._deliver(result, end_sim)
            stats.steps += 1
            stats.busy_slots_sum += result.batch_count
            stats.scheduled_wall_s += result.duration / speedup
            if result.prefilled:
                stats.prefill_sim_s += result.duration
            else:
                stats.decode_sim_s += result.duration
            finished_at = loop.time()
            stats.actual_wall_s += (finished_at if finished_at > deadline else deadline) - start
            next_start = deadline

    def _deliver(self, result, now_sim: float) -> None:
        active = self.active
        stats = self.stats
        if result.admitted:
            for rid in result.admitted:
                gen = active.get(rid)
                if gen is not None and not gen.admitted:
                    gen.admitted = True
                    stats.queue_time.observe(result.start_time - gen.submitted_sim)
        itl = stats.itl
        for rid in result.emitted:
            gen = active.get(rid)
            if gen is None:
                continue
            if gen.emitted == 0:
                stats.ttft.observe(now_sim - gen.submitted_sim)
                stats.prompt_tokens += gen.prompt_tokens
                if gen.sim_request is not None:
                    gen.cached_tokens = gen.sim_request.cached_tokens
            else:
                itl.observe(now_sim - gen.last_token_sim)
            gen.last_token_sim = now_sim
            gen.emitted += 1
            waiter = gen.waiter  # Generation.wake, inlined: this loop runs once per streamed token
            if waiter is not None:
                gen.waiter = None
                if not waiter.done():
                    waiter.set_result(None)
        stats.generation_tokens += len(result.emitted)
        if result.completed:
            for rid in result.completed:
                gen = active.get(rid)
                if gen is not None:
                    gen.emitted = gen.decode_length
                    self._finish(gen, gen.stop_reason, now_sim)
            self._admit_deferred()
