"""Who may do what on the bus: each role's publish and subscribe allow-lists, derived from what its code does.

A role's list names every subject its code publishes or subscribes to, and the
JetStream API calls it makes (`$JS.API.<call>.<stream>...`), each narrowed to the
streams, consumers and keys it touches. docs/security.md says what each role can
and cannot do with them; docs/bus.md where every subject and stream is.

| role | publishes | reads |
| --- | --- | --- |
| gateway | metric windows, demand, per-key usage | events (wake-ups), windows, usage, heartbeats, outlooks |
| autoscaler | commands (placement, workers'), its outlook; declares every stream | heartbeats, windows, demand, operators' commands |
| placement | workers' instance commands | placement requests |
| relay | events | - |
| projector | - | events |
| worker `<id>` | its own heartbeat | its own instance commands |
| operator | - (declares every stream: `modelpool migrate`) | heartbeats, outlooks, windows, events, dead letters |

Only the autoscaler and the operator declare streams: a stream's configuration
can make the server itself publish (a republish, a source's subject transform),
on any subject, bypassing the user's permissions, so declaring a stream is as
good as publishing commands. The others wait for the streams they need
(`required_streams`); `modelpool migrate` declares them before any service starts.

A worker's user is `worker-<id>`, its rights naming its own id only, where the
worker ids are known when the users are made (`modelpool up`, compose). A user
named just `worker` stands for workers whose ids are not known in advance
(Kubernetes' DaemonSet names them after their nodes): it may do what any one
worker may, for every worker id.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.bus.auth import inbox_prefix
from shared.bus.subjects import Subjects

API = "$JS.API"

ROLES = ("gateway", "autoscaler", "placement", "relay", "projector", "worker", "operator")
"""Every role on the bus; services are named after theirs, and the command-line tools are the operator."""

DECLARING_ROLES = frozenset({"autoscaler", "operator"})
"""Roles that declare the namespace's streams and buckets (see the module's doc for why only these)."""

SHARED_WORKER = "worker"
"""The user of workers whose ids are not known when the users are made."""


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def user_name(role: str, worker_id: str | None = None) -> str:
    """The NATS user of a role: the role's name, or `worker-<id>` for one worker."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; the roles are {', '.join(ROLES)}")
    return f"worker-{worker_id}" if role == "worker" and worker_id else role


def required_streams(role: str, subjects: Subjects) -> tuple[str, ...]:
    """The streams a role that does not declare them waits for before it starts: those it consumes from."""
    return {
        "worker": (subjects.commands_stream,),
        "placement": (subjects.commands_stream,),
        "projector": (subjects.events_stream,),
        "relay": (subjects.events_stream,),
    }.get(role, ())


def _stream_info(*streams: str) -> list[str]:
    return [f"{API}.STREAM.INFO.{s}" for s in streams]


def _declare(subjects: Subjects) -> list[str]:
    """Create and update every stream and bucket of the namespace (and read their configuration)."""
    return [f"{API}.STREAM.{call}.{stream}" for stream in subjects.all_streams for call in ("INFO", "CREATE", "UPDATE")]


def _durable(stream: str, consumer: str, filter_subject: str) -> list[str]:
    """A durable pull consumer's life (`shared.bus.jetstream.Consumer`): look it up, create it with its own filter,
    fetch from it, acknowledge (ack, nak, in progress, term) what it delivered."""
    return [f"{API}.CONSUMER.INFO.{stream}.{consumer}",
            f"{API}.CONSUMER.CREATE.{stream}.{consumer}.{filter_subject}",
            f"{API}.CONSUMER.MSG.NEXT.{stream}.{consumer}",
            f"$JS.ACK.{stream}.{consumer}.>"]


def _ordered(stream: str) -> list[str]:
    """An ordered push consumer (a key-value watch, a window follower): created without a name, its flow control
    answered; a watch also finds its stream by subject and asks how much it holds."""
    return [f"{API}.STREAM.NAMES", f"{API}.CONSUMER.CREATE.{stream}", f"{API}.CONSUMER.INFO.{stream}.*",
            f"$JS.FC.{stream}.>"]


def _kv(bucket: str) -> str:
    return f"KV_{bucket}"


def permissions(subjects: Subjects, role: str, worker_id: str | None = None) -> Permissions:
    """What `role`'s user may publish and subscribe to (for `worker`: one worker's, or with no id every worker's)."""
    s = subjects
    ns = s.namespace
    user = user_name(role, worker_id)
    publish: list[str]
    subscribe: list[str] = []
    heartbeats, control = _kv(s.heartbeats_bucket), _kv(s.control_bucket)
    if role == "relay":
        publish = [*_stream_info(s.events_stream), s.all_events]
    elif role == "projector":
        publish = [*_stream_info(s.events_stream), *_durable(s.events_stream, "projector", s.all_events),
                   s.dead_letter("projector")]
    elif role == "placement":
        publish = [*_stream_info(s.commands_stream), *_durable(s.commands_stream, "placement", s.placement_commands),
                   s.dead_letter("placement"), s.worker_commands("*")]
    elif role == "worker":
        # One worker: its own consumer, dead letters and heartbeat key; the shared user: any worker's.
        name = f"worker-{worker_id}" if worker_id else "*"
        filter_subject = s.worker_commands(worker_id or "*")
        publish = [*_stream_info(s.commands_stream, heartbeats), *_durable(s.commands_stream, name, filter_subject),
                   s.dead_letter(name), f"$KV.{s.heartbeats_bucket}.{worker_id or '*'}"]
    elif role == "gateway":
        # Reads (admin API, console): heartbeats and outlooks by watching them, windows by following them.
        publish = [s.windows_of("*"), s.demand, s.usage_of("*"), s.dead_letter("telemetry"),
                   *_stream_info(s.windows_stream, heartbeats, control), *_ordered(s.windows_stream),
                   *_ordered(heartbeats), *_ordered(control)]
        subscribe = [s.all_events, s.all_usage]
    elif role == "autoscaler":
        publish = [*_declare(s), s.placement_commands, s.worker_commands("*"),
                   f"$KV.{s.control_bucket}.*", f"{API}.STREAM.MSG.GET.{heartbeats}",
                   *_ordered(heartbeats), *_ordered(s.windows_stream), s.dead_letter("telemetry")]
        subscribe = [s.demand, s.event("alias:", "OperatorCommanded")]
    elif role == "operator":
        # `modelpool status`, `top`, `history --plot`; and the `nats` CLI's listing and reading of dead letters.
        publish = [*_declare(s), *_ordered(heartbeats), *_ordered(control), *_ordered(s.windows_stream),
                   s.dead_letter("telemetry"), f"{API}.STREAM.LIST", *_ordered(s.dlq_stream)]
        subscribe = [s.all_events, f"{ns}.tel.>"]
    else:
        raise ValueError(f"unknown role {role!r}; the roles are {', '.join(ROLES)}")
    return Permissions(tuple(dict.fromkeys(publish)), (f"{inbox_prefix(user)}.>", *subscribe))
