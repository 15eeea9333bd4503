"""Synthetic prompts and answers: a token-count estimate and deterministic filler text.

No model runs here. A prompt's length is estimated by splitting it into pieces
(one per punctuation mark, one per up-to-6-character run of a word), which lands
near a BPE tokenizer's count for English. Chat messages are wrapped in a
ChatML-like template so that a conversation's turns share a prefix, which the
prefix cache recognises by hashing full blocks of pieces; an image part costs a
fixed block of tokens. Answers are filler
words chosen deterministically from the request, one word per token.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_PIECE = re.compile(r"[^\W\d_]{1,6}|\d{1,3}|[^\w\s]|_")

FILLER_WORDS: tuple[str, ...] = (
    "simulated", "output", "token", "pool", "engine", "batch", "decode", "memory",
    "request", "stream", "queue", "model", "serving", "latency", "budget", "cache",
    "prefix", "block", "swap", "wake", "sleep", "alias", "replica", "router",
    "gateway", "metric", "window", "burst", "load", "steady", "fluid", "limit",
    "arrival", "service", "rate", "time", "step", "state", "running", "waiting",
    "placement", "worker", "instance", "policy", "signal", "trace", "session", "turn",
    "prompt", "answer", "filler", "word", "text", "sample", "value", "count",
    "the", "a", "of", "and", "to", "in", "is", "for",
)


def pieces(text: str) -> list[str]:
    """The estimated tokens of a text."""
    return _PIECE.findall(text)


def count_tokens(text: str) -> int:
    return len(_PIECE.findall(text))


IMAGE_TOKENS = 256
"""Tokens an image costs in the prompt (a vision encoder's patch tokens at a typical resolution)."""


def content_pieces(content: str | Sequence[Mapping[str, Any]] | None) -> list[str]:
    """Pieces of one message's content: text parts by the estimate, each image a fixed block."""
    if content is None:
        return []
    if isinstance(content, str):
        return pieces(content)
    out: list[str] = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            out += pieces(str(part.get("text", "")))
        elif kind in ("image_url", "input_image"):
            ref = part.get("image_url") or part.get("url") or ""
            url = ref.get("url", "") if isinstance(ref, Mapping) else str(ref)
            # the same image yields the same tokens, so a repeated image can hit the prefix cache
            marker = f"<|image:{zlib.crc32(url.encode()):08x}|>"
            out += [marker] * IMAGE_TOKENS
    return out


def chat_pieces(messages: Sequence[tuple[str, str | Sequence[Mapping[str, Any]] | None]]) -> list[str]:
    """Pieces of a chat prompt after a ChatML-like template, ending with the assistant header."""
    out: list[str] = []
    for role, content in messages:
        out += ["<|im_start|>", role, "\n", *content_pieces(content), "<|im_end|>", "\n"]
    out += ["<|im_start|>", "assistant", "\n"]
    return out


def block_hashes(tokens: Sequence[str | int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of a prompt (a block's hash covers everything before it)."""
    hashes: list[int] = []
    previous = 0
    for end in range(block_size, len(tokens) + 1, block_size):
        block = "\x1f".join(map(str, tokens[end - block_size : end])).encode()
        previous = zlib.crc32(block, previous) | (end << 32)
        hashes.append(previous)
    return tuple(hashes)


def stable_seed(*parts: object) -> int:
    return zlib.crc32("\x1e".join(map(str, parts)).encode())


def natural_length(seed: int, mean: int) -> int:
    """Where the synthetic answer would end by itself: spread over [mean/2, 3*mean/2]."""
    low = max(1, mean // 2)
    return low + seed % (mean + 1)


@dataclass(frozen=True)
class FillerText:
    """Filler words for token positions, JSON-safe and pre-encoded once per engine."""

    first: tuple[bytes, ...]
    rest: tuple[bytes, ...]

    @classmethod
    def build(cls, words: Sequence[str] = FILLER_WORDS) -> "FillerText":
        return cls(
            first=tuple(w.capitalize().encode() for w in words),
            rest=tuple((" " + w).encode() for w in words),
        )

    def token(self, seed: int, position: int) -> bytes:
        table = self.first if position == 0 else self.rest
        return table[(seed + position * 7) % len(table)]

    def text(self, seed: int, count: int) -> str:
        return b"".join(self.token(seed, i) for i in range(count)).decode()
