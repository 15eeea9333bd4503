"""Chat messages -> prompt text with the model's own template (from the GGUF metadata)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used only when a GGUF carries no template: ChatML, which SmolLM2 and Qwen use.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source or CHATML
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader())
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(self.source)
        self._bos = bos_token
        self._eos = eos_token

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> str:
        """The prompt for `messages`; `continue_final_message` leaves the last one open, to be written on
        (as vLLM does: the template's text after the final message's content is cut off)."""
        if continue_final_message and not messages[-1].get("content"):
            return self.render(messages[:-1])  # nothing written yet: an assistant turn, opened
        text = self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            bos_token=self._bos,
            eos_token=self._eos,
        )
        if continue_final_message:
            final = str(messages[-1].get("content") or "")
            end = text.rfind(final) if final else -1
            if end < 0:
                raise jinja2.exceptions.TemplateError("the final message's text is not in the rendered prompt")
            text = text[: end + len(final)]
        return text
