"""The gateway's Prometheus `/metrics`, named as vLLM names its own (`modelpool:` where vLLM says `vllm:`).

Requests by alias, backend and outcome; how long requests waited for a slot and
how the wait ended; time to first token, end to end and per output token by
backend; retries; cold starts; demand signals; session migrations; and the queue and the load right now.
With them, the pool as the gateway's view of the log has it (`render_pool`): each alias's routing state and for
how long, instances by state, workers by status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from services.gateway.meter import Meter
from shared.contracts.states import InstanceState, RoutingState
from shared.metering import FAST, SLOW
from shared.projections.rows import InstanceRow, RoutingRow, WorkerRow, WorkerStatus
from shared.prometheus import Histogram, family

WAIT_BOUNDS_S = (0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 90, 120, 180, 300)
"""From a slot freeing on a busy instance (milliseconds) to a vLLM cold start (a minute or two)."""
LATENCY_BOUNDS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 320, 640)
TOKEN_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return ",".join(f'{name}="{_label(value)}"' for name, value in labels.items())


class GatewayMetrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str, str], int] = {}
        self.waits: dict[tuple[str, str], Histogram] = {}
        self.ttft: dict[tuple[str, str], Histogram] = {}
        self.e2e: dict[tuple[str, str], Histogram] = {}
        self.tpot: dict[tuple[str, str], Histogram] = {}
        self.retries: dict[tuple[str, str, str], int] = {}
        self.cold_starts: dict[str, int] = {}
        self.borrows: dict[str, int] = {}
        self.unbound: dict[str, int] = {}
        self.limited: dict[str, int] = {}
        self.demand_signals: dict[str, int] = {}
        self.session_moves: dict[tuple[str, str], int] = {}
        self.kv_moves: dict[tuple[str, str], int] = {}
        self.kv_move_seconds: dict[tuple[str, str], float] = {}
        self.prefix_pulls: dict[tuple[str, str], int] = {}
        self.prefix_pulled_tokens: dict[str, int] = {}
        self.prefix_pull_seconds: dict[tuple[str, str], float] = {}

    def request(self, alias: str, backend: str, outcome: str, status: int | None) -> None:
        """`status`: the HTTP status the client got (None: it left before any)."""
        key = (alias, backend, outcome, str(status) if status else "none")
        self.requests[key] = self.requests.get(key, 0) + 1

    def served(self, alias: str, backend: str, ttft_s: float | None, e2e_s: float, tpot_s: float | None) -> None:
        """A request answered in full by `backend`."""
        key = (alias, backend)
        if ttft_s is not None:
            _observe(self.ttft, key, LATENCY_BOUNDS_S, ttft_s)
        _observe(self.e2e, key, LATENCY_BOUNDS_S, e2e_s)
        if tpot_s is not None:
            _observe(self.tpot, key, TOKEN_BOUNDS_S, tpot_s)

    def waited(self, alias: str, outcome: str, seconds: float) -> None:
        _observe(self.waits, (alias, outcome), WAIT_BOUNDS_S, seconds)

    def retried(self, alias: str, backend: str, reason: str) -> None:
        key = (alias, backend, reason)
        self.retries[key] = self.retries.get(key, 0) + 1

    def cold_start(self, alias: str) -> None:
        self.cold_starts[alias] = self.cold_starts.get(alias, 0) + 1

    def borrowed(self, alias: str) -> None:
        self.borrows[alias] = self.borrows.get(alias, 0) + 1

    def session_unbound(self, alias: str) -> None:
        self.unbound[alias] = self.unbound.get(alias, 0) + 1

    def refused_by_limit(self, limit: str) -> None:
        self.limited[limit] = self.limited.get(limit, 0) + 1

    def session_moved(self, alias: str, reason: str) -> None:
        key = (alias, reason)
        self.session_moves[key] = self.session_moves.get(key, 0) + 1

    def kv_move(self, alias: str, moved: bool, seconds: float) -> None:
        key = (alias, "moved" if moved else "recomputed")
        self.kv_moves[key] = self.kv_moves.get(key, 0) + 1
        self.kv_move_seconds[key] = self.kv_move_seconds.get(key, 0.0) + seconds

    def prefix_pull(self, alias: str, tokens: int | None, seconds: float) -> None:
        """A prompt's prefix pulled from another instance (`tokens` of it), or computed again (None), after
        `seconds` spent trying."""
        key = (alias, "pulled" if tokens is not None else "recomputed")
        self.prefix_pulls[key] = self.prefix_pulls.get(key, 0) + 1
        self.prefix_pull_seconds[key] = self.prefix_pull_seconds.get(key, 0.0) + seconds
        if tokens is not None:
            self.prefix_pulled_tokens[alias] = self.prefix_pulled_tokens.get(alias, 0) + tokens

    def demand_signalled(self, alias: str) -> None:
        self.demand_signals[alias] = self.demand_signals.get(alias, 0) + 1

    def render(self, meter: Meter, waiting: dict[str, int]) -> str:
        out: list[str] = []
        family(out, "modelpool:requests_total", "counter",
               "Requests by alias, backend that answered (none: the gateway), outcome and HTTP status.")
        for (alias, backend, outcome, status), n in sorted(self.requests.items()):
            labels = _labels(alias=alias, backend=backend, outcome=outcome, status=status)
            out.append(f"modelpool:requests_total{{{labels}}} {n}")
        _histograms(out, "modelpool:request_queue_time_seconds", self.waits, ("alias", "outcome"),
                    "How long requests waited in the gateway for a slot, by how the wait ended.")
        _histograms(out, "modelpool:time_to_first_token_seconds", self.ttft, ("alias", "backend"),
                    "From arrival at the gateway to the first content of a streamed answer.")
        _histograms(out, "modelpool:e2e_request_latency_seconds", self.e2e, ("alias", "backend"),
                    "From arrival at the gateway to the end of a successful answer.")
        _histograms(out, "modelpool:request_time_per_output_token_seconds", self.tpot, ("alias", "backend"),
                    "Mean time between content chunks of a streamed answer.")
        family(out, "modelpool:retries_total", "counter",
               "Requests sent again to another instance of the same backend before any byte was relayed.")
        for (alias, backend, reason), n in sorted(self.retries.items()):
            out.append(f"modelpool:retries_total{{{_labels(alias=alias, backend=backend, reason=reason)}}} {n}")
        family(out, "modelpool:cold_starts_total", "counter",
               "Times requests waited for an alias with nothing routable and were then given an instance.")
        for alias, n in sorted(self.cold_starts.items()):
            out.append(f"modelpool:cold_starts_total{{{_labels(alias=alias)}}} {n}")
        family(out, "modelpool:slots_borrowed_total", "counter",
               "Requests of a tenant below its fair share of a saturated alias, sent past an instance's capacity.")
        for alias, n in sorted(self.borrows.items()):
            out.append(f"modelpool:slots_borrowed_total{{{_labels(alias=alias)}}} {n}")
        family(out, "modelpool:sessions_unbound_total", "counter",
               "New sessions served without a binding: their key had bound its sessions_per_minute.")
        for alias, n in sorted(self.unbound.items()):
            out.append(f"modelpool:sessions_unbound_total{{{_labels(alias=alias)}}} {n}")
        family(out, "modelpool:key_limit_refusals_total", "counter",
               "Requests refused at the front door by their key's limits (rpm, tpm, max_concurrent, aliases) or a "
               "full queue before their body was read (queue).")
        for limit, n in sorted(self.limited.items()):
            out.append(f"modelpool:key_limit_refusals_total{{{_labels(limit=limit)}}} {n}")
        family(out, "modelpool:demand_signals_total", "counter", "Demand signals sent for requests waiting on a cold alias.")
        for alias, n in sorted(self.demand_signals.items()):
            out.append(f"modelpool:demand_signals_total{{{_labels(alias=alias)}}} {n}")
        family(out, "modelpool:session_migrations_total", "counter",
               "Sessions moved from their host by the alias's router, by reason (host_hot, host_gone).")
        for (alias, reason), n in sorted(self.session_moves.items()):
            out.append(f"modelpool:session_migrations_total{{{_labels(alias=alias, reason=reason)}}} {n}")
        family(out, "modelpool:session_kv_moves_total", "counter",
               "Moved sessions whose KV went along (moved) or was recomputed on the new host (recomputed).")
        for (alias, outcome), n in sorted(self.kv_moves.items()):
            out.append(f"modelpool:session_kv_moves_total{{{_labels(alias=alias, outcome=outcome)}}} {n}")
        family(out, "modelpool:session_kv_move_seconds_total", "counter",
               "Time spent moving sessions' KV (export, transfer, import), by outcome.")
        for (alias, outcome), t in sorted(self.kv_move_seconds.items()):
            out.append(f"modelpool:session_kv_move_seconds_total{{{_labels(alias=alias, outcome=outcome)}}} {t:.6f}")
        family(out, "modelpool:prefix_pulls_total", "counter",
               "Prompts whose cached prefix was pulled from another instance (pulled) or, the pull failing, computed "
               "again (recomputed).")
        for (alias, outcome), n in sorted(self.prefix_pulls.items()):
            out.append(f"modelpool:prefix_pulls_total{{{_labels(alias=alias, outcome=outcome)}}} {n}")
        family(out, "modelpool:prefix_pull_seconds_total", "counter",
               "Time requests waited for their prefix's pull (export, transfer, import) before they were sent, by "
               "outcome.")
        for (alias, outcome), t in sorted(self.prefix_pull_seconds.items()):
            out.append(f"modelpool:prefix_pull_seconds_total{{{_labels(alias=alias, outcome=outcome)}}} {t:.6f}")
        family(out, "modelpool:prefix_pulled_tokens_total", "counter", "Prompt tokens pulled from another instance.")
        for alias, n in sorted(self.prefix_pulled_tokens.items()):
            out.append(f"modelpool:prefix_pulled_tokens_total{{{_labels(alias=alias)}}} {n}")
        family(out, "modelpool:num_requests_waiting", "gauge", "Requests waiting in the gateway for a slot right now.")
        for alias in sorted({*meter.aliases, *waiting}):
            out.append(f"modelpool:num_requests_waiting{{{_labels(alias=alias)}}} {waiting.get(alias, 0)}")
        family(out, "modelpool:num_requests_running", "gauge", "Requests on instances right now, by backend.")
        for alias, m in sorted(meter.aliases.items()):
            for backend in (FAST, SLOW):
                out.append(f"modelpool:num_requests_running{{{_labels(alias=alias, backend=backend.value)}}} "
                           f"{m.inflight[backend]}")
        return "\n".join(out) + "\n"


def _observe(histograms: dict[tuple[str, str], Histogram], key: tuple[str, str], bounds: tuple[float, ...],
             value: float) -> None:
    histogram = histograms.get(key)
    if histogram is None:
        histogram = histograms[key] = Histogram(bounds)
    histogram.observe(value)


def _histograms(out: list[str], name: str, histograms: dict[tuple[str, str], Histogram], label_names: tuple[str, str],
                help_text: str) -> None:
    family(out, name, "histogram", help_text)
    for key, histogram in sorted(histograms.items()):
        out.extend(histogram.lines(name, _labels(**dict(zip(label_names, key)))))


def render_pool(routing: Iterable[RoutingRow], instances: Iterable[InstanceRow], workers: Iterable[WorkerRow],
                now: datetime) -> str:
    """The pool as the gateway's view of the log has it: what alerts watch (an alias degraded for long, instances
    in ERROR, a worker lost), from any gateway replica."""
    out: list[str] = []
    routing = sorted(routing, key=lambda r: r.alias)
    family(out, "modelpool:alias_routing_state", "gauge", "1 for the routing state each alias is in, 0 for the others.")
    for row in routing:
        for state in RoutingState:
            out.append(f"modelpool:alias_routing_state{{{_labels(alias=row.alias, state=state.value)}}} "
                       f"{int(row.state is state)}")
    family(out, "modelpool:alias_routing_state_seconds", "gauge", "Seconds since each alias entered its routing state.")
    for row in routing:
        since = row.switched_at or row.updated_at
        out.append(f"modelpool:alias_routing_state_seconds{{{_labels(alias=row.alias)}}} "
                   f"{max(0.0, (now - since).total_seconds()):.3f}")
    family(out, "modelpool:alias_vllm_share", "gauge", "The share of each alias's traffic sent to vLLM (the mix weight).")
    for row in routing:
        out.append(f"modelpool:alias_vllm_share{{{_labels(alias=row.alias)}}} {row.mix_weight:g}")
    counts: dict[tuple[str, str, str], int] = {}
    for row in instances:
        key = (row.alias, row.backend_type.value, row.state.value)
        counts[key] = counts.get(key, 0) + 1
    family(out, "modelpool:instances", "gauge", "Instances by alias, backend and state (ABSENT ones not counted).")
    for (alias, backend, state), n in sorted(counts.items()):
        if state != InstanceState.ABSENT.value:
            out.append(f"modelpool:instances{{{_labels(alias=alias, backend=backend, state=state)}}} {n}")
    by_status: dict[str, int] = {status.value: 0 for status in WorkerStatus}
    for worker in workers:
        by_status[worker.status.value] += 1
    family(out, "modelpool:workers", "gauge", "Workers by status (up, stopped, lost).")
    for status, n in by_status.items():
        out.append(f"modelpool:workers{{{_labels(status=status)}}} {n}")
    return "\n".join(out) + "\n"


_RELAY_LAG = text(
    """
    SELECT coalesce((SELECT max(position) FROM events), 0) - coalesce(r.position, 0),
           extract(epoch FROM now() - (SELECT min(occurred_at) FROM events WHERE position > coalesce(r.position, 0)))
    FROM (SELECT (SELECT position FROM tracking WHERE name = 'relay') AS position) r
    """
)
RELAY_LAG_TIMEOUT_S = 1.0


async def render_relay_lag(engine: AsyncEngine) -> str:
    """How far the relay is behind the log (events recorded and not yet on the bus, and for how long the oldest has
    waited); nothing when the log cannot be read within a second, so a scrape never hangs on it."""
    try:
        async with asyncio.timeout(RELAY_LAG_TIMEOUT_S), engine.connect() as conn:
            behind, oldest_s = (await conn.execute(_RELAY_LAG)).one()
    except Exception:  # the log is away: the series are absent, and the gateway serves on
        return ""
    out: list[str] = []
    family(out, "modelpool:relay_lag_events", "gauge", "Events recorded in the log and not yet published on the bus.")
    out.append(f"modelpool:relay_lag_events {int(behind)}")
    family(out, "modelpool:relay_lag_seconds", "gauge", "How long the oldest event not yet on the bus has waited (0: none).")
    out.append(f"modelpool:relay_lag_seconds {max(0.0, float(oldest_s or 0.0)):.3f}")
    return "\n".join(out) + "\n"
