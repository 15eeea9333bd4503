"""An alias's timeline as series: what `modelpool history ALIAS --plot` draws (`timeline_figure.py`).

`gather_timeline` reads the series as plain data: routing states and the switches
between them, the mix weight, instances per backend and state, the controller's
targets, and the load the gateways measured.

Where the facts come from:

- routing, mix, targets, instances and configuration: the event log, folded by
  the read models' own reducers. Events before `--since` are folded too, so the
  figure starts in the state the alias was in, not in a blank one;
- load and latency: the gateways' metric windows on the bus (a 24 h stream),
  the replicas of each period merged with `merge_windows`. Where the bus is
  unreachable or holds nothing for part of the range, the metric windows the
  controller recorded with its decisions (`PolicyDecided.snapshot.metrics`)
  stand in: they are samples taken when it decided, not every window, and the
  figure says so.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from nats.js.errors import NotFoundError

from shared.bus.jetstream import connect_once
from shared.bus.subjects import Subjects
from shared.bus.telemetry import WINDOWS_MAX_AGE_S, TelemetryBus
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.control import MetricWindow
from shared.contracts.events import (
    AliasConfigured,
    InstanceStateChanged,
    MixWeightChanged,
    PolicyDecided,
    RoutingStateChanged,
    ScalingTargetsChanged,
    event_registry,
)
from shared.contracts.states import InstanceState, RoutingState
from shared.contracts.telemetry import GatewayWindow, merge_windows
from shared.eventlog.db import create_engine
from shared.eventlog.store import StoredEvent, make_store
from shared.projections.readmodels import INSTANCES, ROUTING
from shared.projections.rows import InstanceRow, RoutingRow
from shared.settings import Settings

BUS_TIMEOUT_S = 3.0
STATE_EVENTS = tuple(e.TYPE for e in (AliasConfigured, RoutingStateChanged, MixWeightChanged,
                                       ScalingTargetsChanged, InstanceStateChanged))
"""What the alias's state is made of; read from the start of the log, so the range starts in the right state."""


class TimelineError(ValueError):
    """Nothing to draw: an alias with no events, or a range that ends before it starts."""


# --------------------------------------------------------------------------- the series


@dataclass(frozen=True)
class Switch:
    number: int
    """1, 2, ... in the range, as the figure labels it."""
    at: datetime
    from_state: RoutingState
    to_state: RoutingState
    reason: str


@dataclass(frozen=True)
class StateSpan:
    state: RoutingState
    start: datetime
    end: datetime
    switch: Switch | None
    """The switch that began it; None when the range starts inside it."""


@dataclass(frozen=True)
class StepValue:
    """A value that holds from `at` until the next step."""

    at: datetime
    value: float


@dataclass(frozen=True)
class InstanceCounts:
    """How many instances of each backend are in each state, from `at` until the next count (ABSENT left out)."""

    at: datetime
    counts: dict[BackendType, dict[InstanceState, int]]


@dataclass(frozen=True)
class Timeline:
    alias: str
    since: datetime
    until: datetime
    engines: dict[BackendType, tuple[EngineKind, ...]]
    """The engines the alias's configuration named for each backend during the range."""
    spans: list[StateSpan]
    switches: list[Switch]
    mix: list[StepValue]
    """Share of traffic to vLLM (0..1): the weight in force at `since`, then each change."""
    targets: dict[BackendType, list[StepValue]]
    instances: list[InstanceCounts]
    """The counts at `since`, then after each change."""
    load: list[MetricWindow]
    """The gateways' windows from the bus, replicas merged, oldest first."""
    recorded_load: list[MetricWindow]
    """Windows recorded with decisions, for the part of the range the bus has no windows for."""
    load_note: str

    def instances_at(self, at: datetime) -> dict[BackendType, dict[InstanceState, int]]:
        return next(c.counts for c in reversed(self.instances) if c.at <= at)

    def mix_at(self, at: datetime) -> float:
        return next(s.value for s in reversed(self.mix) if s.at <= at)


# --------------------------------------------------------------------------- gathering


async def read_gateway_windows(settings: Settings, alias: str, since: datetime,
                               until: datetime) -> tuple[list[GatewayWindow] | None, str]:
    """The alias's gateway windows still on the bus; None and the reason when it cannot be read."""
    try:
        nc = await connect_once(settings.nats_url, name="modelpool-history", timeout_s=BUS_TIMEOUT_S,
                                credentials=settings.nats_credentials)
    except ConnectionError as exc:
        return None, str(exc)
    try:
        return await TelemetryBus(nc, nc.jetstream(), Subjects(settings.namespace)).read_windows(since, until, alias), ""
    except NotFoundError:  # no gateway ever published in this namespace: no stream, nothing held
        return [], ""
    except Exception as exc:  # the figure can still be drawn from the log alone
        return None, f"gateway windows unreadable from NATS at {settings.nats_url} ({exc.__class__.__name__})"
    finally:
        await nc.close()


def recorded_windows(decisions: Sequence[PolicyDecided], since: datetime, until: datetime) -> list[MetricWindow]:
    """The metric windows recorded with decisions that ended in [since, until], each once, oldest first.

    Several decisions can carry the same window (it stays the newest until the next one arrives).
    """
    found: dict[datetime, MetricWindow] = {}
    for decision in decisions:
        window = decision.snapshot.metrics
        if window is not None and since <= window.window_end <= until:
            found.setdefault(window.window_start, window)
    return [found[start] for start in sorted(found)]


def merged_periods(windows: Sequence[GatewayWindow]) -> list[MetricWindow]:
    """One window per period: the replicas of the same period (same `window_start`) merged."""
    periods: dict[datetime, list[GatewayWindow]] = defaultdict(list)
    for w in windows:
        periods[w.window_start].append(w)
    return [merge_windows(periods[start]) for start in sorted(periods)]


async def gather_timeline(settings: Settings, alias: str, since: datetime | None = None,
                          until: datetime | None = None) -> Timeline:
    """The alias's series over [since, until]: from its first event and until now by default."""
    asked_until = until
    until = until or datetime.now(timezone.utc)
    engine = create_engine(settings, pool_size=1)
    try:
        store = make_store(engine, event_registry(), settings.namespace)
        facts = [StoredEvent(e.position or 0, e.occurred_at, event)
                 for e, event in store.typed(await store.history(alias, until=until, types=STATE_EVENTS))]
        if not facts:
            before = f" before {until.isoformat(timespec='seconds')}" if asked_until else ""
            raise TimelineError(f"alias {alias!r} has no events{before} in namespace {settings.namespace!r}")
        since = since or facts[0].occurred_at
        if since >= until:
            raise TimelineError(f"--since {since.isoformat()} is not before --until {until.isoformat()}")
        windows, bus_problem = await read_gateway_windows(settings, alias, since, until)
        load = merged_periods(windows or [])
        # The bus keeps windows for a day: whatever it no longer holds (or never got) comes from decisions.
        covered_from = load[0].window_start if load else until
        recorded: list[MetricWindow] = []
        if covered_from > since:
            decisions = store.typed(await store.history(alias, since=since, until=covered_from,
                                                        types=(PolicyDecided.TYPE,)))
            recorded = recorded_windows([d for _, d in decisions], since, covered_from)
    finally:
        await engine.dispose()
    return fold_timeline(alias, since, until, facts, load, recorded,
                         load_note(load, recorded, bus_problem, covered_from))


def load_note(load: Sequence[MetricWindow], recorded: Sequence[MetricWindow], bus_problem: str,
              covered_from: datetime) -> str:
    """Where the load in the figure comes from, in one line."""
    sampled = f"{len(recorded)} metric windows recorded with the controller's decisions (sampled when it decided)"
    if bus_problem:
        return f"{bus_problem}: load from {sampled}"
    replicas = max((w.gateways for w in load), default=0)
    gateways = f"{len(load)} windows measured by the gateways" + (
        f" (up to {replicas} replicas merged a window)" if replicas > 1 else "")
    if not recorded:
        return f"load: {gateways}, from the bus" if load else "no load measured in this range"
    if not load:
        hours = WINDOWS_MAX_AGE_S / 3600
        return f"no gateway windows on the bus for this range (it keeps {hours:.0f} h): load from {sampled}"
    return f"load: {gateways}, from the bus; before {clock(covered_from)} UTC it holds none: {sampled}"


def clock(at: datetime, with_date: bool = False) -> str:
    """A time in UTC, as short as the figure allows: the time of day, with the date for ranges beyond a day."""
    return at.astimezone(timezone.utc).strftime("%m-%d %H:%M" if with_date else "%H:%M:%S")


def fold_timeline(alias: str, since: datetime, until: datetime, facts: Sequence[StoredEvent],
                  load: list[MetricWindow], recorded: list[MetricWindow], note: str) -> Timeline:
    """The series from the alias's state events (from the start of its log up to `until`) and its load.

    The alias's state is folded by the read models' own reducers (`ROUTING`, `INSTANCES`): the figure shows
    what the gateways and the controller saw, by construction.
    """
    routing: dict[str, RoutingRow] = {}
    instances: dict[str, InstanceRow] = {}

    def fold(stored: StoredEvent) -> None:
        ROUTING.apply(routing, stored)
        INSTANCES.apply(instances, stored)

    def row() -> RoutingRow | None:
        return routing.get(alias)

    def counts() -> dict[BackendType, dict[InstanceState, int]]:
        found: dict[BackendType, dict[InstanceState, int]] = defaultdict(lambda: defaultdict(int))
        for i in instances.values():
            found[i.backend_type][i.state] += 1
        return {b: dict(c) for b, c in found.items()}

    for stored in facts:
        if stored.occurred_at < since:
            fold(stored)
    at_since = row()
    state = at_since.state if at_since else RoutingState.COLD
    weight = at_since.mix_weight if at_since else 0.0
    targets = dict(at_since.targets) if at_since else {}
    configs = [at_since.config] if at_since and at_since.config else []
    """The configuration in force at `since`, then every one recorded in the range."""
    spans_open: list[tuple[RoutingState, datetime, Switch | None]] = [(state, since, None)]
    switches: list[Switch] = []
    mix = [StepValue(since, weight)]
    target_steps = {b: [StepValue(since, n)] for b, n in targets.items()}
    counted = [InstanceCounts(since, counts())]
    for stored in facts:
        at, event = stored.occurred_at, stored.event
        if at < since:
            continue
        fold(stored)
        match event:
            case AliasConfigured(config=config):
                configs.append(config)
            case RoutingStateChanged(to_state=to_state, reason=reason):
                switch = Switch(len(switches) + 1, at, state, to_state, reason)
                switches.append(switch)
                spans_open.append((to_state, at, switch))
            case InstanceStateChanged():
                counted.append(InstanceCounts(at, counts()))
        now = row()
        if now is None:  # nothing of the alias's own state recorded yet
            continue
        if now.mix_weight != weight:
            mix.append(StepValue(at, now.mix_weight))
        for backend in set(targets) | set(now.targets):
            if targets.get(backend) != now.targets.get(backend, 0):
                target_steps.setdefault(backend, [StepValue(since, 0)]).append(StepValue(at, now.targets.get(backend, 0)))
        state, weight, targets = now.state, now.mix_weight, dict(now.targets)
    ends = [start for _, start, _ in spans_open[1:]] + [until]
    spans = [StateSpan(s, start, end, switch) for (s, start, switch), end in zip(spans_open, ends)]
    engines: dict[BackendType, set[EngineKind]] = defaultdict(set)
    for config in configs:
        for backend in config.backends:
            engines[backend].add(config.engine_for(backend))
    return Timeline(alias=alias, since=since, until=until,
                    engines={b: tuple(sorted(k, key=lambda k: k.value)) for b, k in engines.items()},
                    spans=spans, switches=switches, mix=mix, targets=target_steps, instances=counted,
                    load=load, recorded_load=recorded, load_note=note)
