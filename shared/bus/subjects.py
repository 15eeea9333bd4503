"""JetStream streams and subjects, all under the pool's namespace (see docs/bus.md).

    <ns>.evt.<category>.<Type>     events, relayed from the log after commit   stream <NS>_EVENTS
    <ns>.cmd.worker.<worker_id>    instance commands for one worker             stream <NS>_COMMANDS
    <ns>.cmd.placement             placement requests                           stream <NS>_COMMANDS
    <ns>.dlq.<consumer>            messages a consumer could not accept         stream <NS>_DLQ
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
