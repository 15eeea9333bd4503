"""One alias's metric window as requests pass (seed 000 §6): pure, over the clock it is given.

The gateway keeps one per alias on the monotonic clock and publishes what it
adds up as `GatewayWindow`s (`services/gateway/meter.py`); the lab keeps one on
its virtual clock (`lab/cluster.py`). Both hand the controller windows merged
by `merge_windows`, so a policy sees the same numbers from the same requests.
What is measured, and from when to when, is written down in docs/gateway.md.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from enum import Enum

from shared.contracts.backends import BackendType
from shared.contracts.telemetry import GatewayWindow, HistogramRecorder

FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM


class AliasMeter:
    """One alias's counters for the window under way.

    In-flight and held requests are kept as time integrals: each change first adds
    `count x time since the last change`, so the window's average is exact, not sampled.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._since = self._last = clock()
        self.inflight = {FAST: 0, SLOW: 0}
        self.held = 0
        self._open()

    def _open(self) -> None:
        self.arrivals = 0
        self.answered = {FAST: 0, SLOW: 0}
        self.errors = {FAST: 0, SLOW: 0}
        self.errors_gateway = 0
        self.timeouts_slow = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self._inflight_area = {FAST: 0.0, SLOW: 0.0}
        self._held_area = 0.0
        self.inflight_peak = self.inflight[FAST] + self.inflight[SLOW]
        self.queue_wait = HistogramRecorder()
        self.ttft = HistogramRecorder()
        self.e2e = {FAST: HistogramRecorder(), SLOW: HistogramRecorder()}
        self.tbt = HistogramRecorder()

    def _advance(self) -> None:
        now = self._clock()
        elapsed = now - self._last
        if elapsed > 0:
            self._inflight_area[FAST] += self.inflight[FAST] * elapsed
            self._inflight_area[SLOW] += self.inflight[SLOW] * elapsed
            self._held_area += self.held * elapsed
        self._last = now

    def add_inflight(self, backend: BackendType, delta: int) -> None:
        self._advance()
        self.inflight[backend] += delta
        self.inflight_peak = max(self.inflight_peak, self.inflight[FAST] + self.inflight[SLOW])

    def add_held(self, delta: int) -> None:
        self._advance()
        self.held += delta

    def close(self, gateway_id: str, alias: str, start: datetime, end: datetime) -> GatewayWindow:
        """The window's numbers; the next window starts now, with what is still in flight or held."""
        self._advance()
        seconds = self._last - self._since

        def average(area: float, current: int) -> float:
            return area / seconds if seconds > 0 else float(current)

        window = GatewayWindow(
            gateway_id=gateway_id, alias=alias, window_start=start, window_end=end,
            arrivals=self.arrivals,
            requests_fast=self.answered[FAST], requests_slow=self.answered[SLOW],
            errors_fast=self.errors[FAST], errors_slow=self.errors[SLOW], errors_gateway=self.errors_gateway,
            timeouts_slow=self.timeouts_slow,
            inflight_fast=average(self._inflight_area[FAST], self.inflight[FAST]),
            inflight_slow=average(self._inflight_area[SLOW], self.inflight[SLOW]),
            inflight_peak=self.inflight_peak,
            queue_len=average(self._held_area, self.held),
            held=self.held,
            prefill_tokens=self.prefill_tokens, decode_tokens=self.decode_tokens,
            queue_wait_s=self.queue_wait.snapshot(), ttft_s=self.ttft.snapshot(),
            e2e_fast_s=self.e2e[FAST].snapshot(), e2e_slow_s=self.e2e[SLOW].snapshot(), tbt_s=self.tbt.snapshot(),
        )
        self._since = self._last
        self._open()
        return window


class RequestOutcome(str, Enum):
    """How a request ended, for the windows and the request counters."""

    OK = "ok"
    CLIENT_ERROR = "client_error"
    """The engine refused something the client sent (a 4xx other than 408 / 429)."""
    ENGINE_ERROR = "engine_error"
    """The engine failed: 408, 429 or 5xx, or a stream broken midway."""
    UNREACHABLE = "unreachable"
    """No instance took the connection (one retry included)."""
    HOLD_EXPIRED = "hold_expired"
    """Waited for a cold alias longer than its start budget (503)."""
    QUEUE_FULL = "queue_full"
    """The alias's queue was full (429)."""
    QUEUE_TIMEOUT = "queue_timeout"
    """Waited for a slot on a running instance longer than the queue timeout (408)."""
    GATEWAY_ERROR = "gateway_error"
    LEFT = "client_left"


ENGINE_FAILURES = (RequestOutcome.ENGINE_ERROR, RequestOutcome.UNREACHABLE)
GATEWAY_FAILURES = (RequestOutcome.HOLD_EXPIRED, RequestOutcome.QUEUE_FULL, RequestOutcome.QUEUE_TIMEOUT, RequestOutcome.GATEWAY_ERROR)


class RequestTrace:
    """One request's moments, recorded into its alias's meter as they happen."""

    __slots__ = ("meter", "clock", "arrived", "backend", "dispatched_at", "first_content", "last_content", "content_chunks",
                 "ended")

    def __init__(self, meter: AliasMeter, clock: Callable[[], float]) -> None:
        self.meter = meter
        self.clock = clock
        self.arrived = clock()
        self.backend: BackendType | None = None
        self.dispatched_at: float | None = None
        self.first_content: float | None = None
        self.last_content: float | None = None
        self.content_chunks = 0
        self.ended = self.arrived
        meter.arrivals += 1

    def dispatched(self, backend: BackendType) -> None:
        self.backend = backend
        self.dispatched_at = self.clock()
        self.meter.queue_wait.record(self.dispatched_at - self.arrived)
        self.meter.add_inflight(backend, 1)

    def refused(self, backend: BackendType) -> None:
        """An instance refused the connection or did not accept it in time."""
        if backend is SLOW:
            self.meter.timeouts_slow += 1

    def content(self, chunks: int, now: float) -> None:
        """`chunks` content chunks arrived together at `now`.

        Chunks that arrive in one read share the time since the previous read
        evenly: that is the gap a reader of the stream sees per token.
        """
        if self.last_content is None:
            self.first_content = now
            self.meter.ttft.record(now - self.arrived)
        else:
            self.meter.tbt.record((now - self.last_content) / chunks, chunks)
        self.last_content = now
        self.content_chunks += chunks

    def finished(self, outcome: RequestOutcome, usage: tuple[int, int] | None) -> None:
        """`usage` is (prompt tokens, completion tokens) when the engine said; else content chunks count as decode tokens."""
        meter, backend = self.meter, self.backend
        self.ended = self.clock()
        if outcome in GATEWAY_FAILURES:
            meter.errors_gateway += 1
        if backend is None:
            return
        meter.add_inflight(backend, -1)
        meter.answered[backend] += 1
        if outcome in ENGINE_FAILURES:
            meter.errors[backend] += 1
        elif outcome is RequestOutcome.OK:
            meter.e2e[backend].record(self.ended - self.arrived)
        if usage is not None:
            meter.prefill_tokens += usage[0]
            meter.decode_tokens += usage[1]
        else:
            meter.decode_tokens += self.content_chunks

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_content is None else self.first_content - self.arrived

    @property
    def tpot_s(self) -> float | None:
        """Mean time between content chunks after the first, as a reader of the stream saw them."""
        if self.first_content is None or self.last_content is None or self.content_chunks < 2:
            return None
        return (self.last_content - self.first_content) / (self.content_chunks - 1)
