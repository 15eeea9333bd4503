"""Operators' actions (the console, the admin API): recorded in the log with who and why, then carried out.

Every action is an `OperatorCommanded` on the alias's stream, so the alias's
timeline shows it and a decision the controller had in hand at that version is
refused and made again with it. An instance action (drain, sleep, wake, delete)
is a command for the instance's worker, recorded with its id and the worker: the
gateway may not publish commands (docs/security.md), so the autoscaler sends it,
as it sends its own, the event its cause, and the worker records the change with
the operator's reason. The admin API answers with what was recorded: the command
is on its way. A pause or a pin is read by the controller from the log at its
next tick (`policy/operator.py` says what it does to a decision).
"""

from __future__ import annotations

import uuid
from typing import Any

from services.runtime import ServiceContext
from shared.contracts.backends import BackendType, supports
from shared.contracts.effects import effect_of
from shared.contracts.events import INSTANCE_ACTIONS, OperatorAction, OperatorCommanded, operator_event_id
from shared.contracts.messages import Envelope
from shared.contracts.states import IllegalTransition
from shared.openai_protocol import APIError, bad_request
from shared.projections.live import LiveView
from shared.projections.readmodels import INSTANCES, ROUTING


def _who_and_why(body: dict[str, Any]) -> tuple[str, str]:
    operator, reason = (str(body.get(k) or "").strip() for k in ("operator", "reason"))
    if not operator:
        raise bad_request("say who asks: `operator` is required", param="operator")
    if not reason:
        raise bad_request("say why: `reason` is required (it is recorded with the action)", param="reason")
    if len(operator) > 100 or len(reason) > 500:
        raise bad_request("`operator` is at most 100 characters, `reason` at most 500", param="reason")
    return operator, reason


async def _record(ctx: ServiceContext, event: OperatorCommanded) -> Envelope:
    # An instance action's event has its id from its command's: the autoscaler finds it, to send the command
    # with it as its cause.
    (stored,) = await ctx.record(Envelope.wrap(event, id=operator_event_id(event.command_id) if event.command_id
                                               else None))
    return stored


async def command_instance(ctx: ServiceContext, view: LiveView, instance_id: str, action: OperatorAction,
                           body: dict[str, Any]) -> dict[str, Any]:
    """Drain, sleep, wake or delete one instance; what was recorded (the autoscaler sends the command)."""
    operator, reason = _who_and_why(body)
    row = view[INSTANCES].get(instance_id)
    if row is None:
        raise APIError(404, f"no instance {instance_id!r}", code="instance_not_found")
    worker_action = INSTANCE_ACTIONS[action]
    level = 0
    if action is OperatorAction.SLEEP:
        level = body.get("level", 1)
        if level not in (1, 2):
            raise bad_request("`level` is 1 or 2", param="level")
    if not supports(row.backend_type, worker_action):
        raise APIError(409, f"{row.backend_type.value} instances cannot {worker_action.value}",
                       code="unsupported_action")
    try:
        effect_of(worker_action, row.backend_type, row.state, level)
    except IllegalTransition as exc:
        raise APIError(409, f"instance {instance_id} is {row.state.value}: it cannot {worker_action.value} ({exc})",
                       code="illegal_transition") from None
    command_id = uuid.uuid4()
    cause = await _record(ctx, OperatorCommanded(
        alias=row.alias, action=action, operator=operator, reason=reason, instance_id=instance_id,
        backend_type=row.backend_type, level=level or None, command_id=command_id, worker_id=row.worker_id))
    return {"event_id": str(cause.id), "command_id": str(command_id), "instance_id": instance_id,
            "worker_id": row.worker_id, "action": action.value, "sent_by": "autoscaler"}


async def hold_alias(ctx: ServiceContext, view: LiveView, alias: str, action: OperatorAction,
                     body: dict[str, Any]) -> dict[str, Any]:
    """Pause or resume the controller for an alias, or pin or unpin a tier's minimum replicas."""
    operator, reason = _who_and_why(body)
    routing = view[ROUTING].get(alias)
    if routing is None:
        raise APIError(404, f"no alias {alias!r}", code="model_not_found")
    backend, min_replicas = None, None
    if action in (OperatorAction.PIN, OperatorAction.UNPIN):
        try:
            backend = BackendType(body.get("backend"))
        except ValueError:
            raise bad_request(f"`backend` is one of {', '.join(b.value for b in BackendType)}",
                              param="backend") from None
        config = routing.config.backends.get(backend) if routing.config else None
        if config is None:
            raise bad_request(f"alias {alias} has no {backend.value} backend", param="backend")
        if action is OperatorAction.PIN:
            min_replicas = body.get("min_replicas")
            if not isinstance(min_replicas, int) or isinstance(min_replicas, bool) \
                    or not 0 <= min_replicas <= config.max_replicas:
                raise bad_request(f"`min_replicas` is a whole number from 0 to the tier's max_replicas "
                                  f"({config.max_replicas})", param="min_replicas")
    stored = await _record(ctx, OperatorCommanded(alias=alias, action=action, operator=operator, reason=reason,
                                                  backend_type=backend, min_replicas=min_replicas))
    return {"event_id": str(stored.id), "alias": alias, "action": action.value}
