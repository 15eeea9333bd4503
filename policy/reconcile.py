"""From planned targets to instance commands, in the order of seed 000 §12.3.

Per tier, against its census (observed plus in flight):
- below target: wake sleeping instances first (level 1 before level 2, the most
  recently busy first), then start new ones, unless a start of the tier failed
  less than the controller's start_retry_s ago;
- above target: let surplus instances go, as many as the plan allows: a start
  still under way is cancelled first, then the least loaded, longest idle ones,
  each taking the next step of the tier's ladder once idle long enough;
- asleep instances walk on down the ladder (level 2, then drain + delete);
- standby (a backend's `standby_replicas`): the tier keeps that many instances,
  awake or asleep, whatever the target; it starts them when it has fewer, and
  the ones kept (the readiest: running, then asleep at level 1, at level 2, then
  starting) take the ladder's sleeps down to `standby_sleep_level` and no
  further, never a cancel, a drain or a delete for idleness;
- an instance in ERROR is deleted; a drained one is deleted (where the alias's
  router binds sessions, once they have had `drain_handoff_s` to move to the
  hosts that serve them next); one STARTING for longer than its backend's start
  budget is deleted (and so replaced).

A step the backend cannot take becomes its substitute from the capability
matrix (a llama.cpp sleep: drain, then delete once drained), and so does one
its worker answered `unsupported`; the action records what it stands for.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from policy.base import Ladder
from policy.census import TierCensus
from policy.ids import command_id, new_instance_id
from policy.rules import TierPlan
from shared.contracts.backends import Action, BackendType, Role, supports
from shared.contracts.control import (
    AliasSnapshot,
    InstanceView,
    NextStep,
    PlannedAction,
)
from shared.contracts.states import InstanceState

ORDER = {Action.START: 0, Action.WAKE: 1, Action.SLEEP: 2, Action.DRAIN: 3, Action.DELETE: 4}
S = InstanceState
RELEASE_SUBSTITUTE = (Action.DRAIN, Action.DELETE)


@dataclass(slots=True)
class InstanceStep:
    action: Action
    level: int
    reason: str


def _idle_s(i: InstanceView, now: datetime) -> float:
    return 0.0 if i.inflight else max(0.0, (now - i.idle_since()).total_seconds())


def ladder_step(i: InstanceView, ladder: Ladder, now: datetime) -> InstanceStep | None:
    """The next step down `ladder` this instance has earned by its idleness, if any."""
    idle = _idle_s(i, now)
    level = i.sleep_level if i.state in (S.SLEEP_1, S.SLEEP_2) else 0
    can_sleep = supports(i.backend, Action.SLEEP) and Action.SLEEP not in i.unsupported
    if ladder.delete_after_s is not None and idle >= ladder.delete_after_s:
        return InstanceStep(Action.DRAIN, 0, f"idle {idle:.0f} s >= {ladder.delete_after_s:g} s: drain, then delete")
    # One rung at a time (§5.4): RUNNING -> SLEEP_1 -> SLEEP_2; a level is never skipped.
    wanted, after = (1, ladder.sleep_1_after_s) if level == 0 else (2, ladder.sleep_2_after_s if level == 1 else None)
    if after is None or idle < after:
        return None
    if can_sleep and i.inflight:
        return None  # a real sleep waits for the last request; the substitute (a drain) does not
    return InstanceStep(Action.SLEEP, wanted, f"idle {idle:.0f} s >= {after:g} s: sleep level {wanted}")


def standby_ladder(ladder: Ladder, level: int) -> Ladder | None:
    """The ladder of an instance kept for standby: `ladder`'s sleeps down to `level`, never a delete. None when
    `ladder` does not sleep: the policy lets the tier's surplus go outright (a failed tier), and keeps none."""
    if ladder.sleep_1_after_s is None:
        return None
    if level == 1:
        return Ladder(sleep_1_after_s=ladder.sleep_1_after_s)
    deeper = ladder.sleep_2_after_s if ladder.sleep_2_after_s is not None else ladder.sleep_1_after_s
    return Ladder(sleep_1_after_s=ladder.sleep_1_after_s, sleep_2_after_s=deeper)


STANDBY_RANK = {S.RUNNING: 0, S.SLEEP_1: 1, S.SLEEP_2: 2, S.STARTING: 3}
"""Which instances a tier keeps for standby first: the ones serving soonest."""


def standby_kept(kept: Iterable[InstanceView], n: int) -> tuple[InstanceView, ...]:
    """The `n` instances a tier keeps for standby: the readiest, the most recently busy first among equals."""
    return tuple(sorted(kept, key=lambda i: (STANDBY_RANK[i.state], -i.idle_since().timestamp(), i.instance_id))[:n])


def next_ladder_time(i: InstanceView, ladder: Ladder) -> NextStep | None:
    level = i.sleep_level if i.state in (S.SLEEP_1, S.SLEEP_2) else 0
    if level < 1 and ladder.sleep_1_after_s is not None:
        what, after = "SLEEP_1 of", ladder.sleep_1_after_s
    elif level < 2 and ladder.sleep_2_after_s is not None:
        what, after = "SLEEP_2 of", ladder.sleep_2_after_s
    elif ladder.delete_after_s is not None:
        what, after = "drain and delete", ladder.delete_after_s
    else:
        return None
    return NextStep(f"{what} {i.instance_id} if still idle", i.idle_since() + timedelta(seconds=after))


class Reconciler:
    def __init__(self, s: AliasSnapshot, decision: uuid.UUID, now: datetime) -> None:
        self.s = s
        self.decision = decision
        self.now = now
        self.actions: list[PlannedAction] = []
        self.outlook: list[NextStep] = []
        self.scaled_up: set[BackendType] = set()
        self.released: set[BackendType] = set()
        """Tiers that started or woke instances, and tiers that let awake ones go, in this decision."""
        self._started: dict[BackendType, int] = {}
        """New instances of each tier named so far in this decision (their ids count on)."""
        self._standby: dict[str, Ladder] = {}
        """Instances kept for standby, with the ladder they take instead of their tier's."""

    def run(self, plans: dict[BackendType, TierPlan], censuses: dict[BackendType, TierCensus]) -> tuple[PlannedAction, ...]:
        for backend, plan in plans.items():
            c = censuses[backend]
            kept_ladder = self._keep_standby(backend, plan, c)
            if plan.roles is not None:
                self._by_role(backend, plan, c)
            elif plan.target > c.supply:
                self._scale_up(backend, plan, c.asleep, plan.target - c.supply)
            else:
                if plan.target < c.supply and plan.release:
                    self._release(plan, c.awake, min(plan.release, c.supply - plan.target))
                if not plan.halted:
                    self._walk_asleep(plan, c)
            if kept_ladder is not None:
                self._provision_standby(backend, c)
            self._clean_up(backend, c)
        return tuple(sorted(self.actions, key=lambda a: (ORDER[a.action], a.backend.value, a.instance_id)))

    def _by_role(self, backend: BackendType, plan: TierPlan, c: TierCensus) -> None:
        """A disaggregated tier: each role is brought to its own target; instances without a role are surplus."""
        roles = plan.roles or {}
        budget = min(plan.release, max(0, c.supply - plan.target)) if plan.release else 0
        unroled = [i for i in c.awake if i.role is None or i.role not in roles]
        if unroled and budget:
            budget -= self._release(plan, unroled, min(budget, len(unroled)))
        for role, wanted in roles.items():
            have = c.by_role.get(role, 0)
            if wanted > have:
                self._scale_up(backend, plan, tuple(i for i in c.asleep if i.role is role), wanted - have, role)
            elif wanted < have and budget:
                budget -= self._release(plan, [i for i in c.awake if i.role is role], min(budget, have - wanted))
        if not plan.halted:
            self._walk_asleep(plan, c)

    # ------------------------------------------------------------------ steps

    def _scale_up(self, backend: BackendType, plan: TierPlan, asleep: tuple[InstanceView, ...], need: int,
                  role: Role | None = None) -> None:
        sleepers = sorted(asleep, key=lambda i: (i.sleep_level, -i.idle_since().timestamp(), i.instance_id))
        what = f"{role.value} " if role else ""
        for i in sleepers:
            if need == 0:
                break
            if self._recently_failed(i, Action.WAKE) or Action.WAKE in i.unsupported:
                continue
            self._emit(i, Action.WAKE, 0, f"scale {what}up to {plan.target}: wake it (sleep level {i.sleep_level}) "
                                          f"before starting a new one; {plan.reason}")
            self.scaled_up.add(backend)
            need -= 1
        if need:
            self._start(backend, need, f"scale {what}up to {plan.roles[role] if role and plan.roles else plan.target}: "
                                       f"{plan.reason}", role)

    def _start(self, backend: BackendType, need: int, reason: str, role: Role | None = None) -> None:
        """Start `need` new instances, unless a start of the tier failed less than `start_retry_s` ago."""
        failure = self.s.start_failures.get(backend)
        retry_at = failure.at + timedelta(seconds=self.s.controller.start_retry_s) if failure else None
        if retry_at is not None and self.now < retry_at:
            what = f"{role.value} " if role else ""
            self.outlook.append(NextStep(f"start {need} {what}{backend.value} instance(s) (last start failed: "
                                         f"{failure.reason})", retry_at))
            return
        version = self.s.version + 1  # the version the decision is recorded at
        self.scaled_up.add(backend)
        for _ in range(need):
            instance_id = new_instance_id(self.s.alias, backend, version, self._started.get(backend, 0), role)
            self._started[backend] = self._started.get(backend, 0) + 1
            self.actions.append(PlannedAction(
                action=Action.START, backend=backend, instance_id=instance_id,
                command_id=command_id(self.decision, Action.START, instance_id), reason=reason, role=role,
            ))

    def _keep_standby(self, backend: BackendType, plan: TierPlan, c: TierCensus) -> Ladder | None:
        """Mark the instances the tier keeps for standby; their ladder, or None when the tier keeps none."""
        bounds = self.s.config.backends[backend]
        ladder = standby_ladder(plan.ladder, bounds.standby_sleep_level) if bounds.standby_replicas else None
        if ladder is not None:
            for i in standby_kept(c.kept, bounds.standby_replicas):
                self._standby[i.instance_id] = ladder
        return ladder

    def _provision_standby(self, backend: BackendType, c: TierCensus) -> None:
        """Start what the tier lacks of its standby, counting what this decision started already."""
        n = self.s.config.backends[backend].standby_replicas
        missing = n - len(c.kept) - c.unseen_starts - self._started.get(backend, 0)
        if missing > 0:
            self._start(backend, missing, f"standby: {n} {backend.value} instance(s) kept, awake or asleep "
                                          f"(standby_replicas), {n - missing} provisioned")

    def _release(self, plan: TierPlan, awake: Iterable[InstanceView], budget: int) -> int:
        """Let up to `budget` of `awake` go (starting ones first, then the least loaded, longest idle); how many went."""
        awake = list(awake)
        starting = sorted((i for i in awake if i.state is S.STARTING), key=lambda i: (i.state_since, i.instance_id),
                          reverse=True)
        running = sorted((i for i in awake if i.state is S.RUNNING),
                         key=lambda i: (i.inflight, i.idle_since(), i.instance_id))
        sent = 0
        for i in starting:
            if sent == budget:
                return sent
            if i.instance_id in self._standby:
                continue  # kept for standby: it will sleep once up
            self._emit(i, Action.DELETE, 0, f"surplus while still starting: cancel the start; {plan.reason}")
            self.released.add(i.backend)
            sent += 1
        for i in running:
            if sent == budget:
                return sent
            if self._step_down(i, plan):
                self.released.add(i.backend)
                sent += 1
        return sent

    def _walk_asleep(self, plan: TierPlan, c: TierCensus) -> None:
        for i in c.asleep:
            self._step_down(i, plan)

    def _step_down(self, i: InstanceView, plan: TierPlan) -> bool:
        """Send the next step of the ladder if `i` has earned it (else note when it will); True if sent."""
        ladder = self._standby.get(i.instance_id, plan.ladder)
        step = ladder_step(i, ladder, self.now)
        if step is None:
            upcoming = next_ladder_time(i, ladder)
            if upcoming:
                self.outlook.append(upcoming)
            return False
        return self._command(i, step, plan.reason)

    def _clean_up(self, backend: BackendType, c: TierCensus) -> None:
        """Delete what failed, what is drained, and what has been starting for longer than its backend's budget."""
        start_timeout_s = self.s.controller.start_timeout_s(backend)
        sent = {a.instance_id for a in self.actions}
        for i in self.s.of(backend):
            if i.instance_id in c.busy or i.instance_id in sent or self._recently_failed(i, Action.DELETE):
                continue
            if i.state is S.ERROR:
                self._emit(i, Action.DELETE, 0, "failed: release its resources")
            elif i.state is S.DRAINING:
                handoff_ends = self._handoff_ends(i)
                if handoff_ends is not None and self.now < handoff_ends:
                    self.outlook.append(NextStep(f"delete {i.instance_id} once its sessions are handed over",
                                                 handoff_ends))
                    continue
                self._emit(i, Action.DELETE, 0, "drained (or drain timed out): delete")
            elif i.state is S.STARTING and (starting_s := (self.now - i.state_since).total_seconds()) > start_timeout_s:
                # Its worker never said how the start went (it lost the engine's answer, or the log was
                # away when it tried): STARTING counts as supply, so without this nothing would replace it.
                self._emit(i, Action.DELETE, 0, f"starting for {starting_s:.0f} s, past the start budget of "
                                                f"{start_timeout_s:g} s: cancel it (a replacement follows)")

    def _handoff_ends(self, i: InstanceView) -> datetime | None:
        """When a drained instance's sessions have had their time to move to other hosts, KV first (the gateways
        do it, `services/gateway/handoff.py`); None when there is nothing to hand over: the alias's router binds
        no sessions, or the instance drained from sleep (its KV is gone already)."""
        router = self.s.config.router
        if not router.binds_sessions or not router.drain_handoff_s or i.sleep_level:
            return None
        return i.state_since + timedelta(seconds=router.drain_handoff_s)

    # ------------------------------------------------------------------ commands

    def _command(self, i: InstanceView, step: InstanceStep, plan_reason: str) -> bool:
        """Emit `step` for `i`, or its substitute when `i` cannot take it. False when nothing can be sent."""
        action, reason = step.action, f"{step.reason}; {plan_reason}"
        substitute_for = None
        if action is Action.SLEEP and not supports(i.backend, Action.SLEEP):
            substitute_for, reason = action, f"{i.backend.value} has no sleep: drain + delete instead ({reason})"
        elif action in i.unsupported:
            substitute_for, reason = action, f"worker answered unsupported for {action.value}: drain + delete instead ({reason})"
        if substitute_for is not None:
            action = RELEASE_SUBSTITUTE[0]
        if self._recently_failed(i, action):
            return False
        self._emit(i, action, step.level if action is Action.SLEEP else 0, reason, substitute_for)
        return True

    def _recently_failed(self, i: InstanceView, action: Action) -> bool:
        if i.last_failure is None:
            return False
        failed, at = i.last_failure
        return failed is action and self.now < at + timedelta(seconds=self.s.controller.command_retry_s)

    def _emit(self, i: InstanceView, action: Action, level: int, reason: str, substitute_for: Action | None = None) -> None:
        self.actions.append(PlannedAction(
            action=action, backend=i.backend, instance_id=i.instance_id,
            command_id=command_id(self.decision, action, i.instance_id), reason=reason,
            worker_id=i.worker_id, level=level, substitute_for=substitute_for,
        ))
