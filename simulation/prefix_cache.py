"""A prefix cache over fixed-size token blocks with LRU eviction.

A prompt is identified block by block through chained hashes: block k's hash
covers every token up to the end of block k, so two prompts share a cached
block only if they share the whole prefix before it (as in vLLM's automatic
prefix caching). Only full blocks are cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


def block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of every full block of `token_ids`."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return tuple(hashes)


class PrefixCache:
    """Capacity in blocks; the least recently used block is evicted first."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks present; the matched blocks become most recent."""
        matched = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            matched += 1
        return matched

    def insert(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            self._blocks[h] = None
            if len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
