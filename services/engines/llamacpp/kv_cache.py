"""The KV cache manager (seed 003 §2): per-request KV entries, LRU eviction, PROCESSING protected.

An entry records exactly the tokens whose keys and values sit in llama.cpp's
cache under the entry's sequence id. A finished request's entry is kept
("parked") so that the next turn of the same conversation, whose prompt starts
with those tokens, reuses them instead of recomputing them. Parked entries are
the eviction candidates; an entry whose request is PROCESSING never is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .requests import RequestState

MIB = 1024 * 1024


@dataclass
class KVEntry:
    request_id: int
    seq_id: int
    state: RequestState
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0
    session: str = ""
    """The session whose request this is, as the gateway names it (`x-modelpool-session`): what a KV export
    must name to take this entry (never another session's best match)."""


@dataclass(frozen=True)
class KVLimits:
    max_items: int = 4 * 1024 * 1024
    """maxKVCachesItems: total tokens over all entries."""
    max_memory_mb: float = 1024.0
    bytes_per_token: int = 0
    """K and V bytes one token takes over all layers (0: memory not tracked)."""
    eviction_threshold: float = 0.8

    @property
    def capacity_items(self) -> int:
        if self.bytes_per_token <= 0:
            return self.max_items
        return min(self.max_items, int(self.max_memory_mb * MIB // self.bytes_per_token))


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVCacheManager:
    """Bookkeeping only: which request's tokens are cached on which sequence id.

    It never calls llama.cpp; evictions return the sequence ids the decode
    thread must clear.
    """

    def __init__(self, limits: KVLimits) -> None:
        self.limits = limits
        self._entries: OrderedDict[int, KVEntry] = OrderedDict()  # least recently used first
        self._items = 0
        self.evictions = 0

    # -- queries ---------------------------------------------------------
    def __contains__(self, request_id: int) -> bool:
        return request_id in self._entries

    def get(self, request_id: int) -> KVEntry | None:
        return self._entries.get(request_id)

    def entries(self) -> list[KVEntry]:
        return list(self._entries.values())

    def parked_on(self, seq_id: int) -> KVEntry | None:
        return next(
            (e for e in self._entries.values() if e.seq_id == seq_id and e.state != RequestState.PROCESSING), None
        )

    @property
    def used_items(self) -> int:
        return self._items

    @property
    def used_bytes(self) -> int:
        return self._items * self.limits.bytes_per_token

    @property
    def usage_ratio(self) -> float:
        return self._items / max(1, self.limits.capacity_items)

    def best_prefix(
        self, prompt: Sequence[int], seq_ids: Iterable[int], *, include_running: bool = False,
        session: str | None = None,
    ) -> tuple[KVEntry | None, int]:
        """The entry on one of `seq_ids` sharing the longest prefix with `prompt` (parked ones only by default;
        only `session`'s when given)."""
        allowed = set(seq_ids)
        best: KVEntry | None = None
        best_len = 0
        for entry in self._entries.values():
            if (entry.state == RequestState.PROCESSING and not include_running) or entry.seq_id not in allowed:
                continue
            if session is not None and entry.session != session:
                continue
            n = common_prefix_len(entry.tokens, prompt)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    # -- changes -----------------------------------------------------------
    def open(self, request_id: int, seq_id: int, now: float, tokens: Sequence[int] = (), session: str = "") -> KVEntry:
        if request_id in self._entries:
            raise ValueError(f"request {request_id} already has a KV entry")
        entry = KVEntry(request_id, seq_id, RequestState.PROCESSING, list(tokens), now, session)
        self._entries[request_id] = entry
        self._items += len(entry.tokens)
        return entry

    def take_over(self, old_request_id: int, new_request_id: int, keep: int, now: float, session: str = "") -> KVEntry:
        """`new_request_id` adopts a parked entry's sequence and its first `keep` tokens."""
        old = self._entries[old_request_id]
        if old.state == RequestState.PROCESSING:
            raise ValueError(f"request {old_request_id}'s KV is in use")
        self._remove(old_request_id)
        return self.open(new_request_id, old.seq_id, now, old.tokens[:keep], session)

    def append(self, request_id: int, tokens: Sequence[int], now: float) -> None:
        entry = self._entries[request_id]
        entry.tokens.extend(tokens)
        entry.last_used = now
        self._items += len(tokens)
        self._entries.move_to_end(request_id)

    def set_state(self, request_id: int, state: RequestState, now: float) -> None:
        entry = self._entries[request_id]
        entry.state = state
        entry.last_used = now
        self._entries.move_to_end(request_id)

    def drop(self, request_id: int) -> KVEntry | None:
        """Forget an entry; the caller clears its sequence."""
        return self._remove(request_id) if request_id in self._entries else None

    def evict_lru(self) -> KVEntry | None:
        """Evict the least recently used entry that is not PROCESSING."""
        for entry in self._entries.values():
            if entry.state != RequestState.PROCESSING:
                self._remove(entry.request_id)
                self.evictions += 1
                return entry
        return None

    def evict_over_threshold(self) -> list[KVEntry]:
        """LRU-evict unprotected entries until usage is at most the eviction threshold."""
        limit = self.limits.eviction_threshold * self.limits.capacity_items
        evicted: list[KVEntry] = []
        while self._items > limit:
            entry = self.evict_lru()
            if entry is None:
                break  # everything left is PROCESSING: protected
            evicted.append(entry)
        return evicted

    def _remove(self, request_id: int) -> KVEntry:
        entry = self._entries.pop(request_id)
        self._items -= len(entry.tokens)
        return entry
