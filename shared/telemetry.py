"""OpenTelemetry, configured once per process and passed around explicitly.

With `OTEL_EXPORTER_OTLP_ENDPOINT` set, traces and metrics are exported over
OTLP/HTTP; without it the tracer and meter are no-ops with no cost. Providers
are owned by the `Telemetry` object rather than installed globally, so tests
and several services in one process never share hidden state. Trace context
travels in bus message headers as W3C `traceparent` / `tracestate`.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Meter, NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import NoOpTracerProvider, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator


class Telemetry:
    def __init__(
        self,
        service_name: str,
        *,
        otlp_endpoint: str | None = None,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        self.service_name = service_name
        self.propagator = TraceContextTextMapPropagator()
        self._tracer_provider: TracerProvider | None = None
        self._meter_provider: MeterProvider | None = None
        resource = Resource.create({"service.name": service_name, "service.namespace": "modelpool"})
        if otlp_endpoint or span_exporter:
            self._tracer_provider = TracerProvider(resource=resource)
            if span_exporter is None:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                span_exporter = OTLPSpanExporter(endpoint=f"{otlp_endpoint.rstrip('/')}/v1/traces")
            self._tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
            self.tracer: Tracer = self._tracer_provider.get_tracer("modelpool")
        else:
            self.tracer = NoOpTracerProvider().get_tracer("modelpool")
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{otlp_endpoint.rstrip('/')}/v1/metrics"))
            self._meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
            self.meter: Meter = self._meter_provider.get_meter("modelpool")
        else:
            self.meter = NoOpMeterProvider().get_meter("modelpool")

    @property
    def tracing(self) -> bool:
        """Whether spans go anywhere: without, a hot path may skip making them."""
        return self._tracer_provider is not None

    @classmethod
    def from_settings(cls, settings: Any, service_name: str) -> "Telemetry":
        return cls(service_name, otlp_endpoint=settings.otlp_endpoint)

    def inject(self, headers: MutableMapping[str, str], context: Context | None = None) -> None:
        """Write the current (or given) trace context into message headers."""
        self.propagator.inject(headers, context=context)

    def extract(self, headers: dict[str, str]) -> Context:
        return self.propagator.extract(headers)

    @contextmanager
    def consume_span(self, name: str, headers: dict[str, str]) -> Iterator[Any]:
        """A consumer span, child of the producer's context carried in `headers`."""
        with self.tracer.start_as_current_span(name, context=self.extract(headers), kind=SpanKind.CONSUMER) as span:
            yield span

    @contextmanager
    def span(self, name: str, kind: SpanKind = SpanKind.INTERNAL, **attributes: Any) -> Iterator[Any]:
        with self.tracer.start_as_current_span(name, kind=kind, attributes=attributes or None) as span:
            yield span

    def current_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        self.inject(headers)
        return headers

    def shutdown(self) -> None:
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
        if self._meter_provider is not None:
            self._meter_provider.shutdown()


__all__ = ["Telemetry", "trace"]
