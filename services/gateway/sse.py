"""Reading an engine's answer as it passes through: content chunks and usage, without parsing every chunk.

A stream is cut at event boundaries (a blank line) and its content chunks are
counted by substring: an OpenAI chunk carries at most one `"content":"` (chat)
or `"text":"` (completions), and an empty one (`""`, the role or finish chunk)
is not a token. Only the one event that carries `usage` is parsed, to read the
token counts and, when the gateway asked for usage on the client's behalf, to
take it out again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    from services.gateway.resume import StreamTranscript

_CONTENT_KEYS = (b'"content":"', b'"text":"', b'"content": "', b'"text": "')
_USAGE_KEYS = (b'"usage":{', b'"usage": {')
_EVENT_END = b"\n\n"
_DONE = b"data: [DONE]"

Usage = tuple[int, int]
"""(prompt tokens, completion tokens)."""


def content_chunks(events: bytes) -> int:
    """How many of these complete events carry non-empty content."""
    n = 0
    for key in _CONTENT_KEYS:
        found = events.count(key)
        if found:
            n += found - events.count(key + b'"')
    return n


def _usage(payload: dict) -> Usage | None:
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def usage_of_body(body: bytes) -> Usage | None:
    """The usage of a whole (non-streamed) answer, if it has one."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return _usage(payload) if isinstance(payload, dict) else None


class EventScanner:
    """Cuts an upstream SSE byte stream into whole events, counting content and taking out usage.

    With a `transcript`, every whole event goes through it first (it notes what the
    client is sent, and rewrites the events of a stream carried on elsewhere).
    """

    def __init__(self, keep_usage: bool, transcript: "StreamTranscript | None" = None) -> None:
        self.keep_usage = keep_usage
        self.transcript = transcript
        self.usage: Usage | None = None
        self.ended = False
        """The stream's `data: [DONE]` went through."""
        self._partial = b""

    def feed(self, data: bytes) -> tuple[bytes, int]:
        """The whole events completed by `data` (to pass on) and how many carry content."""
        data = self._partial + data if self._partial else data
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._partial = data
            return b"", 0
        end += len(_EVENT_END)
        events, self._partial = data[:end], data[end:]
        return self._scan(events)

    def flush(self) -> tuple[bytes, int]:
        """Whatever the engine sent after its last blank line."""
        events, self._partial = self._partial, b""
        return self._scan(events) if events else (b"", 0)

    def drop_partial(self) -> None:
        """Forget an event cut short: its stream broke, and the client never saw any of it."""
        self._partial = b""

    def _scan(self, events: bytes) -> tuple[bytes, int]:
        if self.transcript is not None:
            events = self.transcript.relay(events)
        if _DONE in events:
            self.ended = True
        chunks = content_chunks(events)
        if any(key in events for key in _USAGE_KEYS):
            events = self._take_usage(events)
        return events, chunks

    def _take_usage(self, events: bytes) -> bytes:
        out: list[bytes] = []
        for event in events.split(_EVENT_END):
            if not any(key in event for key in _USAGE_KEYS):
                out.append(event)
                continue
            try:
                payload = orjson.loads(event[event.index(b"{"):])
            except (ValueError, orjson.JSONDecodeError):
                out.append(event)  # not ours to judge: pass it on as it came
                continue
            self.usage = _usage(payload) or self.usage
            if self.keep_usage:
                out.append(event)
            elif payload.get("choices"):
                # Usage riding on a chunk with content: keep the chunk, drop only what the client did not ask for.
                del payload["usage"]
                out.append(b"data: " + orjson.dumps(payload))
        return _EVENT_END.join(out)
