"""The hybrid fast/slow policy of seed 000: llama.cpp takes the first wave, vLLM the sustained load.

Routing state machine (§4.1), one step per tick at most:

    COLD --first demand--> FAST_ONLY --N_up windows of load--> WARMING_VLLM
      --N_ready healthy probes--> MIXED (20 -> 50 -> 80 -> 100 %) --ramp done--> VLLM_PRIMARY
      --low load for down_hold_s, vLLM idle--> FAST_ONLY --idle, min_replicas 0--> COLD
    any state --vLLM failed to start / unhealthy / warm timeout / timeouts--> DEGRADED_FAST
      --retry window, load still high--> WARMING_VLLM   (--load gone--> FAST_ONLY)

Capacities (§5.1): C_vllm from the instances' reported capacity, else
floor(T_kv / T_req); C_eff = floor(alpha C_vllm), C_up = max(1, C_eff),
C_down = max(1, floor(beta C_vllm)), C_prepare = min(prepare_conc, C_up).
The fast tier is sized by L_target = max(L_floor, ceil(max(0, inflight_total - C_eff) / C_l)),
C_eff being what the serving vLLM instances take. Surplus vLLM instances sleep by
idleness (§5.4: SLEEP_1, SLEEP_2, then drain + delete); surplus llama.cpp ones are
asked to sleep too, which the capability matrix turns into drain + delete (§3.2).

Two readings of the seed, said here once:
- "low load" for VLLM_PRIMARY -> FAST_ONLY is inflight_total < min(C_down, C_prepare):
  strictly below the warm-up trigger, or the two would chase each other;
- the MIXED ramp holds each weight mix_step_s and steps on only while vLLM
  is healthy, within e2e_sla_s and without errors in the window.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from datetime import datetime, timedelta
from typing import ClassVar

from policy.base import DELETE_AT_ONCE, RELEASE_AT_ONCE, Ladder, Pacing, Proposal, Wish
from policy.capacity import c_down, c_eff, c_prepare, c_up, c_vllm_estimate, l_target
from policy.coldstart import first_serving
from policy.load import Load, load_of
from policy.text import fmt
from shared.contracts.backends import BackendType
from shared.contracts.building import evolve
from shared.contracts.control import (
    AliasSnapshot,
    ColdStart,
    HybridState,
    InstanceView,
    MixChange,
    NextStep,
    RoutingChange,
)
from shared.contracts.policies import HybridPolicyConfig
from shared.contracts.states import InstanceState, RoutingState

FAST, SLOW = BackendType.LLAMA_CPP, BackendType.VLLM
R = RoutingState
RUNNING, ERROR = InstanceState.RUNNING, InstanceState.ERROR
DEFAULT_REQUEST_TOKENS = 4096
DEFAULTS = HybridPolicyConfig()


def hybrid_config(s: AliasSnapshot) -> HybridPolicyConfig:
    """The alias's hybrid parameters (the defaults while it runs another policy: its state is still read)."""
    policy = s.config.autoscaling_policy
    return policy if isinstance(policy, HybridPolicyConfig) else DEFAULTS


@dataclass(frozen=True, slots=True)
class Capacity:
    c_l: int
    c_vllm: int
    c_up: int
    c_down: int
    c_prepare: int
    c_vllm_source: str
    fast_reported: int | None
    slow_reported: int | None

    def describe(self) -> str:
        return (f"C_vllm {self.c_vllm} ({self.c_vllm_source}), C_up {self.c_up}, C_down {self.c_down}, "
                f"C_prepare {self.c_prepare}, C_l {self.c_l}")


def capacity_of(s: AliasSnapshot, memory: HybridState) -> Capacity:
    cfg = hybrid_config(s)
    fast_reported = max((i.capacity or 0 for i in s.of(FAST)), default=0)
    slow_reported = max((i.capacity or 0 for i in s.of(SLOW)), default=0)
    slow_cfg = s.config.backends.get(SLOW)
    return _capacity(fast_reported, slow_reported, memory.fast_capacity, memory.vllm_capacity, cfg.llama_c_l,
                     cfg.request_tokens or (slow_cfg.max_model_len if slow_cfg else None) or DEFAULT_REQUEST_TOKENS,
                     cfg.vllm_kv_tokens, cfg.alpha, cfg.beta, cfg.prepare_conc)


@lru_cache(maxsize=1024)  # the same few capacities at every tick of every alias
def _capacity(fast_reported: int, slow_reported: int, fast_learned: int | None, slow_learned: int | None, default_c_l: int,
              t_req: int, t_kv: int, alpha: float, beta: float, prepare_conc: int) -> Capacity:
    c_l = fast_reported or fast_learned or default_c_l
    if slow_reported:
        c_vllm, source = slow_reported, "reported"
    elif slow_learned:
        c_vllm, source = slow_learned, "last reported"
    else:
        c_vllm, source = c_vllm_estimate(t_kv, t_req), f"T_kv {t_kv} / T_req {t_req}"
    up = c_up(alpha, c_vllm)
    return Capacity(c_l=c_l, c_vllm=c_vllm, c_up=up, c_down=c_down(beta, c_vllm), c_prepare=c_prepare(prepare_conc, up),
                    c_vllm_source=source, fast_reported=fast_reported or None, slow_reported=slow_reported or None)


_ladder = lru_cache(maxsize=64)(Ladder)
"""The slow tier's ladder: the same few at every tick of every alias."""


@lru_cache(maxsize=64)
def _fast_pacing(up_cooldown_s: float, down_cooldown_s: float, down_windows: int) -> Pacing:
    """§5.4: the fast tier shrinks after `down_windows` windows, one replica per cycle and per cooldown."""
    return Pacing(up_cooldown_s, down_cooldown_s, down_windows, down_step=1)


@lru_cache(maxsize=64)
def _slow_pacing(up_cooldown_s: float) -> Pacing:
    """The slow tier shrinks by its ladder (sleep, then delete, by idleness)."""
    return Pacing(up_cooldown_s, by_ladder=True)


def _seconds(delta: timedelta) -> float:
    return delta.total_seconds()


@dataclass(slots=True)
class _Tick:
    """What every state's handler reads: the snapshot and what this tick made of it."""

    s: AliasSnapshot
    now: datetime
    load: Load
    cap: Capacity
    counted: bool
    """A new window (or no windows at all): counters and probes count this tick."""
    ready: list[InstanceView]
    """vLLM instances running and healthy."""


@dataclass(slots=True)
class _Step:
    """What one state's handler decides: where to go (if anywhere), and the memory after."""

    memory: HybridState
    to: RoutingState | None = None
    reason: str = ""
    mix: MixChange | None = None
    outlook: tuple[NextStep, ...] = ()


class HybridPolicy:
    name = "hybrid"
    version = 5
    """2: requests waiting in the gateways for a slot count as load (inflight_total, the fast warm-up signal).
    3: the vLLM tier keeps an instance until the load falls below C_down per instance (§5.1's hysteresis).
    4: a drained instance of an alias whose router binds sessions is deleted after `drain_handoff_s` (reconcile).
    5: requests held for an instance to start keep at least one llama.cpp replica, whatever the floor (with
    `llama_floor_replicas: 0` a held request waited out its hold for an instance nobody started)."""

    def propose(self, s: AliasSnapshot, now: datetime, new_window: bool) -> Proposal:
        cfg = hybrid_config(s)
        load = load_of(s)
        memory = s.state.policy if isinstance(s.state.policy, HybridState) else HybridState()  # the alias changed policy
        cap = capacity_of(s, memory)
        up = True in self._up_signals(load, cap, cfg)
        counted = new_window or s.metrics is None  # probes and windows count once per window
        slow_serving = s.routing_state in (R.MIXED, R.VLLM_PRIMARY)
        up_windows = (memory.up_windows + 1 if up else 0) if new_window else memory.up_windows
        timeout_windows = (memory.timeout_windows + 1 if slow_serving and load.slow_failures else 0) \
            if new_window else memory.timeout_windows
        idle_since = None if load.busy else (memory.idle_since or now)
        fast_capacity = cap.fast_reported or memory.fast_capacity
        vllm_capacity = cap.slow_reported or memory.vllm_capacity
        if (up_windows, timeout_windows, idle_since, fast_capacity, vllm_capacity) != (
                memory.up_windows, memory.timeout_windows, memory.idle_since, memory.fast_capacity, memory.vllm_capacity):
            memory = evolve(memory, up_windows=up_windows, timeout_windows=timeout_windows, idle_since=idle_since,
                            fast_capacity=fast_capacity, vllm_capacity=vllm_capacity)
        tick = _Tick(s, now, load, cap, counted, self._ready(s))
        step = self._handlers[s.routing_state](self, tick, memory)
        state = step.to or s.routing_state
        memory = step.memory
        routing = RoutingChange(s.routing_state, step.to, step.reason) if step.to else None
        cold_start, memory = self._cold_start(s, state, memory)
        if step.mix:
            weight = step.mix.to_weight
        elif state is R.MIXED:
            weight = s.mix_weight if s.routing_state is R.MIXED else cfg.mix_weights[0] / 100
        else:
            weight = 1.0 if state is R.VLLM_PRIMARY else 0.0
        return Proposal(
            wishes=self._wishes(tick, state, memory, weight),
            memory=memory,
            mix_weight=weight,
            routing=routing,
            mix=step.mix,
            outlook=step.outlook,
            cold_start=cold_start,
        )

    # ------------------------------------------------------------------ signals

    @staticmethod
    def _up_signals(load: Load, cap: Capacity, cfg: HybridPolicyConfig) -> tuple[bool, bool, bool, bool]:
        """§4.1 item 2 and the §5.2 early trigger: which of them this window shows (worded by `_up_reasons`
        only when a decision tells them)."""
        return (load.fast_demand >= cap.c_up, load.total >= cap.c_prepare,
                load.queue_wait_p95 is not None and load.queue_wait_p95 > cfg.queue_sla_s,
                load.e2e_p95_fast is not None and load.e2e_p95_fast > cfg.e2e_sla_s)

    @classmethod
    def _up_reasons(cls, load: Load, cap: Capacity, cfg: HybridPolicyConfig) -> list[str]:
        fast, total, queue, e2e = cls._up_signals(load, cap, cfg)
        reasons = []
        if fast:
            queued = f" + {fmt(load.queued)} waiting" if load.queued else ""
            reasons.append(f"inflight_fast {fmt(load.inflight_fast)}{queued} >= C_up {cap.c_up}")
        if total:
            reasons.append(f"inflight_total {fmt(load.total)} >= C_prepare {cap.c_prepare}")
        if queue:
            reasons.append(f"queue_wait_p95 {fmt(load.queue_wait_p95)} s > {fmt(cfg.queue_sla_s)} s")
        if e2e:
            reasons.append(f"e2e_p95_fast {fmt(load.e2e_p95_fast)} s > {fmt(cfg.e2e_sla_s)} s")
        return reasons

    @staticmethod
    def _hybrid(s: AliasSnapshot) -> bool:
        return hybrid_config(s).enable and FAST in s.config.backends and SLOW in s.config.backends

    @staticmethod
    def _slow_failure(s: AliasSnapshot, since: datetime | None) -> str | None:
        """A vLLM start that failed, or a vLLM instance in ERROR, since `since`."""
        failure = s.start_failures.get(SLOW)
        if failure and (since is None or failure.at >= since):
            return f"vLLM start of {failure.instance_id} failed: {failure.reason}"
        broken = [i for i in s.of(SLOW) if i.state is ERROR and (since is None or i.state_since >= since)]
        if broken:
            return f"vLLM instance {broken[0].instance_id} failed"
        return None

    @staticmethod
    def _ready(s: AliasSnapshot) -> list[InstanceView]:
        return [i for i in s.of(SLOW) if i.state is RUNNING and i.healthy]

    # ------------------------------------------------------------------ states

    def _cold(self, t: _Tick, memory: HybridState) -> _Step:
        s, load, now = t.s, t.load, t.now
        standing = sum(b.min_replicas for b in s.config.backends.values())
        if not (load.busy or standing):
            return _Step(memory, outlook=(NextStep("leaves COLD on the first request"),))
        why = f"{load.waiting} request(s) waiting" if load.waiting else (
            f"{load.arrivals} request(s) arrived" if load.arrivals else f"min_replicas asks for {standing}")
        memory = evolve(memory, demand_at=now if load.busy else None, low_load_since=None)
        if FAST in s.config.backends:
            return _Step(memory, R.FAST_ONLY, f"first demand ({why}): llama.cpp takes it")
        return _Step(memory, R.VLLM_PRIMARY, f"first demand ({why}): vLLM takes it (no fast tier)")

    def _fast_only(self, t: _Tick, memory: HybridState) -> _Step:
        s, now, cap = t.s, t.now, t.cap
        cfg = hybrid_config(s)
        if self._hybrid(s) and memory.up_windows >= cfg.up_consecutive:
            return _Step(evolve(memory, warming_since=now, ready_probes=0), R.WARMING_VLLM,
                         f"{memory.up_windows} consecutive windows with {'; '.join(self._up_reasons(t.load, cap, cfg))} "
                         f"({cap.describe()})")
        outlook: list[NextStep] = []
        if self._hybrid(s) and memory.up_windows:
            outlook.append(NextStep(f"WARMING_VLLM after {cfg.up_consecutive - memory.up_windows} more "
                                    f"window(s) with {'; '.join(self._up_reasons(t.load, cap, cfg)) or 'load'}"))
        if memory.idle_since is not None and all(b.min_replicas == 0 for b in s.config.backends.values()):
            cold_at = memory.idle_since + timedelta(seconds=cfg.cold_idle_s)
            if now >= cold_at:
                return _Step(evolve(memory, up_windows=0), R.COLD,
                             f"no request for {fmt(_seconds(now - memory.idle_since))} s and min_replicas 0")
            outlook.append(NextStep("COLD if no request comes", cold_at))
        return _Step(memory, outlook=tuple(outlook))

    def _warming(self, t: _Tick, memory: HybridState) -> _Step:
        s, now = t.s, t.now
        cfg = hybrid_config(s)
        since = memory.warming_since or s.routing_since or now
        failed = self._slow_failure(s, since)
        if failed:
            return self._degrade(memory, now, failed)
        timeout_at = since + timedelta(seconds=cfg.vllm_warm_timeout_s)
        ready = t.ready
        probes = (memory.ready_probes + 1 if ready else 0) if t.counted else memory.ready_probes
        if (probes, since) != (memory.ready_probes, memory.warming_since):
            memory = evolve(memory, ready_probes=probes, warming_since=since)
        if probes >= cfg.ready_probes:
            return _Step(evolve(memory, mix_step_since=now), R.MIXED,
                         f"vLLM {ready[0].instance_id} healthy in {probes} consecutive probes; "
                         f"{cfg.mix_weights[0]} % of traffic to vLLM")
        if now > timeout_at:
            return self._degrade(memory, now, f"vLLM not ready after {fmt(cfg.vllm_warm_timeout_s)} s "
                                              f"(HYBRID_VLLM_WARM_TIMEOUT_S)")
        return _Step(memory, outlook=(
            NextStep(f"MIXED after {cfg.ready_probes - probes} more healthy probe(s) of vLLM"),
            NextStep("DEGRADED_FAST if vLLM is not ready", timeout_at),
        ))

    def _mixed(self, t: _Tick, memory: HybridState) -> _Step:
        s, now, load = t.s, t.now, t.load
        cfg = hybrid_config(s)
        trouble = self._serving_trouble(t, memory)
        if trouble:
            return self._degrade(memory, now, trouble)
        weight = s.mix_weight
        step_since = memory.mix_step_since or s.routing_since or now
        next_at = step_since + timedelta(seconds=cfg.mix_step_s)
        held = self._sla_breach(load, cfg)
        upcoming = [w / 100 for w in cfg.mix_weights if w / 100 > weight + 1e-9]
        if now < next_at or held:
            what = f"{int(upcoming[0] * 100)} % to vLLM" if upcoming else "VLLM_PRIMARY"
            note = f"{what} if vLLM stays healthy and within SLA" if not held else f"{what} held: {held}"
            if memory.mix_step_since != step_since:
                memory = evolve(memory, mix_step_since=step_since)
            return _Step(memory, outlook=(NextStep(note, max(now, next_at)),))
        ready = f"vLLM healthy, e2e_p95 {fmt(load.e2e_p95_slow)} s <= {fmt(cfg.e2e_sla_s)} s"
        if upcoming:
            change = MixChange(weight, upcoming[0], f"held {int(round(weight * 100))} % for "
                                                    f"{fmt(_seconds(now - step_since))} s, {ready}")
            return _Step(evolve(memory, mix_step_since=now), mix=change)
        return _Step(evolve(memory, mix_step_since=None, low_load_since=None), R.VLLM_PRIMARY,
                     f"ramp complete at 100 % and held {fmt(_seconds(now - step_since))} s, {ready}")

    def _vllm_primary(self, t: _Tick, memory: HybridState) -> _Step:
        s, now, load, cap = t.s, t.now, t.load, t.cap
        cfg = hybrid_config(s)
        hybrid = self._hybrid(s)
        if hybrid:
            trouble = self._serving_trouble(t, memory)
            if trouble:
                return self._degrade(memory, now, trouble)
        threshold = min(cap.c_down, cap.c_prepare)
        low = load.measured and load.total < threshold and load.waiting == 0
        low_since = (memory.low_load_since or now) if low else None
        if low_since != memory.low_load_since:
            memory = evolve(memory, low_load_since=low_since)
        if not hybrid and not s.of(SLOW) and not load.busy:
            return _Step(evolve(memory, low_load_since=None), R.COLD, "no vLLM instance left and no request (no fast tier)")
        if low_since is None:
            return _Step(memory, outlook=(NextStep(f"FAST_ONLY after {fmt(cfg.down_hold_s)} s "
                                                   f"of inflight_total < {threshold}"),))
        down_at = low_since + timedelta(seconds=cfg.down_hold_s)
        if hybrid and now >= down_at and load.inflight_slow == 0:
            return _Step(evolve(memory, low_load_since=None), R.FAST_ONLY,
                         f"inflight_total {fmt(load.total)} < {threshold} (min(C_down, C_prepare)) for "
                         f"{fmt(_seconds(now - low_since))} s and vLLM idle")
        what = "FAST_ONLY if load stays low and vLLM is idle" if hybrid else "vLLM idle: may sleep"
        return _Step(memory, outlook=(NextStep(what, down_at),))

    def _degraded(self, t: _Tick, memory: HybridState) -> _Step:
        s, now = t.s, t.now
        cfg = hybrid_config(s)
        since = memory.degraded_at or s.routing_since or now
        retry_at = since + timedelta(seconds=cfg.retry_s)
        if memory.degraded_at != since:
            memory = evolve(memory, degraded_at=since)
        if now < retry_at:
            return _Step(memory, outlook=(NextStep("retry vLLM (WARMING_VLLM) if load still calls for it", retry_at),))
        if memory.up_windows >= cfg.up_consecutive:
            return _Step(evolve(memory, degraded_at=None, degraded_reason="", warming_since=now, ready_probes=0),
                         R.WARMING_VLLM, f"retry window of {fmt(cfg.retry_s)} s reached and load still calls "
                                         f"for vLLM: {'; '.join(self._up_reasons(t.load, t.cap, cfg))}")
        return _Step(evolve(memory, degraded_at=None, degraded_reason=""), R.FAST_ONLY,
                     f"retry window of {fmt(cfg.retry_s)} s reached; load no longer calls for vLLM")

    # ------------------------------------------------------------------ shared pieces

    def _serving_trouble(self, t: _Tick, memory: HybridState) -> str | None:
        s = t.s
        if not t.ready:
            failed = self._slow_failure(s, None)
            return f"vLLM unhealthy: no healthy running instance ({failed or 'none reporting'})"
        if memory.timeout_windows >= hybrid_config(s).timeout_windows:
            return f"vLLM errors or timeouts in {memory.timeout_windows} consecutive windows"
        return None

    @staticmethod
    def _sla_breach(load: Load, cfg: HybridPolicyConfig) -> str | None:
        if load.slow_failures:
            return f"{load.slow_failures} vLLM error(s) in the window"
        if load.e2e_p95_slow is not None and load.e2e_p95_slow > cfg.e2e_sla_s:
            return f"vLLM e2e_p95 {fmt(load.e2e_p95_slow)} s > {fmt(cfg.e2e_sla_s)} s"
        return None

    @staticmethod
    def _degrade(memory: HybridState, now: datetime, reason: str) -> _Step:
        memory = evolve(memory, degraded_at=now, degraded_reason=reason, warming_since=None, ready_probes=0,
                         mix_step_since=None, low_load_since=None, timeout_windows=0)
        return _Step(memory, R.DEGRADED_FAST, reason)

    @staticmethod
    def _cold_start(s: AliasSnapshot, state: RoutingState, memory: HybridState) -> tuple[ColdStart | None, HybridState]:
        if memory.demand_at is None:
            return None, memory
        if state is R.COLD:
            return None, evolve(memory, demand_at=None)
        done = first_serving(s, memory.demand_at)
        return (done, evolve(memory, demand_at=None)) if done else (None, memory)

    # ------------------------------------------------------------------ wishes

    def _wishes(self, t: _Tick, state: RoutingState, memory: HybridState, weight: float) -> dict[BackendType, Wish]:
        s, load, cap, now = t.s, t.load, t.cap, t.now
        cfg = hybrid_config(s)
        wishes: dict[BackendType, Wish] = {}
        slow_ladder = _ladder(cfg.vllm_sleep_l1_idle_s, cfg.vllm_sleep_l2_idle_s, cfg.vllm_delete_idle_s)
        slow = _slow_pacing(cfg.scale_up_cooldown_s)
        fast_cfg = s.config.backends.get(FAST)
        if fast_cfg is not None:
            if state is R.COLD:
                wishes[FAST] = Wish(0, "COLD: no instance kept", RELEASE_AT_ONCE, _fast_pacing(
                    cfg.scale_up_cooldown_s, cfg.llama_scale_down_cooldown_s, cfg.scale_down_consecutive))
            else:
                floor = max(cfg.llama_floor_replicas, fast_cfg.min_replicas, 1 if load.waiting else 0)
                serving = t.ready if state in (R.MIXED, R.VLLM_PRIMARY) else []
                # What vLLM takes: its effective capacity, but never more than its share of the traffic.
                taken = min(sum(c_eff(cfg.alpha, i.capacity or cap.c_vllm) for i in serving), weight * load.total)
                n = l_target(floor, load.total, taken, cap.c_l)
                reason = f"L_target = max({floor}, ceil(max(0, {fmt(load.total)} - C_eff {fmt(taken)}) / C_l {cap.c_l})) = {n}"
                if state in (R.WARMING_VLLM, R.MIXED):
                    # §5.3: the buffer is reclaimed once vLLM is primary, not while traffic is still moving.
                    awake = sum(1 for i in s.of(FAST) if i.state in (InstanceState.RUNNING, InstanceState.STARTING))
                    if awake > n:
                        n, reason = awake, f"{reason}; the {awake} replicas are kept until VLLM_PRIMARY (§5.3)"
                wishes[FAST] = Wish(n, reason, RELEASE_AT_ONCE, _fast_pacing(
                    cfg.scale_up_cooldown_s, cfg.llama_scale_down_cooldown_s, cfg.scale_down_consecutive))
        if SLOW in s.config.backends:
            total = round(load.total, 3)
            up = max(1, math.ceil(total / cap.c_up))
            # §5.1's hysteresis: a vLLM instance is added when the load passes C_up per instance and
            # kept until it falls below C_down per instance, so load near a boundary does not start
            # and cancel instances in turn.
            awake = sum(1 for i in s.of(SLOW) if i.state in (InstanceState.RUNNING, InstanceState.STARTING))
            keep = min(awake, max(1, math.ceil(total / cap.c_down)))
            needed = max(up, keep)
            sizing = f"ceil({fmt(load.total)} / C_up {cap.c_up}) = {up}, at least 1"
            if keep > up:
                sizing += f"; {keep} kept while ceil({fmt(load.total)} / C_down {cap.c_down}) >= {keep}"
            if state in (R.WARMING_VLLM, R.MIXED) or (state is R.VLLM_PRIMARY and self._hybrid(s)):
                wishes[SLOW] = Wish(needed, f"{state.value}: {sizing}", slow_ladder, slow)
            elif state is R.VLLM_PRIMARY:  # no fast tier: vLLM serves alone, and may rest when idle for long
                parked = memory.low_load_since is not None and \
                    now >= memory.low_load_since + timedelta(seconds=cfg.down_hold_s)
                wishes[SLOW] = Wish(0, "vLLM idle past HYBRID_DOWN_HOLD_S", slow_ladder, slow) if parked else \
                    Wish(needed, f"serves alone: {sizing}", slow_ladder, slow)
            elif state is R.DEGRADED_FAST:
                wishes[SLOW] = Wish(0, f"DEGRADED_FAST: {memory.degraded_reason}", DELETE_AT_ONCE, slow, urgent=True)
            else:
                wishes[SLOW] = Wish(0, f"{state.value}: vLLM not routed; idle instances sleep, then go", slow_ladder, slow)
        return wishes

    _handlers: ClassVar[dict[RoutingState, Callable[["HybridPolicy", _Tick, HybridState], _Step]]] = {
        R.COLD: _cold, R.FAST_ONLY: _fast_only, R.WARMING_VLLM: _warming, R.MIXED: _mixed,
        R.VLLM_PRIMARY: _vllm_primary, R.DEGRADED_FAST: _degraded,
    }
