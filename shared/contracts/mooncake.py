"""The Mooncake trace format (kvcache-ai/Mooncake, `FAST25-release/`): JSON Lines, one request per line.

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 2353]}

`timestamp` is the request's arrival in milliseconds from the trace's start;
`input_length` and `output_length` are token counts; `hash_ids` name the
prompt's blocks of `BLOCK_TOKENS` tokens in order (the last one partial), each
id a remapped hash of the block and everything before it, so two requests with
the same leading ids share exactly that prefix. Ids are handed out in order of
first use: an id not above the largest seen before is a reused block.

The field's shared yardstick for KV-aware routing (Dynamo's and SGLang's router
benchmarks replay it). modelpool reads it wherever it reads its own agentic
format (`shared/contracts/trace.py`): `modelpool trace run`, the lab.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import orjson
from pydantic import BaseModel, ConfigDict, Field

from shared.contracts.config import ConfigError
from shared.contracts.trace import checked_lines

BLOCK_TOKENS = 512
"""Tokens per block of the released traces."""
FIELDS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})


class MooncakeRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")  # later releases add fields (AIPerf's `tools`, ...)

    timestamp: int = Field(ge=0)
    """Milliseconds from the trace's start."""
    input_length: int = Field(ge=1)
    output_length: int = Field(ge=0)
    hash_ids: tuple[int, ...] = Field(min_length=1)

    def block_tokens(self, index: int, block: int = BLOCK_TOKENS) -> int:
        """Tokens of the prompt's block `index`: whole blocks, and the last cut to `input_length`."""
        if index < len(self.hash_ids) - 1:
            return block
        return max(1, min(block, self.input_length - block * (len(self.hash_ids) - 1)))


def is_mooncake(path: Path) -> bool:
    """Whether the file's first request has the Mooncake fields (the agentic format has none of them)."""
    try:
        with path.open("rb") as lines:
            for line in lines:
                if line.strip():
                    first = orjson.loads(line)
                    return isinstance(first, dict) and FIELDS <= first.keys()
    except (OSError, orjson.JSONDecodeError):
        return False
    return False


def read_mooncake(path: Path, block: int = BLOCK_TOKENS) -> list[MooncakeRequest]:
    """Every request of a Mooncake trace, checked: a bad line is a `ConfigError` naming the line and the field;
    so is one whose `hash_ids` cannot hold its `input_length` in blocks of `block` tokens, or timestamps that go
    back in time."""
    requests: list[MooncakeRequest] = []
    for request, where in checked_lines(path, MooncakeRequest):
        blocks = math.ceil(request.input_length / block)
        if abs(len(request.hash_ids) - blocks) > 1:  # releases differ on whether a partial last block is named
            raise ConfigError("hash_ids", f"{len(request.hash_ids)} blocks for {request.input_length} tokens "
                                          f"(blocks of {block} tokens: {blocks})", where)
        if requests and request.timestamp < requests[-1].timestamp:
            raise ConfigError("timestamp", f"{request.timestamp} comes before the previous line's "
                                           f"{requests[-1].timestamp} (a trace is in arrival order)", where)
        requests.append(request)
    return requests


PUBLIC_MIN = 20
PUBLIC_SHARE = 0.01


def conversations(requests: Sequence[MooncakeRequest], public_share: float = PUBLIC_SHARE) -> list[str]:
    """Each request's conversation, inferred: a block that many requests open with (the system prompt every
    request shares, a tool description) is public, once `public_share` of the requests (and at least
    `PUBLIC_MIN`) hold it; a request's first block that is not public names its conversation (`c<block>`),
    which its later turns carry whole. A request sharing no private block with any other is a conversation of
    its own (`r<index>`)."""
    holders = Counter(block for r in requests for block in set(r.hash_ids))
    public = max(PUBLIC_MIN, math.ceil(len(requests) * public_share))
    named = []
    for index, request in enumerate(requests):
        private = next((b for b in request.hash_ids if holders[b] < public), None)
        named.append(f"c{private}" if private is not None and holders[private] > 1 else f"r{index}")
    return named


def write_mooncake(requests: Iterable[MooncakeRequest], path: Path) -> int:
    count = 0
    with path.open("wb") as out:
        for request in requests:
            out.write(orjson.dumps({"timestamp": request.timestamp, "input_length": request.input_length,
                                    "output_length": request.output_length, "hash_ids": list(request.hash_ids)})
                      + b"\n")
            count += 1
    return count


def reuse_bound(requests: Iterable[MooncakeRequest], block: int = BLOCK_TOKENS,
                warm: Iterable[MooncakeRequest] = ()) -> tuple[int, int]:
    """(reusable, total) input tokens: what an infinite prefix cache seeing every request could have reused —
    each request's leading blocks that an earlier request already held (an id names its whole prefix). The `warm`
    requests came before (a warm-up): the cache saw their blocks, and they are not counted."""
    seen: set[int] = {block_id for request in warm for block_id in request.hash_ids}
    reusable = total = 0
    for request in requests:
        total += request.input_length
        for index, block_id in enumerate(request.hash_ids):
            if block_id not in seen:
                break
            reusable += request.block_tokens(index, block)
        seen.update(request.hash_ids)
    return reusable, total
