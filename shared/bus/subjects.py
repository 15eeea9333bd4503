"""JetStream streams and subjects, all under the pool's namespace (see docs/bus.md).

    <ns>.evt.<category>.<Type>     events, relayed from the log after commit   stream <NS>_EVENTS
    <ns>.cmd.worker.<worker_id>    instance commands for one worker             stream <NS>_COMMANDS
    <ns>.cmd.placement             placement requests                           stream <NS>_COMMANDS
    <ns>.dlq.<consumer>            messages a consumer could not accept         stream <NS>_DLQ

Telemetry (bounded lifetime, never in the log; see shared/bus/telemetry.py):

    <ns>.tel.window.<gateway_id>   gateway metric windows (24 h)                stream <NS>_WINDOWS
    <ns>.tel.demand                cold-start demand                            core NATS, not stored
    <ns>.tel.usage.<gateway_id>    per-key usage, shared between gateways       core NATS, not stored
    KV <ns>_heartbeats             worker heartbeats with instance status       latest per worker, TTL
    KV <ns>_control                the controller's outlook per alias           latest per alias, TTL
"""

from __future__ import annotations

from dataclasses import dataclass

# Header names. Nats-Msg-Id is JetStream's own de-duplication key.
MSG_ID = "Nats-Msg-Id"
TYPE = "Modelpool-Type"
VERSION = "Modelpool-Version"
POSITION = "Modelpool-Position"
DLQ_REASON = "Modelpool-Dead-Letter-Reason"
DLQ_SUBJECT = "Modelpool-Original-Subject"
DLQ_SEQUENCE = "Modelpool-Original-Sequence"
DLQ_CONSUMER = "Modelpool-Consumer"

DUPLICATE_WINDOW_S = 120.0


@dataclass(frozen=True)
class Subjects:
    namespace: str

    @property
    def events_stream(self) -> str:
        return f"{self.namespace.upper()}_EVENTS"

    @property
    def commands_stream(self) -> str:
        return f"{self.namespace.upper()}_COMMANDS"

    @property
    def dlq_stream(self) -> str:
        return f"{self.namespace.upper()}_DLQ"

    @property
    def all_events(self) -> str:
        return f"{self.namespace}.evt.>"

    def event(self, stream_id: str, type_name: str) -> str:
        category = stream_id.split(":", 1)[0]
        return f"{self.namespace}.evt.{category}.{type_name}"

    def events_of(self, category: str) -> str:
        return f"{self.namespace}.evt.{category}.*"

    @property
    def all_commands(self) -> str:
        return f"{self.namespace}.cmd.>"

    def worker_commands(self, worker_id: str) -> str:
        return f"{self.namespace}.cmd.worker.{worker_id}"

    @property
    def placement_commands(self) -> str:
        return f"{self.namespace}.cmd.placement"

    @property
    def all_dead_letters(self) -> str:
        return f"{self.namespace}.dlq.>"

    def dead_letter(self, consumer: str) -> str:
        return f"{self.namespace}.dlq.{consumer}"

    # ------------------------------------------------------------------ telemetry

    @property
    def windows_stream(self) -> str:
        return f"{self.namespace.upper()}_WINDOWS"

    @property
    def all_windows(self) -> str:
        return f"{self.namespace}.tel.window.>"

    def windows_of(self, gateway_id: str) -> str:
        return f"{self.namespace}.tel.window.{gateway_id}"

    @property
    def demand(self) -> str:
        return f"{self.namespace}.tel.demand"

    def usage_of(self, gateway_id: str) -> str:
        return f"{self.namespace}.tel.usage.{gateway_id}"

    @property
    def all_usage(self) -> str:
        return f"{self.namespace}.tel.usage.>"

    @property
    def heartbeats_bucket(self) -> str:
        return f"{self.namespace}_heartbeats"

    @property
    def control_bucket(self) -> str:
        return f"{self.namespace}_control"

    @property
    def all_streams(self) -> tuple[str, ...]:
        """Every JetStream stream of the namespace, key-value buckets included (for clean-up)."""
        return (self.events_stream, self.commands_stream, self.dlq_stream, self.windows_stream,
                f"KV_{self.heartbeats_bucket}", f"KV_{self.control_bucket}")
