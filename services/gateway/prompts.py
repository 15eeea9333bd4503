"""What the router needs to know of a prompt: its session, its leading blocks, and about how many tokens it is.

The gateway never tokenizes. A prompt's text is cut into blocks of `BLOCK_BYTES`
with chained hashes (block k's hash covers everything before it, as vLLM's
prefix cache keys its blocks), so two prompts share a block only if they share
the whole prefix up to it. Its token count is its length in bytes times the
alias's tokens per byte, learned from the prompt tokens the engines report
(`TokensPerByte`), so the estimate follows the model's own tokenizer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BLOCK_BYTES = 256
"""About 64 tokens of English text: fine enough for a prefix match, cheap to hash for a 100k-token prompt."""
INITIAL_TOKENS_PER_BYTE = 0.25
"""Until an engine has reported: about 4 bytes per token, typical of BPE tokenizers on English."""
SESSION_HEADER = "x-session-id"


@dataclass(frozen=True, slots=True)
class Prompt:
    session_id: str
    """`alias/` + the client's session: its `x-session-id`, else its `user`, else a hash of its leading messages."""
    blocks: tuple[int, ...]
    size_bytes: int


def _text(body: dict[str, Any]) -> list[bytes]:
    """The prompt's parts in order: each message's role and content (text parts only), or the completion prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text is a prefix a cache can share
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role')}>{content if isinstance(content, str) else ''}".encode())
        return parts
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = "".join(p for p in prompt if isinstance(p, str))
    return [prompt.encode()] if isinstance(prompt, str) else []


def session_of(parts: Sequence[bytes], header: str | None, user: Any) -> str:
    if header:
        return header
    if isinstance(user, str) and user:
        return f"user:{user}"
    # A plain multi-turn client: its system prompt and first user turn name the conversation.
    leading = b"".join(parts[:2]) if len(parts) > 1 and parts[0].startswith(b"<system>") else b"".join(parts[:1])
    return "prefix:" + hashlib.blake2b(leading[:4096], digest_size=12).hexdigest()


def read_prompt(alias: str, body: dict[str, Any], session_header: str | None) -> Prompt:
    parts = _text(body)
    data = b"".join(parts)
    blocks: list[int] = []
    parent = b""
    for start in range(0, len(data) - BLOCK_BYTES + 1, BLOCK_BYTES):
        parent = hashlib.blake2b(parent + data[start:start + BLOCK_BYTES], digest_size=8).digest()
        blocks.append(int.from_bytes(parent, "big"))
    return Prompt(f"{alias}/{session_of(parts, session_header, body.get('user'))}", tuple(blocks), len(data))


class TokensPerByte:
    """An alias's tokens per byte of prompt, from the prompt tokens its engines report."""

    def __init__(self, smoothing: float = 0.1) -> None:
        self.smoothing = smoothing
        self.ratios: dict[str, float] = {}

    def tokens(self, alias: str, size_bytes: int) -> int:
        return round(size_bytes * self.ratios.get(alias, INITIAL_TOKENS_PER_BYTE))

    def observe(self, alias: str, size_bytes: int, prompt_tokens: int) -> None:
        if size_bytes < BLOCK_BYTES or prompt_tokens <= 0:
            return  # a short prompt is mostly template: it says little about the text's ratio
        ratio = prompt_tokens / size_bytes
        known = self.ratios.get(alias)
        self.ratios[alias] = ratio if known is None else known + self.smoothing * (ratio - known)


class PrefixIndex:
    """Per instance, the prompt blocks this gateway has sent it, least recently used dropped first.

    An estimate of what each instance's prefix cache holds: what it was asked to
    compute, bounded by about its KV size.
    """

    def __init__(self, capacity_blocks: int = 1 << 16) -> None:
        self.capacity_blocks = capacity_blocks
        self.blocks: dict[str, OrderedDict[int, None]] = {}

    def matched(self, instance_id: str, blocks: Sequence[int]) -> int:
        """How many of the leading `blocks` the instance was sent."""
        held = self.blocks.get(instance_id)
        if not held:
            return 0
        n = 0
        for block in blocks:
            if block not in held:
                break
            n += 1
        return n

    def sent(self, instance_id: str, blocks: Sequence[int], capacity_blocks: int | None = None) -> None:
        held = self.blocks.setdefault(instance_id, OrderedDict())
        for block in blocks:
            held[block] = None
            held.move_to_end(block)
        limit = capacity_blocks or self.capacity_blocks
        while len(held) > limit:
            held.popitem(last=False)

    def forget(self, keep: set[str]) -> None:
        """Drop the index of instances no longer running."""
        for instance_id in [i for i in self.blocks if i not in keep]:
            del self.blocks[instance_id]
