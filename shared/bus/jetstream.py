"""Connecting to NATS, declaring the streams, publishing, and consuming with care.

Consumers follow three rules:
- a message is acked only after the handler has committed its effect, so a crash
  before commit means redelivery, never loss;
- handlers are idempotent (event ids derived from command ids; projection
  positions), so a redelivery never doubles an effect;
- a message that cannot be parsed, has an unknown type or fails validation is
  moved to the dead-letter stream with the reason, and the consumer goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from faststream import AckPolicy as FastStreamAck
from faststream.message import StreamMessage
from faststream.nats import JStream, NatsBroker, PullSub
from faststream.nats.annotations import NatsMessage
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from shared.bus import subjects as h
from shared.bus.auth import BusCredentials
from shared.bus.subjects import DUPLICATE_WINDOW_S, Subjects
from shared.contracts.messages import Contract, Envelope, InvalidMessage, Registry, UnknownMessageType, describe_errors
from shared.faults import describe, is_transient
from shared.telemetry import Telemetry

log = logging.getLogger(__name__)


NATS_OPTIONS: dict[str, Any] = {
    "connect_timeout": 5,
    # A service waits out an outage of any length: nats-py's default gives up after 60 attempts.
    "max_reconnect_attempts": -1,
    "reconnect_time_wait": 0.5,
    # A server that stops answering (paused, or cut off without a reset) is noticed after about
    # three unanswered pings, not after nats-py's default of four minutes.
    "ping_interval": 5,
    "max_outstanding_pings": 3,
}
"""How every long-lived connection of a service talks to NATS (its own and its FastStream broker's)."""


def servers_of(url: str) -> list[str]:
    """The servers a NATS_URL names: one, or a cluster's, comma-separated. Any one reachable will do, and
    a client learns the rest of the cluster from it."""
    return [server.strip() for server in url.split(",") if server.strip()]


async def connect(url: str, *, name: str, credentials: BusCredentials | None = None, **options: Any) -> NATS:
    """A connection that retries for ever (services); `options` override that, e.g. for a one-shot command.
    `credentials`: the user to connect as, on a bus with users (they go in the handshake, never in the URL)."""
    auth = credentials.connect_options() if credentials else {}
    return await nats.connect(servers_of(url), **{"name": name, **NATS_OPTIONS, **auth, **options})


async def connect_once(url: str, *, name: str, timeout_s: float, credentials: BusCredentials | None = None) -> NATS:
    """A connection for a one-shot command: two attempts, no reconnecting. A failure is raised once, as
    `ConnectionError` saying why, instead of a traceback per attempt (a service would retry for ever)."""
    failures: list[Exception] = []

    async def remember(exc: Exception) -> None:
        failures.append(exc)

    try:
        return await asyncio.wait_for(connect(url, name=name, credentials=credentials, allow_reconnect=False,
                                              max_reconnect_attempts=1, error_cb=remember), timeout_s)
    except Exception as exc:
        why = failures[-1] if failures else exc
        raise ConnectionError(f"NATS at {url} unreachable ({str(why) or why.__class__.__name__})") from exc


async def ensure_streams(js: JetStreamContext, subjects: Subjects, replicas: int = 1) -> None:
    """Declare the namespace's streams (idempotent; updates a changed configuration). `replicas`: copies kept
    on a NATS cluster's servers (3 survives one server's loss; a single server takes only 1)."""
    configs = [
        StreamConfig(
            name=subjects.events_stream,
            subjects=[subjects.all_events],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
            max_age=7 * 24 * 3600.0,
            num_replicas=replicas,
        ),
        StreamConfig(
            name=subjects.commands_stream,
            subjects=[subjects.all_commands],
            # Each command is for exactly one handler and is gone once acked.
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
            num_replicas=replicas,
        ),
        StreamConfig(
            name=subjects.dlq_stream,
            subjects=[subjects.all_dead_letters],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=30 * 24 * 3600.0,
            num_replicas=replicas,
        ),
    ]
    for config in configs:
        try:
            await js.stream_info(config.name)
        except NotFoundError:
            await js.add_stream(config)
        else:
            await js.update_stream(config)


async def wait_for_streams(js: JetStreamContext, streams: tuple[str, ...], logger: logging.Logger,
                           poll_s: float = 1.0) -> None:
    """Until every one of `streams` exists: a process that may not declare them (`shared/bus/permissions.py`)
    waits for `modelpool migrate` or the autoscaler to do it, saying so once."""
    said = False
    for stream in streams:
        while True:
            try:
                await js.stream_info(stream)
                break
            except NotFoundError:
                if not said:
                    logger.warning("waiting for the stream %s: `modelpool migrate` or the autoscaler declares it", stream)
                    said = True
                await asyncio.sleep(poll_s)


def message_headers(
    message_id: str, type_name: str, version: int, position: int | None, telemetry: Telemetry,
    extra_headers: dict[str, str] | None = None,
) -> dict[str, str]:
    """The headers every modelpool message carries (see docs/bus.md)."""
    headers = {h.MSG_ID: message_id, h.TYPE: type_name, h.VERSION: str(version), **(extra_headers or {})}
    if position is not None:
        headers[h.POSITION] = str(position)
    if not any(k.lower() == "traceparent" for k in headers):
        telemetry.inject(headers)
    return headers


async def publish(
    js: JetStreamContext,
    subject: str,
    envelope: Envelope,
    telemetry: Telemetry,
    *,
    extra_headers: dict[str, str] | None = None,
) -> bool:
    """Publish an envelope; JetStream drops a repeat of the same id. Returns False for a duplicate."""
    headers = message_headers(str(envelope.id), envelope.type, envelope.version, envelope.position, telemetry, extra_headers)
    ack = await js.publish(subject, envelope.model_dump_json().encode(), headers=headers)
    return not ack.duplicate


async def publish_in_order(js: JetStreamContext, messages: list[tuple[str, bytes, dict[str, str]]]) -> None:
    """Publish (subject, body, headers) messages pipelined: sent in order on one connection,
    so stored in order, then wait for every acknowledgement. Raises if any was not stored."""
    acks = [await js.publish_async(subject, body, headers=headers) for subject, body, headers in messages]
    await asyncio.gather(*acks)


Handler = Callable[[Envelope, Contract], Awaitable[None]]

TRANSIENT_RETRY_CAP_S = 2.0
"""Longest wait between two deliveries of a message whose handler waits for a server to come back."""


@dataclass
class ConsumerStats:
    handled: int = 0
    dead_lettered: int = 0
    retried: int = 0


class Consumer:
    """A durable pull consumer: validate, handle, ack after the effect is committed."""

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        *,
        stream: str,
        durable: str,
        filter_subject: str,
        registry: Registry,
        handler: Handler,
        telemetry: Telemetry,
        max_deliver: int = 5,
        ack_wait_s: float = 30.0,
        batch: int = 64,
        deliver_new_only: bool = False,
        key_of: Callable[[Contract], str] | None = None,
    ) -> None:
        self.js = js
        self.subjects = subjects
        self.stream = stream
        self.durable = durable
        self.filter_subject = filter_subject
        self.registry = registry
        self.handler = handler
        self.telemetry = telemetry
        self.max_deliver = max_deliver
        self.ack_wait_s = ack_wait_s
        self.batch = batch
        self.deliver_new_only = deliver_new_only
        self.key_of = key_of
        if key_of is not None and batch != 1:
            raise ValueError("a keyed consumer fetches one message at a time, or order within a key is lost")
        self.stats = ConsumerStats()
        self._tails: dict[str, asyncio.Task[None]] = {}

    def consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            # Redelivery stays in our hands: after max_deliver failures the
            # message goes to the dead-letter stream instead of vanishing.
            max_deliver=-1,
            filter_subject=self.filter_subject,
            deliver_policy=DeliverPolicy.NEW if self.deliver_new_only else DeliverPolicy.ALL,
        )

    def subscribe(self, broker: NatsBroker, inbox_prefix: str | None = None) -> None:
        """Register with a FastStream broker, which runs the pull loop; `handle` does the rest.

        `inbox_prefix`: where the pulled messages come, on a bus with users the connection's own
        inboxes (`shared/bus/auth.py`); FastStream's default is everyone's `_INBOX`.

        Acknowledgement is manual: `handle` acks only after the handler's effect is
        committed. The raw body is passed through undecoded, so a message that is
        not even JSON still reaches `handle` and is dead-lettered with its reason.
        """

        async def undecoded(message: StreamMessage[Msg]) -> bytes:
            return message.body

        @broker.subscriber(
            self.filter_subject,
            stream=JStream(self.stream, declare=False),
            durable=self.durable,
            config=self.consumer_config(),
            pull_sub=PullSub(batch_size=self.batch, timeout=0.5),
            ack_policy=FastStreamAck.MANUAL,
            decoder=undecoded,
            **({"inbox_prefix": f"{inbox_prefix}.".encode()} if inbox_prefix else {}),
        )
        async def on_message(body: bytes, message: NatsMessage) -> None:
            await self.handle(message.raw_message)

    async def handle(self, msg: Msg) -> None:
        try:
            envelope = Envelope.model_validate_json(msg.data)
        except ValidationError as exc:
            await self.dead_letter(msg, f"unparseable message: {describe_errors(exc)}")
            return
        try:
            contract = self.registry.decode(envelope)
        except UnknownMessageType as exc:
            await self.dead_letter(msg, str(exc))
            return
        except (InvalidMessage, ValueError) as exc:
            await self.dead_letter(msg, f"invalid {envelope.type}: {exc}")
            return

        if self.key_of is None:
            await self._run(msg, envelope, contract)
            return
        # Keyed: messages of one key run one after the other, in the order fetched;
        # different keys run side by side. Each is acked when its own handler is
        # done, so a long one holds neither its neighbours nor the fetch loop.
        key = self.key_of(contract)
        task = asyncio.create_task(self._run_after(self._tails.get(key), msg, envelope, contract))
        self._tails[key] = task
        task.add_done_callback(lambda t: self._tails.pop(key) if self._tails.get(key) is t else None)

    async def _run_after(self, previous: asyncio.Task[None] | None, msg: Msg, envelope: Envelope, contract: Contract) -> None:
        if previous is not None:
            await asyncio.wait({previous})
        progress = asyncio.create_task(self._report_progress(msg))
        try:
            await self._run(msg, envelope, contract)
        finally:
            progress.cancel()

    async def _report_progress(self, msg: Msg) -> None:
        """Tell JetStream a long handler is still at work, so it does not redeliver meanwhile."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def stop(self) -> None:
        """Cancel keyed handlers still running; their messages are redelivered later, unacked."""
        tasks = list(self._tails.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _run(self, msg: Msg, envelope: Envelope, contract: Contract) -> None:
        with self.telemetry.consume_span(f"{self.durable} {envelope.type}", msg.headers or {}):
            try:
                await self.handler(envelope, contract)
            except Exception as exc:
                await self._failed(msg, envelope, exc)
                return
        try:
            await msg.ack()
        except Exception as exc:  # the effect is committed: a redelivery finds it and does nothing again
            log.warning("%s: %s handled but not acked (%s); a redelivery will find it done",
                        self.durable, envelope.type, describe(exc))
        self.stats.handled += 1

    async def _failed(self, msg: Msg, envelope: Envelope, exc: Exception) -> None:
        """A handler failed: try again later; set the message aside only if it keeps failing by itself.

        A failure because Postgres or NATS is away says nothing about the message: it is
        retried for as long as the outage lasts, never dead-lettered, at most
        TRANSIENT_RETRY_CAP_S apart so it runs soon after the server is back.
        """
        delivered = msg.metadata.num_delivered if msg.metadata else 1
        transient = is_transient(exc)
        if not transient and delivered >= self.max_deliver:
            await self.dead_letter(msg, f"handler failed {delivered} times: {exc!r}")
            return
        self.stats.retried += 1
        if not transient:
            log.warning("%s: %s failed (delivery %d), will retry: %r", self.durable, envelope.type, delivered, exc)
        elif delivered == 1 or delivered % 20 == 0:
            log.warning("%s: %s waits for its server (delivery %d): %s", self.durable, envelope.type, delivered,
                        describe(exc))
        delay = min(0.2 * 2**delivered, TRANSIENT_RETRY_CAP_S if transient else 5.0)
        with contextlib.suppress(Exception):  # unacked, it comes back after ack_wait anyway
            await msg.nak(delay=delay)

    async def dead_letter(self, msg: Msg, reason: str) -> None:
        """Keep the message with its reason, then stop its redelivery."""
        headers = {
            h.DLQ_REASON: reason[:4000],
            h.DLQ_SUBJECT: msg.subject,
            h.DLQ_CONSUMER: self.durable,
        }
        if msg.metadata:
            headers[h.DLQ_SEQUENCE] = str(msg.metadata.sequence.stream)
            headers[h.MSG_ID] = f"dlq:{self.stream}:{msg.metadata.sequence.stream}"
        await self.js.publish(self.subjects.dead_letter(self.durable), msg.data, headers=headers)
        await msg.term()
        self.stats.dead_lettered += 1
        log.error("%s: dead-lettered message on %s: %s", self.durable, msg.subject, reason)
