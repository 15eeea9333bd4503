"""What travels between the HTTP edge, the scheduler and the decode thread."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple


class RequestState(enum.StrEnum):
    """Seed 003's request states, plus the two ends it leaves implicit.

    QUEUED: in the RequestQueue, not yet in the running set.
    PENDING: in the running set, waiting for a sequence id / a batch.
    PROCESSING: holds a sequence id and is decoded every step.
    COMPLETED / TIMEOUT / FAILED: seed 003's terminal states.
    CANCELLED: the client went away; everything is freed like a timeout.
    """

    QUEUED = "QUEUED"
    PENDING = "PENDING"
    PROCESSING = "PROCESSING"
    COMPLETED = "COMPLETED"
    TIMEOUT = "TIMEOUT"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({RequestState.COMPLETED, RequestState.TIMEOUT, RequestState.FAILED, RequestState.CANCELLED})


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


class TokenEvent(NamedTuple):
    """New text of a request (may be empty while a stop sequence is still undecided); a named tuple, made once per
    token on the decode thread."""

    text: str
    n_generated: int


@dataclass(frozen=True)
class FinishEvent:
    state: RequestState
    finish_reason: str | None
    """`stop` / `length` for COMPLETED, None otherwise."""
    text: str
    """Text released with this event (held back stop-sequence candidates that turned out not to match)."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    message: str = ""


EngineEvent = TokenEvent | FinishEvent
EventSink = Callable[[EngineEvent], None]
"""Called from the decode thread; must be thread-safe and must not block."""


@dataclass
class GenerationRequest:
    request_id: int
    prompt_tokens: list[int]
    sampling: SamplingParams
    sink: EventSink
    arrived_at: float
    reuse_prefix: bool = True
    """False: compute the whole prompt even if a cached prefix matches (llama.cpp's `cache_prompt`)."""
    session: str = ""
    """The gateway's session key (`x-modelpool-session`), kept on the request's KV entry for exports by session."""


@dataclass
class Tracked:
    """The scheduler's record of one request."""

    request: GenerationRequest
    state: RequestState = RequestState.QUEUED
    seq_id: int | None = None
    running_since: float | None = None
    cached_tokens: int = 0
    """Prompt tokens whose KV was reused from an earlier request."""
    n_prefilled: int = 0
    """Prompt tokens already in the KV cache (cached ones included)."""
    generated: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def prefill_done(self) -> bool:
        return self.n_prefilled >= len(self.request.prompt_tokens)
