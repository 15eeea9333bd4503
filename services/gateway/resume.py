"""Carrying a stream on when its instance breaks mid-answer: another instance of the same backend writes the rest.

A client that has received half an answer cannot be given a new one; it can be
given the rest of this one. `StreamTranscript` keeps what the client has been
sent of a streamed answer (the text, the chunks, the stream's identity) and,
when the engine's stream breaks, builds the request that asks another instance
to go on writing from there: for chat, the text so far as an open assistant
message (`continue_final_message`, vLLM's extension, which modelpool's engines
also take); for text completions, the prompt with the text so far appended.
The continuation's events are then rewritten to read as the same stream: its
opening role chunk dropped, its id, creation time and model those of the first
events, its usage counting every token the client received.

Answers that cannot be carried on this way are not: several choices (`n`), tool
calls, echoed or tokenised prompts. Those end with an error event, as before.
"""

from __future__ import annotations

from typing import Any

import orjson

from services.gateway.edge import CHAT

_EVENT_END = b"\n\n"
_DATA = b"data: "
_IDENTITY = ("id", "created", "model", "system_fingerprint")


class StreamTranscript:
    """What the client has been sent of one streamed answer, and how to ask for the rest."""

    def __init__(self, path: str, body: dict[str, Any]) -> None:
        self.path = path
        self.body = body
        self.text: list[str] = []
        self.chunks = 0
        """Content chunks relayed: the tokens the client has (one per chunk, as engines stream them)."""
        self.identity: dict[str, Any] = {}
        self.finished = False
        """A choice's finish_reason was relayed: the answer is whole (only its usage or [DONE] may be missing)."""
        self.resumable = _resumable_request(path, body)
        self.continuing = False

    # ------------------------------------------------------------------ following the stream

    def relay(self, events: bytes) -> bytes:
        """Note what these whole events tell the client; on a continuation, rewrite them to read as the first stream."""
        out: list[bytes] = []
        for event in events.split(_EVENT_END):
            if not event.startswith(_DATA) or event == b"data: [DONE]":
                out.append(event)
                continue
            try:
                payload = orjson.loads(event[len(_DATA):])
            except orjson.JSONDecodeError:
                out.append(event)
                continue
            if not isinstance(payload, dict):
                out.append(event)
                continue
            if self.continuing:
                payload = self._as_first_stream(payload)
                if payload is None:
                    continue
                event = _DATA + orjson.dumps(payload)
            self._note(payload)
            out.append(event)
        return _EVENT_END.join(out)

    def _note(self, payload: dict[str, Any]) -> None:
        if not self.identity:
            self.identity = {key: payload[key] for key in _IDENTITY if key in payload}
        for choice in payload.get("choices") or ():
            if choice.get("index", 0) != 0:
                self.resumable = False
                continue
            delta = choice.get("delta") if self.path == CHAT else choice
            delta = delta or {}
            if delta.get("tool_calls") or delta.get("function_call"):
                self.resumable = False
            piece = delta.get("content") if self.path == CHAT else delta.get("text")
            if piece:
                self.text.append(piece)
                self.chunks += 1
            if choice.get("finish_reason"):
                self.finished = True

    def _as_first_stream(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        """A continuation's event as a later event of the first stream; None for its opening role-only chunk."""
        choices = payload.get("choices") or []
        if self.path == CHAT and choices and all(_opens_only(c) for c in choices):
            return None
        payload.update(self.identity)
        usage = payload.get("usage")
        if isinstance(usage, dict):
            # The continuation counted the text so far as prompt; the client received it as completion.
            carried = min(self.chunks_before, int(usage.get("prompt_tokens") or 0))
            usage["prompt_tokens"] = int(usage.get("prompt_tokens") or 0) - carried
            usage["completion_tokens"] = int(usage.get("completion_tokens") or 0) + carried
        return payload

    # ------------------------------------------------------------------ asking for the rest

    def continuation(self) -> dict[str, Any] | None:
        """The request body that asks another instance for the rest of this answer; None if it cannot be asked."""
        if not self.resumable or self.finished:
            return None
        body = dict(self.body)
        so_far = "".join(self.text)
        limit_key = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k)), None)
        if limit_key is not None:
            left = int(body[limit_key]) - self.chunks
            if left < 1:
                return None  # the limit is reached: the answer is whole but for its end
            body[limit_key] = left
        if self.path == CHAT:
            if so_far:
                body["messages"] = [*body["messages"], {"role": "assistant", "content": so_far}]
                body["continue_final_message"], body["add_generation_prompt"] = True, False
        else:
            body["prompt"] = _prompt_text(body["prompt"]) + so_far
        self.continuing = True
        self.chunks_before = self.chunks
        return body

    chunks_before = 0
    """Content chunks the client had when the current continuation began."""


def _opens_only(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    return not choice.get("finish_reason") and not delta.get("content") and not delta.get("tool_calls") \
        and set(delta) <= {"role", "content", "reasoning_content"}


def _prompt_text(prompt: Any) -> str:
    return prompt[0] if isinstance(prompt, list) else prompt


def _resumable_request(path: str, body: dict[str, Any]) -> bool:
    if (body.get("n") or 1) != 1:
        return False
    if path == CHAT:
        return not body.get("continue_final_message") and not body.get("tools") and not body.get("functions")
    prompt = body.get("prompt")
    one_text = isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str))
    return one_text and not body.get("echo") and not body.get("suffix")
