"""The OpenAI HTTP protocol, defined once for the gateway and every engine.

Fields follow OpenAI's documented order; modelpool's extensions sit in a marked
section at the end of each model. Unknown request fields are kept (clients send
vendor extras) but logged once per field name, never silently dropped.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

log = logging.getLogger(__name__)

ENGINE_HEADER = "x-modelpool-engine"
"""Response header naming the engine that served a request (`llama.cpp`, `vllm`, `simulated-vllm`, ...)."""
SESSION_TAG_HEADER = "x-modelpool-session"
"""Request header from the gateway to an engine: the session a request belongs to, which an engine that moves KV
keeps on the request's cache entry (an export names the session it takes)."""


# --------------------------------------------------------------------------- errors


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class APIError(Exception):
    """An error that reaches the client as OpenAI-style JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return self.body.model_dump()


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def not_found_model(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def too_many_requests(message: str, retry_after_s: float) -> APIError:
    return APIError(
        429,
        message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(max(1, int(round(retry_after_s))))},
    )


def request_timeout(message: str) -> APIError:
    return APIError(408, message, type="timeout_error", code="request_timeout")


def service_unavailable(message: str, *, code: str = "service_unavailable") -> APIError:
    return APIError(503, message, type="service_unavailable_error", code=code)


def internal_error(message: str) -> APIError:
    return APIError(500, message, type="internal_error", code="internal_error")


def validation_error(exc: ValidationError) -> APIError:
    """Turn a pydantic validation failure into a 400 naming the first offending field."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "__root__") or None
    return bad_request(f"{param + ': ' if param else ''}{first.get('msg', 'invalid value')}", param=param)


# --------------------------------------------------------------------------- requests


_logged_unknown_fields: set[str] = set()


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> "_Request":
        for name in (self.model_extra or {}).keys() - _logged_unknown_fields:
            _logged_unknown_fields.add(name)
            log.info("ignoring unsupported request field %r", name)
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text; multi-part content keeps its text parts in order."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class _SamplingParams(_Request):
    """Sampling fields shared by chat and text completions."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)
    """Choices to generate; an engine that answers only one refuses more with its own 400."""
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # added for the llama.cpp engine (OpenAI's own field): token id -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    # --- modelpool / engine extensions -------------------------------------
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    session_id: str | None = None
    """Conversation key for session-affinity routing (also read from the `x-session-id` header)."""

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @model_validator(mode="after")
    def _check_stream_options(self) -> "_SamplingParams":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingParams):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    # --- vLLM's chat template extensions -----------------------------------
    add_generation_prompt: bool = True
    """Open an assistant turn after the messages (the usual case)."""
    continue_final_message: bool = False
    """Leave the final (assistant) message open and go on writing it: the gateway resumes a broken stream so."""

    @model_validator(mode="after")
    def _one_way_to_end(self) -> "ChatCompletionRequest":
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the final message to be the assistant's")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingParams):
    model: str
    prompt: str | list[str] | list[int]
    echo: bool = False

    @model_validator(mode="after")
    def _single_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ValueError("only one prompt per request is supported")
        return self

    def output_limit(self) -> int | None:
        return self.max_tokens

    def prompt_text(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt  # str, or token ids


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length", "abort"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> "Usage":
        details = PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens is not None else None
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    """modelpool puts the serving engine here (e.g. `llama.cpp`, `simulated-vllm`)."""


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class BackendCard(BaseModel):
    """One backend of a pool alias, as the gateway lists it."""

    engine: str
    simulated: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "modelpool"
    # --- modelpool extensions ----------------------------------------------
    engine: str | None = None
    """The engine behind this model (`llama.cpp`, `vllm`, `simulated-vllm`, ...); several, comma-separated."""
    simulated: bool = False
    """True when no real inference happens (the simulator engine) on any of its backends."""
    max_model_len: int | None = None
    routing_state: str | None = None
    """The pool alias's routing state (the gateway's listing only)."""
    backends: dict[str, BackendCard] | None = None
    """The pool alias's backends by name, each with its engine and whether it is simulated (the gateway's listing only)."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --------------------------------------------------------------------------- streaming


def sse(payload: BaseModel | dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON payload."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude_none=True)
    else:
        import json

        body = json.dumps(payload, separators=(",", ":"))
    return b"data: " + body.encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
