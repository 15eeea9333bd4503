"""Collects an experiment's traces from the step results, in memory.

The recorder is fed by the runner's callbacks and does no I/O; `outputs`
writes what it holds. Rows are plain tuples in the column order of seed 002.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from simulation.core import DecodeSystem, PreemptionMode, SimRequest, StepResult

BATCH_COLUMNS = (
    "time", "batch_id", "batch_count", "batch_tokens", "running_count", "waiting_count",
    "swapped_count", "gpu_memory_used", "memory_utilization", "batch_duration",
    "completed_count", "batch_sacrifice_count",
)
TRACE_COLUMNS = (
    "req_id", "arrival_time", "prefill_length", "decode_length", "completion_time", "total_delay",
    "waiting_time", "execution_time", "swap_count", "total_swapped_time", "sacrifice_count",
)
EVENT_COLUMNS = ("time", "batch_id", "event_type", "req_id", "decode_position")
QUEUE_COLUMNS = (
    "time", "batch_id", "waiting_count", "running_count", "swapped_count",
    "waiting_ids", "running_ids", "swapped_ids",
)
MEMORY_COLUMNS = ("time", "batch_id", "event_type", "req_id", "memory_delta", "gpu_memory_used", "memory_utilization")
SACRIFICE_COLUMNS = (
    "time", "req_id", "current_decode_position", "memory_freed",
    "running_count_same_position", "total_running_count",
)


class Recorder:
    def __init__(self, system: DecodeSystem, *, window: float, queue_timeline_interval: int = 10) -> None:
        self.system = system
        self.M_total = system.params.M_total
        self.window = window
        self.queue_interval = queue_timeline_interval
        self.sacrifice_mode = system.params.mode is PreemptionMode.SACRIFICE
        self.requests: dict[str, SimRequest] = {}
        self.batches: list[tuple] = []
        self.events: list[tuple] = []
        self.memory: list[tuple] = []
        self.queue_rows: list[tuple] = []
        self.sacrifices: list[tuple] = []  # SACRIFICE_COLUMNS + batch_id
        # sacrifice mode: request-batches spent at each decode position, per time window
        self.exposure: defaultdict[int, Counter[int]] = defaultdict(Counter)
        self.completed = 0
        self.mismatches = 0  # memory bookkeeping disagreements (must stay 0)
        self._mem = 0
        self._swap_pos: dict[str, int] = {}

    def on_arrival(self, req: SimRequest, t: float) -> None:
        self.requests[req.request_id] = req
        self.events.append((t, self.system.batches, "arrival", req.request_id, 0))

    def _mem_event(self, t: float, b: int, kind: str, rid: str, delta: int) -> None:
        self._mem += delta
        self.memory.append((t, b, kind, rid, delta, self._mem, self._mem / self.M_total))

    def on_step(self, res: StepResult) -> None:
        t, b = res.start_time, res.batch_id
        reqs = self.requests
        events = self.events
        sacrificed = 0
        ordered = sorted(res.preemptions, key=lambda p: p.phase)
        for p in ordered:
            if p.phase != 1:
                break
            sacrificed += self._preemption(t, b, p)
        if self.sacrifice_mode and res.admitted:
            self.exposure[int(t // self.window)][0] += len(res.admitted)
        for rid in res.admitted:
            events.append((t, b, "admit", rid, 0))
            self._mem_event(t, b, "admit", rid, reqs[rid].prefill_length)
        for rid in res.swapped_in:
            pos = self._swap_pos.pop(rid, 0)
            events.append((t, b, "swap_in", rid, pos))
            self._mem_event(t, b, "swap_in", rid, reqs[rid].prefill_length + pos)
        for p in ordered:
            if p.phase == 2:
                sacrificed += self._preemption(t, b, p)
        if res.decoded:
            self._mem_event(t, b, "decode_growth", "", len(res.decoded))
        end = res.end_time
        for rid in res.completed:
            r = reqs[rid]
            events.append((end, b, "completion", rid, r.decode_length))
            self._mem_event(end, b, "completion", rid, -(r.prefill_length + r.decode_length))
        self.completed += len(res.completed)
        if self._mem != res.memory_used:
            self.mismatches += 1
            self._mem = res.memory_used
        self.batches.append((
            t, b, res.batch_count, res.batch_tokens, res.running, res.waiting, res.swapped,
            res.memory_peak, res.memory_peak / self.M_total, res.duration, self.completed, sacrificed,
        ))
        if b % self.queue_interval == 0:
            w, r, s = self.system.members()
            self.queue_rows.append((t, b, len(w), len(r), len(s), " ".join(w), " ".join(r), " ".join(s)))
        if self.sacrifice_mode:
            # exposure of the next batch: the positions RUNNING requests carry into it (its
            # admissions enter at position 0 and are added when that batch is recorded)
            self.exposure[int(end // self.window)].update(self.system.running_positions())

    def _preemption(self, t: float, b: int, p) -> int:
        if p.mode is PreemptionMode.SWAP:
            self._swap_pos[p.request_id] = p.decode_position
            self.events.append((t, b, "swap_out", p.request_id, p.decode_position))
            self._mem_event(t, b, "swap_out", p.request_id, -p.memory_freed)
            return 0
        self.events.append((t, b, "sacrifice", p.request_id, p.decode_position))
        self._mem_event(t, b, "sacrifice", p.request_id, -p.memory_freed)
        self.sacrifices.append((t, p.request_id, p.decode_position, p.memory_freed,
                                p.same_position_running, p.total_running, b))
        return 1

    def trace_rows(self) -> list[tuple]:
        rows = []
        for rid, r in self.requests.items():
            done = r.completion_time
            first = r.first_enter_running_time
            rows.append((
                rid, r.arrival_time, r.prefill_length, r.decode_length, done,
                None if done is None else done - r.arrival_time,
                None if first is None else first - r.arrival_time,
                None if done is None or first is None else done - first,
                r.swap_count, r.total_swapped_time, r.sacrifice_count,
            ))
        return rows
