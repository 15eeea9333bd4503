"""Every service's own /metrics, on `MODELPOOL_METRICS_PORT`: whether it reaches its servers, and what it counts.

The gateway's metrics are on its public port; the relay, projector, placement,
autoscaler and workers serve these on a port of their own when
`MODELPOOL_METRICS_PORT` is set, so Prometheus scrapes every service
(`deploy/prometheus/`, compose's `observability` profile). Each service adds
what only it knows (`add`, read at each scrape); every one says whether it
reaches Postgres and NATS and since when.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from shared.prometheus import family

if TYPE_CHECKING:
    from services.links import ServerLinks

log = logging.getLogger(__name__)

Labels = tuple[tuple[str, str], ...]


def _labels(pairs: Mapping[str, str] | Labels) -> str:
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    return ",".join(f'{k}="{_escape(str(v))}"' for k, v in items)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServiceMetrics:
    """One service's metrics, each read from the service when scraped, with what every service says."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.started = time.time()
        self._read: dict[str, tuple[str, str, Callable[[], float | Mapping[Labels, float]]]] = {}

    def add(self, name: str, help_text: str, read: Callable[[], float | Mapping[Labels, float]],
            kind: str = "gauge") -> None:
        """`read()` at each scrape: one value, or values by their labels; `kind` "counter" for a running total
        the service keeps (its name ends in `_total`)."""
        self._read[name] = (kind, help_text, read)

    def render(self, links: ServerLinks | None = None) -> str:
        out: list[str] = []
        family(out, "modelpool_service_info", "gauge", "The service and the host it runs on (always 1)")
        out.append(f"modelpool_service_info{{{_labels({'service': self.service, 'host': socket.gethostname()})}}} 1")
        family(out, "modelpool_service_start_time_seconds", "gauge", "When the service started (Unix time)")
        out.append(f"modelpool_service_start_time_seconds {self.started:.3f}")
        if links is not None:
            family(out, "modelpool_service_server_up", "gauge",
                   "Whether the service reaches the server (1) or not (0), as its probe found last")
            family(out, "modelpool_service_server_state_seconds", "gauge",
                   "How long the server has been reachable, or unreachable, without a break")
            for link in (links.postgres, links.nats):
                state = link.to_json()
                server = link.server.lower()
                out.append(f'modelpool_service_server_up{{server="{server}"}} {int(state["up"])}')
                out.append(f'modelpool_service_server_state_seconds{{server="{server}"}} {state["for_s"]}')
        for name, (kind, help_text, read) in self._read.items():
            try:
                value = read()
            except Exception as exc:  # one that cannot be read is left out of this scrape, not the others
                log.debug("metric %s not read: %r", name, exc)
                continue
            family(out, name, kind, help_text)
            if isinstance(value, Mapping):
                out.extend(f"{name}{{{_labels(k)}}} {v}" for k, v in value.items())
            else:
                out.append(f"{name} {value}")
        return "\n".join(out) + "\n"


def metrics_app(metrics: ServiceMetrics, links: ServerLinks) -> Starlette:
    """/metrics for Prometheus, and nothing else (404)."""

    async def scrape(_: Request) -> Response:
        return PlainTextResponse(metrics.render(links), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[Route("/metrics", scrape)])
