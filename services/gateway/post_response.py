"""After a request: its measurements, its slot given back, its upstream connection kept or closed, one access-log line.

Every request passes here exactly once, whatever ended it (answered, refused,
failed, or its client left), so no slot, connection or count is ever lost.
"""

from __future__ import annotations

import logging

from opentelemetry.trace import Span, Status, StatusCode

from services.gateway.access_log import access_log, log_access
from services.gateway.admission import Admission
from services.gateway.context import RequestContext
from services.gateway.metrics import GatewayMetrics
from services.gateway.quotas import Quotas
from services.gateway.routing import Router
from services.gateway.sessions import Sessions
from shared.metering import RequestOutcome


class PostResponse:
    def __init__(self, admission: Admission, router: Router, sessions: Sessions, metrics: GatewayMetrics,
                 quotas: Quotas) -> None:
        self.admission = admission
        self.router = router
        self.sessions = sessions
        self.metrics = metrics
        self.quotas = quotas

    def finish(self, ctx: RequestContext, outcome: RequestOutcome, status: int | None, span: Span | None) -> None:
        trace = ctx.trace
        trace.finished(outcome, ctx.usage)
        backend = trace.backend.value if trace.backend else "none"
        self.metrics.request(ctx.alias, backend, outcome.value, status)
        if outcome is RequestOutcome.OK and trace.backend is not None:
            self.metrics.served(ctx.alias, backend, trace.ttft_s, trace.ended - trace.arrived, trace.tpot_s)
        if ctx.quota is not None:
            self.quotas.leave(ctx.quota, ctx.usage)
        slot, route = ctx.slot, ctx.route  # before the slot is given back
        if slot is not None:
            if ctx.usage is not None and outcome is RequestOutcome.OK:
                self.router.tokens.observe(ctx.alias, ctx.ask.prompt.size_bytes, ctx.usage[0])
                if slot.binds:
                    self.sessions.seen(ctx.ask.prompt.session_id, ctx.usage[0] + ctx.usage[1])
            self.admission.release(ctx)
        if ctx.upstream is not None:
            if ctx.read_whole:
                ctx.upstream.release()
            else:
                ctx.upstream.close()  # an unfinished answer: the engine sees the disconnect and stops generating
        instance = slot.instance_id if slot else None
        if span is not None:
            span.set_attributes({"modelpool.outcome": outcome.value, "modelpool.backend": backend,
                                 "http.response.status_code": status or 0, "modelpool.instance": instance or ""})
            if outcome not in (RequestOutcome.OK, RequestOutcome.CLIENT_ERROR, RequestOutcome.LEFT):
                span.set_status(Status(StatusCode.ERROR, outcome.value))
        if not access_log.isEnabledFor(logging.INFO):
            return  # the hot path builds no record for nobody
        log_access({
            "request_id": ctx.request_id, "alias": ctx.alias, "path": ctx.path, "stream": ctx.stream,
            "status": status, "outcome": outcome.value, "instance": instance, "backend": backend,
            "engine": ctx.engine, "retries": max(0, ctx.attempts - 1), "session": ctx.ask.prompt.session_id,
            "moved_from": slot.moved_from if slot else None, "route": route,
            "queue_s": round(trace.dispatched_at - trace.arrived, 4) if trace.dispatched_at is not None else None,
            "ttft_s": round(trace.ttft_s, 4) if trace.ttft_s is not None else None,
            "e2e_s": round(trace.ended - trace.arrived, 4),
            "prompt_tokens": ctx.usage[0] if ctx.usage else None,
            "completion_tokens": ctx.usage[1] if ctx.usage else trace.content_chunks or None,
        })
