"""The host-memory prompt cache: sequences evicted from llama.cpp's KV, kept in RAM for prompts that start with them.

llama.cpp's KV holds one sequence per id, so an engine with 8 ids keeps at most
8 finished conversations; the 9th evicts one, and that conversation's next turn
recomputes its whole context. llama-server keeps evicted slots' states in host
memory instead (`--cache-ram`, 8 GiB by default) and restores the best match
when a prompt arrives; so does this engine. An evicted entry's state is saved
(`llama_state_seq_get_data`) before its cells are cleared, and a prompt whose
longest cached prefix lives here rather than in the KV is restored into its
sequence (`llama_state_seq_set_data`) instead of prefilled: a memory copy in
place of a forward pass over every token.

Bookkeeping only, like `KVCacheManager`: the scheduler decides (it is pure) and
returns ("save", seq_id, key) and ("restore", seq_id, key) operations; the
decode thread keeps the bytes under each key.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from .kv_cache import common_prefix_len


@dataclass
class SavedPrompt:
    key: int
    tokens: list[int]
    nbytes: int


class HostPromptCache:
    """Saved sequences by key, least recently used first, within `max_bytes` (0: off)."""

    def __init__(self, max_bytes: int, bytes_per_token: int) -> None:
        self.max_bytes = max_bytes
        self.bytes_per_token = bytes_per_token
        self._saved: OrderedDict[int, SavedPrompt] = OrderedDict()
        self._keys = itertools.count(1)
        self.used_bytes = 0
        self.saves = self.restores = self.evictions = 0

    def __len__(self) -> int:
        return len(self._saved)

    def best_prefix(self, prompt: Sequence[int]) -> tuple[SavedPrompt | None, int]:
        best: SavedPrompt | None = None
        best_len = 0
        for saved in self._saved.values():
            n = common_prefix_len(saved.tokens, prompt)
            if n > best_len:
                best, best_len = saved, n
        return best, best_len

    def save(self, tokens: Sequence[int]) -> tuple[int | None, list[int]]:
        """Book a sequence of `tokens` to save: its key (None when it cannot fit at all, or an equal or longer one
        holding it is saved already), and the keys evicted to make room."""
        nbytes = len(tokens) * self.bytes_per_token
        if not self.max_bytes or nbytes > self.max_bytes:
            return None, []
        evicted = []
        for saved in list(self._saved.values()):
            common = common_prefix_len(saved.tokens, tokens)
            if common == len(tokens):
                self._saved.move_to_end(saved.key)
                return None, []
            if common == len(saved.tokens):  # an earlier turn of the same conversation: the new one holds it all
                self._drop(saved.key)
                evicted.append(saved.key)
        while self.used_bytes + nbytes > self.max_bytes:
            old = next(iter(self._saved))
            self._drop(old)
            self.evictions += 1
            evicted.append(old)
        key = next(self._keys)
        self._saved[key] = SavedPrompt(key, list(tokens), nbytes)
        self.used_bytes += nbytes
        self.saves += 1
        return key, evicted

    def restored(self, key: int) -> None:
        """A prompt was answered from `key`: it is the most recently used now."""
        self._saved.move_to_end(key)
        self.restores += 1

    def forget(self, key: int) -> None:
        """The save never happened (llama.cpp could not export the sequence)."""
        if key in self._saved:
            self._drop(key)

    def _drop(self, key: int) -> None:
        self.used_bytes -= self._saved.pop(key).nbytes
