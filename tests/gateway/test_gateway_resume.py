"""Carrying a broken stream on: what the next instance is asked, and how its events read as the first stream's."""

from __future__ import annotations

import orjson
import pytest

from services.engines.llamacpp.chat_template import ChatTemplate
from services.gateway.edge import CHAT, COMPLETIONS
from services.gateway.resume import StreamTranscript
from shared.openai_protocol import ChatCompletionRequest


def events(*payloads) -> bytes:
    return b"".join(b"data: " + (p if isinstance(p, bytes) else orjson.dumps(p)) + b"\n\n" for p in payloads)


def chunk(content=None, role=None, finish=None, id="chatcmpl-1", created=100, **delta_extra) -> dict:
    delta = {k: v for k, v in {"role": role, "content": content, **delta_extra}.items() if v is not None}
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}


def test_a_chat_stream_is_asked_to_go_on_from_the_text_the_client_has_and_reads_as_one_stream():
    t = StreamTranscript(CHAT, CHAT_BODY)
    first = events(chunk(role="assistant", content=""), chunk("Hello"), chunk(" wor"))
    assert t.relay(first) == first  # the first stream passes as it came
    body = t.continuation()
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello wor"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8 and CHAT_BODY["max_tokens"] == 10  # the original is not changed
    ChatCompletionRequest.model_validate(body)  # what modelpool's engines take

    # The next instance's events: its role chunk dropped, the first stream's id and time, usage as the client sees it.
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    out = t.relay(events(chunk(role="assistant", content="", id="x", created=5), chunk("ld", id="x", created=5),
                         chunk(finish="length", id="x", created=5), {"id": "x", "created": 5, "choices": [],
                                                                   "usage": usage}, b"[DONE]"))
    parsed = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert [p["id"] for p in parsed] == ["chatcmpl-1"] * 3 and {p["created"] for p in parsed} == {100}
    assert parsed[0]["choices"][0]["delta"] == {"content": "ld"}
    assert parsed[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert out.endswith(b"data: [DONE]\n\n") and t.finished and "".join(t.text) == "Hello world"


def test_a_text_completion_goes_on_from_its_prompt_with_the_text_so_far():
    t = StreamTranscript(COMPLETIONS, {"model": "m", "prompt": ["Once"], "max_tokens": 5, "stream": True})
    t.relay(events({"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "text": " upon", "finish_reason": None}]}))
    body = t.continuation()
    assert body["prompt"] == "Once upon" and body["max_tokens"] == 4


@pytest.mark.parametrize("path,body,seen", [
    (CHAT, {**CHAT_BODY, "n": 2}, []),
    (CHAT, {**CHAT_BODY, "tools": [{"type": "function", "function": {"name": "f"}}]}, []),
    (CHAT, CHAT_BODY, [chunk(tool_calls=[{"index": 0, "id": "t", "function": {"name": "f", "arguments": ""}}])]),
    (CHAT, CHAT_BODY, [chunk("done", finish="stop")]),  # whole already: nothing to ask for
    (CHAT, {**CHAT_BODY, "max_tokens": 1}, [chunk("x")]),  # the limit is reached
    (COMPLETIONS, {"model": "m", "prompt": [1, 2, 3], "stream": True}, []),
    (COMPLETIONS, {"model": "m", "prompt": "p", "echo": True, "stream": True}, []),
])
def test_what_cannot_be_carried_on_is_not(path, body, seen):
    t = StreamTranscript(path, body)
    if seen:
        t.relay(events(*seen))
    assert t.continuation() is None


def test_a_chat_template_leaves_the_final_assistant_message_open_to_be_written_on():
    template = ChatTemplate(None)  # ChatML
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello wor"}]
    assert template.render(messages, add_generation_prompt=False, continue_final_message=True) \
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello wor"
    assert template.render(messages[:1]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    nothing_yet = [messages[0], {"role": "assistant", "content": ""}]
    assert template.render(nothing_yet, add_generation_prompt=False, continue_final_message=True) \
        == template.render(messages[:1])
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": messages[:1], "continue_final_message": True,
                                              "add_generation_prompt": False})  # the final message is the user's
