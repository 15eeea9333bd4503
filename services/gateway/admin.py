"""The operators' API and console: on its own port, behind its own token, never on the public one.

    GET  /console                               the web console (docs/console.md); its data comes from below
    GET  /admin/status                          what `modelpool status --json` prints
    GET  /admin/history/{alias}?since=&until=   the alias's timeline from the log (ISO times)
    GET  /admin/events/{id}                     one event of the log whole: a decision with every input
    GET  /admin/aliases/{alias}/series?after=   the alias's load per metric window, and its instances now
    GET  /admin/instances                       every instance as the gateway's live view has it
    GET  /admin/sessions?alias=                 session bindings, and the last hour's moves
    GET  /admin/requests/{request_id}           why a past request went where it went (this gateway's access log)
    POST /admin/instances/{id}/{action}         drain, sleep, wake or delete an instance
    POST /admin/aliases/{alias}/{action}        pause or resume the controller, pin or unpin a tier's minimum
    GET  /admin/sd/engines                      the engines' /metrics as Prometheus HTTP service discovery

It is served only when `MODELPOOL_ADMIN_TOKEN` is set, on `MODELPOOL_ADMIN_HOST`
(loopback by default) and `MODELPOOL_ADMIN_PORT`. Every action names who asks
and why (`{"operator": ..., "reason": ...}`) and is recorded in the log before
it is carried out (`operators.py`). The console's page and assets are served
without the token (they hold no data); every call they make carries it.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta, timezone
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.gateway.console.series import Series
from services.gateway.edge import OPEN_CALLER, Keys, error_response, http_error, unexpected_error
from services.gateway.operators import command_instance, hold_alias
from services.ops.explain import explain, find
from services.ops.history import inputs_of, summarize
from services.ops.status import LIVE_TIMEOUT_S, read_live, read_status
from services.runtime import ServiceContext
from shared.contracts.events import INSTANCE_ACTIONS, OperatorAction, SessionMigrated
from shared.contracts.states import InstanceState
from shared.faults import describe
from shared.openai_protocol import APIError, bad_request
from shared.projections.live import LiveView
from shared.projections.readmodels import INSTANCES, ROUTING, SESSIONS
from shared.projections.rows import as_json

SCRAPED = (InstanceState.RUNNING, InstanceState.SLEEP_1, InstanceState.SLEEP_2, InstanceState.DRAINING)
"""Engine states in which an engine answers its /metrics."""
ALIAS_ACTIONS = (OperatorAction.PAUSE, OperatorAction.RESUME, OperatorAction.PIN, OperatorAction.UNPIN)
MAX_ACTION_BODY = 4096
MIGRATIONS_SHOWN = 100
MIGRATIONS_SINCE = timedelta(hours=1)
STATIC = resources.files("services.gateway.console") / "static"
ASSETS = {"console.js": "text/javascript", "console.css": "text/css"}


def create_admin_app(ctx: ServiceContext, view: LiveView, token: str, series: Series) -> Starlette:
    keys = Keys({token: OPEN_CALLER})

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
        try:  # the log's facts are still worth showing while the bus is away
            answer["live"] = await asyncio.wait_for(read_live(ctx.telemetry_bus), LIVE_TIMEOUT_S)
        except Exception as exc:
            answer["live"] = {"error": f"the bus does not answer ({describe(exc)})"}
        return _json(answer)

    async def history(request: Request) -> Response:
        alias = request.path_params["alias"]
        since, until = (_time(request, k) for k in ("since", "until"))
        limit = request.query_params.get("limit")
        if limit is not None and not (limit.isdigit() and int(limit) > 0):
            raise bad_request("limit is a whole number above 0", param="limit")
        found = await ctx.store.history(alias, since=since, until=until)
        events = ctx.store.typed(found[-int(limit):] if limit else found)
        return _json({"alias": alias, "total": len(found), "events": [
            {"id": str(e.id), "at": e.occurred_at, "type": e.type, "position": e.position, "summary": summarize(event),
             "instance_id": getattr(event, "instance_id", None)}
            for e, event in events]})

    async def event(request: Request) -> Response:
        try:
            event_id = uuid.UUID(request.path_params["event_id"])
        except ValueError:
            raise bad_request("an event id is a UUID", param="id") from None
        found = await ctx.store.get(event_id)
        if found is None:
            raise APIError(404, f"no event {event_id}", code="event_not_found")
        fact = ctx.store.fact(found)
        return _json({"id": str(found.id), "type": found.type, "at": found.occurred_at, "position": found.position,
                      "stream_id": found.stream_id, "causation_id": found.causation_id and str(found.causation_id),
                      "summary": summarize(fact), "inputs": inputs_of(fact),
                      "payload": fact.model_dump(mode="json")})

    async def alias_series(request: Request) -> Response:
        alias = request.path_params["alias"]
        routing = view[ROUTING].get(alias)
        if routing is None:
            raise APIError(404, f"no alias {alias!r}", code="model_not_found")
        tiers: dict[str, dict[str, int]] = {}
        for row in view[INSTANCES].values():
            if row.alias == alias:
                counts = tiers.setdefault(row.backend_type.value, {})
                counts[row.state.value] = counts.get(row.state.value, 0) + 1
        return _json({"alias": alias, "points": series.points(alias, _time(request, "after")),
                      "now": {"state": routing.state.value, "mix_weight": routing.mix_weight, "instances": tiers}})

    async def instances(_: Request) -> Response:
        rows = sorted(view[INSTANCES].values(), key=lambda r: (r.alias, r.backend_type.value, r.instance_id))
        return _json({"instances": [as_json(row) for row in rows]})

    async def sessions(request: Request) -> Response:
        alias = request.query_params.get("alias")
        rows = sorted((r for r in view[SESSIONS].values() if alias is None or r.alias == alias),
                      key=lambda r: r.bound_at, reverse=True)
        # The last hour's moves of each alias, read through the log's index by alias.
        since = datetime.now(timezone.utc) - MIGRATIONS_SINCE
        moved = [m for a in ([alias] if alias else sorted(view[ROUTING]))
                 for m in await ctx.store.history(a, since=since, types=[SessionMigrated.TYPE])]
        moved = sorted(moved, key=lambda e: e.position or 0)[-MIGRATIONS_SHOWN:]
        return _json({"sessions": [as_json(r) for r in rows], "migrations": [
            {"at": e.occurred_at, "id": str(e.id), "summary": summarize(fact), **fact.model_dump(mode="json")}
            for e, fact in reversed(ctx.store.typed(moved))]})

    async def explained(request: Request) -> Response:
        """A past request's access-log line and why it went where it went (`modelpool explain`)."""
        request_id = request.path_params["request_id"]
        if not ctx.settings.access_log:
            raise APIError(404, "this gateway keeps no access log (MODELPOOL_ACCESS_LOG)", code="no_access_log")
        record = await asyncio.to_thread(find, request_id, Path(ctx.settings.access_log))
        if record is None:
            raise APIError(404, f"no request {request_id!r} in this gateway's access log", code="request_not_found")
        return _json({"record": record, "explained": explain(record)})

    async def engines(_: Request) -> Response:
        """Prometheus `http_sd_configs` targets: every engine that answers, with what it serves as labels."""
        groups = [{"targets": [urlsplit(row.endpoint).netloc],
                   "labels": {"alias": row.alias, "backend": row.backend_type.value, "engine": row.engine.value,
                              "instance_id": row.instance_id, "worker": row.worker_id}}
                  for row in sorted(view[INSTANCES].values(), key=lambda r: r.instance_id)
                  if row.endpoint and row.state in SCRAPED]
        return _json(groups)

    async def instance_action(request: Request) -> Response:
        action = _action(request, tuple(INSTANCE_ACTIONS))
        done = await command_instance(ctx, view, request.path_params["instance_id"], action, await _body(request))
        return _json(done, status_code=202)

    async def alias_action(request: Request) -> Response:
        action = _action(request, ALIAS_ACTIONS)
        return _json(await hold_alias(ctx, view, request.path_params["alias"], action, await _body(request)))

    async def console(_: Request) -> Response:
        return Response((STATIC / "index.html").read_bytes(), media_type="text/html; charset=utf-8")

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            raise APIError(404, f"no asset {name!r}", code="not_found")
        return Response((STATIC / name).read_bytes(), media_type=f"{ASSETS[name]}; charset=utf-8",
                        headers={"cache-control": "no-cache"})

    def public(handler):
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return error_response(exc)
        return endpoint

    return Starlette(
        routes=[
            Route("/console", public(console)),
            Route("/console/{name}", public(asset)),
            Route("/admin/status", guarded(status)),
            Route("/admin/history/{alias}", guarded(history)),
            Route("/admin/events/{event_id}", guarded(event)),
            Route("/admin/aliases/{alias}/series", guarded(alias_series)),
            Route("/admin/aliases/{alias}/{action}", guarded(alias_action), methods=["POST"]),
            Route("/admin/instances", guarded(instances)),
            Route("/admin/instances/{instance_id}/{action}", guarded(instance_action), methods=["POST"]),
            Route("/admin/sessions", guarded(sessions)),
            Route("/admin/requests/{request_id}", guarded(explained)),
            Route("/admin/sd/engines", guarded(engines)),
        ],
        exception_handlers={404: http_error, 405: http_error, Exception: unexpected_error},
    )


def _time(request: Request, name: str) -> datetime | None:
    value = request.query_params.get(name)
    if value is None:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError as exc:
        raise bad_request(f"{name} must be an ISO 8601 time: {exc}", param=name) from None


def _action(request: Request, allowed: tuple[OperatorAction, ...]) -> OperatorAction:
    name = request.path_params["action"]
    found = next((a for a in allowed if a.value == name), None)
    if found is None:
        raise APIError(404, f"no action {name!r} here; these are: {', '.join(a.value for a in allowed)}",
                       code="unknown_action")
    return found


async def _body(request: Request) -> dict[str, Any]:
    """The action's JSON object: who asks, why, and the action's own fields."""
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_ACTION_BODY:
            raise APIError(413, f"an action's body is at most {MAX_ACTION_BODY} bytes", code="body_too_large")
    try:
        body = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body is a JSON object: {\"operator\": ..., \"reason\": ...}")
    return body


def _json(value: Any, status_code: int = 200) -> Response:
    # orjson writes datetimes as ISO 8601
    return Response(orjson.dumps(value), status_code=status_code, media_type="application/json")
