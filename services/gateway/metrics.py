"""The gateway's Prometheus `/metrics`: request outcomes, cold-start waits, demand signals, current load."""

from __future__ import annotations

from services.gateway.meter import FAST, SLOW, Meter
from shared.prometheus import Histogram, family

COLD_START_WAIT_BOUNDS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 90, 120, 180, 300)
"""From a wake from sleep (tenths of a second) to a vLLM cold start (a minute or two)."""


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return ",".join(f'{name}="{_label(value)}"' for name, value in labels.items())


class GatewayMetrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}
        self.cold_start_wait: dict[tuple[str, str], Histogram] = {}
        self.demand_signals: dict[str, int] = {}

    def request(self, alias: str, backend: str, outcome: str) -> None:
        key = (alias, backend, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def held(self, alias: str, outcome: str, seconds: float) -> None:
        histogram = self.cold_start_wait.get((alias, outcome))
        if histogram is None:
            histogram = self.cold_start_wait[(alias, outcome)] = Histogram(COLD_START_WAIT_BOUNDS_S)
        histogram.observe(seconds)

    def demand_signalled(self, alias: str) -> None:
        self.demand_signals[alias] = self.demand_signals.get(alias, 0) + 1

    def render(self, meter: Meter) -> str:
        out: list[str] = []
        family(out, "modelpool_gateway_requests_total", "counter",
               "Requests by alias, backend that answered (none: the gateway) and outcome.")
        for (alias, backend, outcome), n in sorted(self.requests.items()):
            out.append(f"modelpool_gateway_requests_total{{{_labels(alias=alias, backend=backend, outcome=outcome)}}} {n}")
        family(out, "modelpool_gateway_cold_start_wait_seconds", "histogram",
               "How long requests were held for an alias with no routable instance, by how the hold ended.")
        for (alias, outcome), histogram in sorted(self.cold_start_wait.items()):
            out.extend(histogram.lines("modelpool_gateway_cold_start_wait_seconds", _labels(alias=alias, outcome=outcome)))
        family(out, "modelpool_gateway_demand_signals_total", "counter", "Demand signals sent for held requests.")
        for alias, n in sorted(self.demand_signals.items()):
            out.append(f"modelpool_gateway_demand_signals_total{{{_labels(alias=alias)}}} {n}")
        family(out, "modelpool_gateway_held_requests", "gauge", "Requests held right now, waiting for an instance.")
        for alias, m in sorted(meter.aliases.items()):
            out.append(f"modelpool_gateway_held_requests{{{_labels(alias=alias)}}} {m.held}")
        family(out, "modelpool_gateway_inflight_requests", "gauge", "Requests on instances right now, by backend.")
        for alias, m in sorted(meter.aliases.items()):
            for backend in (FAST, SLOW):
                out.append(f"modelpool_gateway_inflight_requests{{{_labels(alias=alias, backend=backend.value)}}} "
                           f"{m.inflight[backend]}")
        return "\n".join(out) + "\n"
