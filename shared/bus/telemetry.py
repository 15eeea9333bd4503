"""Telemetry on the bus: heartbeats, metric windows, demand and the controller's outlook.

Each kind travels the way its use asks for (docs/bus.md says why):

- heartbeats (with every instance's status) and the controller's outlook are
  *latest values*: a key-value bucket keeps one entry per worker or alias, in
  memory, with a TTL, so a new leader or `modelpool status` reads the current
  picture at once and nothing outlives its usefulness;
- gateway metric windows are a *time series*: a stream with a 24 h max age
  (and a size cap) lets the controller take the newest window of every gateway
  and `modelpool history --plot` draw a day of load;
- demand for a cold alias is an *interrupt*: a core NATS message, not stored,
  sent again every second while requests wait;
- the API keys' use is *gossip* between gateway replicas: each sends its last
  minute every second as a core NATS message, not stored (a replica that
  starts learns the others' within a second).

Every message is a versioned contract in the usual envelope. One that does not
parse goes to the dead-letter stream with its reason and is otherwise ignored.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoStreamResponseError, NotFoundError
from nats.js.kv import KeyValue
from pydantic import ValidationError

from shared.bus import subjects as h
from shared.bus.subjects import Subjects
from shared.contracts.messages import Envelope, InvalidMessage, UnknownMessageType
from shared.contracts.telemetry import (
    ControlOutlook,
    DemandSignal,
    GatewayWindow,
    UsageReport,
    TelemetryMessage,
    WorkerHeartbeat,
    telemetry_registry,
)
from shared.faults import Backoff, Outage

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 120.0
"""Heartbeats vanish this long after a worker's last one; liveness uses the heartbeat's own time."""
OUTLOOK_TTL_S = 120.0
WINDOWS_MAX_AGE_S = 24 * 3600.0
WINDOWS_MAX_BYTES = 256 * 1024 * 1024

T = TypeVar("T", bound=TelemetryMessage)


def alias_key(alias: str) -> str:
    """A key-value key for an alias name, whatever characters the name holds."""
    return base64.urlsafe_b64encode(alias.encode()).decode().rstrip("=")


class TelemetryBus:
    """Publishing and reading telemetry for one namespace.

    `declares`: whether this process may declare the buckets and the windows stream
    (`shared/bus/permissions.py`: on a bus with users, only the autoscaler and the
    operator's commands may). One that may not binds to what is there when it first
    needs it, and binds again after a failure: a bucket a restarted server lost
    comes back when a declaring process declares it again.
    """

    def __init__(self, nc: NATS, js: JetStreamContext, subjects: Subjects, *, declares: bool = True) -> None:
        self.nc = nc
        self.js = js
        self.subjects = subjects
        self.declares = declares
        self.registry = telemetry_registry()
        self._buckets: dict[str, KeyValue] = {}
        self._replicas: int | None = None
        """The pool's setting, once `ensure` was given it: what a bucket declared again is kept on."""

    async def ensure(self, replicas: int | None = None) -> None:
        """Declare the buckets and the windows stream (idempotent), each kept on `replicas` servers. A reader
        that does not know the pool's setting (None) creates what is missing on one and changes nothing else.
        A process that does not declare only forgets its bindings, to bind again at its next use."""
        if not self.declares:
            self._buckets.clear()
            return
        if replicas is not None:
            self._replicas = replicas
        self._buckets[self.subjects.heartbeats_bucket] = await self._bucket(
            self.subjects.heartbeats_bucket, HEARTBEAT_TTL_S, replicas)
        self._buckets[self.subjects.control_bucket] = await self._bucket(
            self.subjects.control_bucket, OUTLOOK_TTL_S, replicas)
        config = StreamConfig(
            name=self.subjects.windows_stream,
            subjects=[self.subjects.all_windows],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=WINDOWS_MAX_AGE_S,
            max_bytes=WINDOWS_MAX_BYTES,
            discard=DiscardPolicy.OLD,
            num_replicas=replicas or 1,
        )
        try:
            await self._keep_replicas(config.name, replicas)
        except NotFoundError:
            await self.js.add_stream(config)

    async def _bucket(self, name: str, ttl_s: float, replicas: int | None) -> KeyValue:
        try:
            bucket = await self.js.key_value(name)
        except BucketNotFoundError:
            return await self.js.create_key_value(KeyValueConfig(
                bucket=name, history=1, ttl=ttl_s, storage=StorageType.MEMORY, replicas=replicas or 1))
        await self._keep_replicas(f"KV_{name}", replicas)
        return bucket

    async def _bound(self, name: str) -> KeyValue:
        """The bucket `name`, declared (or bound, by a process that does not declare) at its first use."""
        bucket = self._buckets.get(name)
        if bucket is None:
            if self.declares:
                await self.ensure(self._replicas)
                return self._buckets[name]
            bucket = self._buckets[name] = await self.js.key_value(name)
        return bucket

    async def _keep_replicas(self, stream: str, replicas: int | None) -> None:
        """An existing stream's copies changed to `replicas` (the pool's setting was raised or lowered)."""
        config = (await self.js.stream_info(stream)).config
        if replicas is not None and config.num_replicas != replicas:
            await self.js.update_stream(dataclasses.replace(config, num_replicas=replicas))

    # ------------------------------------------------------------------ encoding

    def _encode(self, message: TelemetryMessage) -> bytes:
        return Envelope.wrap(message).model_dump_json().encode()

    async def _decode(self, data: bytes, kind: type[T], where: str) -> T | None:
        try:
            envelope = Envelope.model_validate_json(data)
            message = self.registry.decode(envelope)
        except (ValidationError, InvalidMessage, UnknownMessageType, ValueError) as exc:
            await self._dead_letter(data, where, f"invalid telemetry: {exc}")
            return None
        if not isinstance(message, kind):
            await self._dead_letter(data, where, f"expected {kind.TYPE}, got {envelope.type}")
            return None
        return message

    async def _dead_letter(self, data: bytes, where: str, reason: str) -> None:
        log.warning("telemetry on %s refused: %s", where, reason)
        with contextlib.suppress(Exception):
            await self.js.publish(self.subjects.dead_letter("telemetry"), data,
                                  headers={h.DLQ_REASON: reason[:4000], h.DLQ_SUBJECT: where, h.DLQ_CONSUMER: "telemetry"})

    # ------------------------------------------------------------------ heartbeats

    async def put_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        await self._put(self.subjects.heartbeats_bucket, heartbeat.worker_id, self._encode(heartbeat))

    async def heartbeat_of(self, worker_id: str) -> WorkerHeartbeat | None:
        """A worker's latest heartbeat read now from the bucket (not from a watch), or None if it has none."""
        try:
            entry = await (await self._bound(self.subjects.heartbeats_bucket)).get(worker_id)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return await self._decode(entry.value, WorkerHeartbeat, f"{self.subjects.heartbeats_bucket}.{worker_id}")

    async def heartbeats(self) -> dict[str, WorkerHeartbeat]:
        """The latest heartbeat of every worker heard from within the bucket's TTL."""
        try:
            heartbeats = await self._bound(self.subjects.heartbeats_bucket)
        except BucketNotFoundError:  # not declared yet (or lost with a server's restart): nobody heard from
            return {}
        return {hb.worker_id: hb for hb in await self._latest(heartbeats, WorkerHeartbeat)}

    async def watch_heartbeats(self, on_heartbeat: Callable[[WorkerHeartbeat], None], stop: asyncio.Event) -> None:
        await self._watch(self.subjects.heartbeats_bucket, WorkerHeartbeat, on_heartbeat, stop)

    # ------------------------------------------------------------------ controller outlook

    async def put_outlook(self, outlook: ControlOutlook) -> None:
        await self._put(self.subjects.control_bucket, alias_key(outlook.alias), self._encode(outlook))

    async def outlooks(self) -> dict[str, ControlOutlook]:
        try:
            control = await self._bound(self.subjects.control_bucket)
        except BucketNotFoundError:
            return {}
        return {o.alias: o for o in await self._latest(control, ControlOutlook)}

    # ------------------------------------------------------------------ metric windows

    async def publish_window(self, window: GatewayWindow) -> None:
        await self.js.publish(self.subjects.windows_of(window.gateway_id), self._encode(window))

    async def follow_windows(self, on_window: Callable[[GatewayWindow], Awaitable[None] | None], stop: asyncio.Event) -> None:
        """Every gateway's latest window, then each new one, until `stop` is set.

        Followed afresh after a reconnection or a failure, from each gateway's latest
        window again: a restarted server may have lost or renumbered what was followed.
        """
        config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        outage, backoff = Outage("following the gateways' metric windows", log), Backoff(cap_s=2.0)
        while not stop.is_set():
            queue: asyncio.Queue[Msg] = asyncio.Queue(maxsize=10_000)

            async def enqueue(msg: Msg) -> None:
                with contextlib.suppress(asyncio.QueueFull):  # a stalled reader drops the newest news, not the process
                    queue.put_nowait(msg)

            reconnects = self.nc.stats["reconnects"]
            sub = None
            try:
                sub = await self.js.subscribe(self.subjects.all_windows, stream=self.subjects.windows_stream,
                                              ordered_consumer=True, config=config, cb=enqueue)
                outage.succeeded()
                backoff.reset()
                while not stop.is_set() and self.nc.stats["reconnects"] == reconnects:
                    with contextlib.suppress(asyncio.TimeoutError):
                        msg = await asyncio.wait_for(queue.get(), 0.5)
                        window = await self._decode(msg.data, GatewayWindow, msg.subject)
                        if window is not None:
                            result = on_window(window)
                            if isinstance(result, Awaitable):
                                await result
            except Exception as exc:
                outage.failed(exc)
                await backoff.wait(stop)
            finally:
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()

    async def read_windows(self, since: datetime, until: datetime | None = None, alias: str | None = None) -> list[GatewayWindow]:
        """Stored windows that ended in [since, until], oldest first (what the 24 h stream still holds)."""
        # nats-py cannot parse the server's echo of a start time in whole seconds (it wants a fraction):
        # starting a microsecond earlier reads nothing more, as windows are filtered on their end below.
        start = since - timedelta(microseconds=1) if since.microsecond == 0 else since
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME,
                                opt_start_time=start.astimezone(timezone.utc).isoformat().replace("+00:00", "Z"))
        # A push consumer, not a pull one: a pull request's messages go to whatever reply subject the requester
        # names, so a reader allowed to pull from the windows (the gateway, which writes them) could hand them
        # to any subject a stream captures (docs/security.md).
        sub = await self.js.subscribe(self.subjects.all_windows, stream=self.subjects.windows_stream,
                                      ordered_consumer=True, config=config)
        found: list[GatewayWindow] = []
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except (NatsTimeout, asyncio.TimeoutError):
                    break
                window = await self._decode(msg.data, GatewayWindow, msg.subject)
                if window and (alias is None or window.alias == alias) and since <= window.window_end \
                        and (until is None or window.window_end <= until):
                    found.append(window)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return found

    # ------------------------------------------------------------------ demand

    async def publish_demand(self, demand: DemandSignal) -> None:
        await self.nc.publish(self.subjects.demand, self._encode(demand))

    async def subscribe_demand(self, on_demand: Callable[[DemandSignal], None]):
        async def receive(msg: Msg) -> None:
            demand = await self._decode(msg.data, DemandSignal, msg.subject)
            if demand is not None:
                on_demand(demand)

        return await self.nc.subscribe(self.subjects.demand, cb=receive)

    # ------------------------------------------------------------------ API keys' use

    async def publish_usage(self, report: UsageReport) -> None:
        await self.nc.publish(self.subjects.usage_of(report.gateway_id), self._encode(report))

    async def subscribe_usage(self, on_report: Callable[[UsageReport], None]):
        async def receive(msg: Msg) -> None:
            report = await self._decode(msg.data, UsageReport, msg.subject)
            if report is not None:
                on_report(report)

        return await self.nc.subscribe(self.subjects.all_usage, cb=receive)

    # ------------------------------------------------------------------ key-value helpers

    async def _latest(self, kv: KeyValue, kind: type[T]) -> list[T]:
        watcher = await kv.watchall()
        found: list[T] = []
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=2.0)
                except NatsTimeout:
                    break
                if entry is None:  # the watcher's "nothing more stored" marker
                    break
                if entry.value and entry.operation is None:
                    message = await self._decode(entry.value, kind, f"{kv._name}.{entry.key}")
                    if message is not None:
                        found.append(message)
        finally:
            await watcher.stop()
        return found

    async def _watch(self, bucket: str, kind: type[T], on_message: Callable[[T], None], stop: asyncio.Event) -> None:
        """Each key's current value, then every change, until `stop`; watched afresh after a reconnection or a failure."""
        outage, backoff = Outage(f"watching {bucket}", log), Backoff(cap_s=2.0)
        while not stop.is_set():
            reconnects = self.nc.stats["reconnects"]
            watcher = None
            try:
                kv = await self._bound(bucket)
                watcher = await kv.watchall()
                outage.succeeded()
                backoff.reset()
                while not stop.is_set() and self.nc.stats["reconnects"] == reconnects:
                    try:
                        entry = await watcher.updates(timeout=0.5)
                    except NatsTimeout:
                        continue
                    if entry is None or not entry.value or entry.operation is not None:
                        continue
                    message = await self._decode(entry.value, kind, f"{kv._name}.{entry.key}")
                    if message is not None:
                        on_message(message)
            except Exception as exc:
                outage.failed(exc)
                self._buckets.pop(bucket, None)  # bound afresh: a restarted server may have lost it
                await backoff.wait(stop)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()

    async def _put(self, bucket: str, key: str, value: bytes) -> None:
        """Put a latest value; a bucket a restarted server lost is declared (or bound) again first."""
        try:
            await (await self._bound(bucket)).put(key, value)
        except (NoRespondersError, NoStreamResponseError, NotFoundError, BucketNotFoundError):
            self._buckets.pop(bucket, None)
            await (await self._bound(bucket)).put(key, value)
