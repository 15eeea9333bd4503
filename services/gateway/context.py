"""One request as it passes the gateway's stages, and the refusal any stage may end it with.

The edge fills in what the client asked (`edge.py`); admission writes the slot,
and only admission (`admission.py`); the proxy the upstream answer, the engine
that served and the usage (`proxy.py`); the post-response stage reads it all
(`post_response.py`). Every stage takes the context and nothing else of the
request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp

from services.gateway.resume import StreamTranscript
from services.gateway.quotas import Ticket
from services.gateway.routing import Ask, Slot
from services.gateway.sse import Usage
from shared.metering import RequestOutcome, RequestTrace
from shared.openai_protocol import APIError


@dataclass(eq=False, slots=True)
class RequestContext:
    request_id: str
    alias: str
    path: str
    body: dict[str, Any]
    """The client's body as the engine gets it (the gateway adds only `stream_options.include_usage`)."""
    payload: bytes
    """`body`, serialized once."""
    stream: bool
    keep_usage: bool
    """The client asked for the usage chunk itself (else the gateway takes out the one it asked for)."""
    ask: Ask
    """What the router knows of the request; a retry narrows it to its backend and away from failed instances."""
    trace: RequestTrace
    trace_headers: dict[str, str] = field(default_factory=dict)
    """The client's `traceparent` / `tracestate`, if it sent them."""
    transcript: StreamTranscript | None = None
    """What the client has been sent of a stream: a stream broken midway is carried on from there."""
    slot: Slot | None = None
    attempts: int = 0
    """Times the request (or the rest of its stream) was sent to an instance."""
    upstream: aiohttp.ClientResponse | None = None
    head: bytes = b""
    """What was read of the upstream answer before relaying began: a stream's first events, or the whole body."""
    read_whole: bool = False
    """The engine's answer was read to its end: its connection can serve another request."""
    engine: str | None = None
    usage: Usage | None = None
    retried_after: list[str] = field(default_factory=list)
    """What made the gateway send the request again, each time (`503`, `broken connection`)."""
    cold_start_ms: int | None = None
    """How long the request was held for its alias to come up, when it was (told to the client)."""
    quota: Ticket | None = None
    """Its hold on its key's limits (`quotas.py`), given back when it ends."""


    @property
    def route(self) -> str | None:
        """Why the request went where it did (`x-modelpool-route`): its slot's reasons, then each retry's."""
        if self.slot is None:
            return None
        return "; ".join([self.slot.route, *(f"retry after {why}" for why in self.retried_after)])


class Refused(Exception):
    """The request cannot be served: what the client is told, and how it counts."""

    def __init__(self, error: APIError, outcome: RequestOutcome) -> None:
        super().__init__(error.body.error.message)
        self.error = error
        self.outcome = outcome
