"""The sequence-id pool: llama.cpp sequence ids 0..n_seq_max-1 lent to requests (seed 003 §1)."""

from __future__ import annotations

from .settings import LLAMA_MAX_SEQ


class SequenceIdPool:
    """requestId -> seqId map over a fixed pool.

    llama.cpp indexes its per-sequence KV streams by `llama_seq_id`, which must
    lie in 0..n_seq_max-1; request ids are unbounded, so ids are lent and
    returned. Lending prefers the id asked for (the one holding a reusable
    prefix), otherwise the lowest free id.
    """

    def __init__(self, n_seq_max: int) -> None:
        if not 1 <= n_seq_max <= LLAMA_MAX_SEQ:
            raise ValueError(f"n_seq_max must be in 1..{LLAMA_MAX_SEQ}, got {n_seq_max}")
        self.n_seq_max = n_seq_max
        self._owner: list[int | None] = [None] * n_seq_max
        self._by_request: dict[int, int] = {}

    def acquire(self, request_id: int, prefer: int | None = None) -> int | None:
        """Lend a free id to `request_id`; None when every id is taken."""
        if request_id in self._by_request:
            raise ValueError(f"request {request_id} already holds sequence id {self._by_request[request_id]}")
        if prefer is not None and self._owner[prefer] is None:
            seq_id = prefer
        else:
            seq_id = next((i for i, owner in enumerate(self._owner) if owner is None), None)
            if seq_id is None:
                return None
        self._owner[seq_id] = request_id
        self._by_request[request_id] = seq_id
        return seq_id

    def release(self, request_id: int) -> int | None:
        seq_id = self._by_request.pop(request_id, None)
        if seq_id is not None:
            self._owner[seq_id] = None
        return seq_id

    def seq_of(self, request_id: int) -> int | None:
        return self._by_request.get(request_id)

    def owner(self, seq_id: int) -> int | None:
        return self._owner[seq_id]

    def free_ids(self) -> list[int]:
        return [i for i, owner in enumerate(self._owner) if owner is None]

    @property
    def n_busy(self) -> int:
        return len(self._by_request)
