"""The operators' API: on its own port, behind its own token, never on the public one.

    GET  /admin/status                       what `modelpool status --json` prints
    GET  /admin/history/{alias}?since=&until= the alias's timeline from the log (ISO times)
    GET  /admin/instances                    every instance as the gateway's live view has it
    POST /admin/instances/{id}/drain         take an instance out of service
    GET  /admin/sd/engines                   the engines' /metrics as Prometheus HTTP service discovery

It is served only when `MODELPOOL_ADMIN_TOKEN` is set, on `MODELPOOL_ADMIN_HOST`
(loopback by default) and `MODELPOOL_ADMIN_PORT`. A drain goes to the
instance's worker as the controller's commands do; the worker records the
change with the reason, so the log shows who asked. The controller then treats
the instance as any drained one: it is deleted once drained, and replaced if
the alias's targets still want it.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway.edge import Keys, error_response, http_error, unexpected_error
from services.ops.history import summarize
from services.ops.status import read_live, read_status
from services.runtime import ServiceContext
from shared.bus.jetstream import publish
from shared.contracts.commands import DrainInstance
from shared.contracts.messages import Envelope
from shared.contracts.states import InstanceState
from shared.openai_protocol import APIError, bad_request
from shared.projections.live import LiveView
from shared.projections.readmodels import INSTANCES
from shared.projections.rows import as_json

DRAINABLE = (InstanceState.RUNNING, InstanceState.STARTING, InstanceState.SLEEP_1, InstanceState.SLEEP_2)
DRAIN_TIMEOUT_S = 120.0
SCRAPED = (InstanceState.RUNNING, InstanceState.SLEEP_1, InstanceState.SLEEP_2, InstanceState.DRAINING)
"""Engine states in which an engine answers its /metrics."""


def create_admin_app(ctx: ServiceContext, view: LiveView, token: str) -> Starlette:
    keys = Keys(frozenset({token}))

    def guarded(handler):
        async def endpoint(request: Request) -> Response:
            try:
                keys.check(request)
                return await handler(request)
            except APIError as exc:
                return error_response(exc)
        return endpoint

    async def status(_: Request) -> Response:
        answer = await read_status(ctx.engine, ctx.settings.namespace)
        answer["live"] = await read_live(ctx.telemetry_bus)
        return _json(answer)

    async def history(request: Request) -> Response:
        alias = request.path_params["alias"]
        try:
            since, until = (datetime.fromisoformat(request.query_params[k]) if k in request.query_params else None
                            for k in ("since", "until"))
        except ValueError as exc:
            raise bad_request(f"since / until must be ISO 8601 times: {exc}", param="since") from None
        events = ctx.store.typed(await ctx.store.history(alias, since=since, until=until))
        return _json({"alias": alias, "events": [
            {"at": e.occurred_at, "type": e.type, "position": e.position, "summary": summarize(event)}
            for e, event in events]})

    async def instances(_: Request) -> Response:
        rows = sorted(view[INSTANCES].values(), key=lambda r: (r.alias, r.backend_type.value, r.instance_id))
        return _json({"instances": [as_json(row) for row in rows]})

    async def engines(_: Request) -> Response:
        """Prometheus `http_sd_configs` targets: every engine that answers, with what it serves as labels."""
        groups = [{"targets": [urlsplit(row.endpoint).netloc],
                   "labels": {"alias": row.alias, "backend": row.backend_type.value, "engine": row.engine.value,
                              "instance_id": row.instance_id, "worker": row.worker_id}}
                  for row in sorted(view[INSTANCES].values(), key=lambda r: r.instance_id)
                  if row.endpoint and row.state in SCRAPED]
        return _json(groups)

    async def drain(request: Request) -> Response:
        instance_id = request.path_params["instance_id"]
        row = view[INSTANCES].get(instance_id)
        if row is None:
            raise APIError(404, f"no instance {instance_id!r}", code="instance_not_found")
        if row.state not in DRAINABLE:
            raise APIError(409, f"instance {instance_id} is {row.state.value}: only "
                                f"{', '.join(s.value for s in DRAINABLE)} can be drained", code="not_drainable")
        command = DrainInstance(instance_id=instance_id, alias=row.alias, backend_type=row.backend_type,
                                worker_id=row.worker_id, timeout_s=DRAIN_TIMEOUT_S,
                                reason="operator drain (admin API)")
        envelope = Envelope.wrap(command, id=uuid.uuid4())
        await publish(ctx.js, ctx.subjects.worker_commands(row.worker_id), envelope, ctx.telemetry)
        return JSONResponse({"command_id": str(envelope.id), "instance_id": instance_id, "worker_id": row.worker_id,
                             "action": "drain"}, status_code=202)

    return Starlette(
        routes=[
            Route("/admin/status", guarded(status)),
            Route("/admin/history/{alias}", guarded(history)),
            Route("/admin/instances", guarded(instances)),
            Route("/admin/instances/{instance_id}/drain", guarded(drain), methods=["POST"]),
            Route("/admin/sd/engines", guarded(engines)),
        ],
        exception_handlers={404: http_error, 405: http_error, Exception: unexpected_error},
    )


def _json(value: Any) -> Response:
    return Response(orjson.dumps(value), media_type="application/json")  # orjson writes datetimes as ISO 8601
