"""The KV cache manager: LRU eviction that never touches a PROCESSING entry."""

from __future__ import annotations

import random

from services.engines.llamacpp.kv_cache import KVCacheManager, KVLimits, common_prefix_len
from services.engines.llamacpp.requests import RequestState
from services.engines.llamacpp.seq_ids import SequenceIdPool

import pytest


def test_capacity_is_the_tighter_of_items_and_memory() -> None:
    assert KVLimits(max_items=1000, max_memory_mb=1, bytes_per_token=2048).capacity_items == 512
    assert KVLimits(max_items=100, max_memory_mb=1, bytes_per_token=2048).capacity_items == 100


def test_threshold_eviction_is_lru_and_skips_processing() -> None:
    kv = KVCacheManager(KVLimits(max_items=100, eviction_threshold=0.8))
    kv.open(1, 0, now=0.0, tokens=[0] * 30)  # oldest, but PROCESSING
    kv.open(2, 1, now=1.0, tokens=[0] * 30)
    kv.set_state(2, RequestState.COMPLETED, 1.0)
    kv.open(3, 2, now=2.0, tokens=[0] * 30)
    kv.set_state(3, RequestState.COMPLETED, 2.0)
    assert kv.used_items == 90
    evicted = kv.evict_over_threshold()
    assert [e.request_id for e in evicted] == [2]
    assert kv.used_items == 60 and 1 in kv and 3 in kv


def test_processing_entries_survive_any_pressure() -> None:
    kv = KVCacheManager(KVLimits(max_items=10, eviction_threshold=0.5))
    kv.open(1, 0, 0.0, [0] * 50)
    kv.open(2, 1, 0.0, [0] * 50)
    assert kv.evict_over_threshold() == [] and kv.evict_lru() is None
    assert kv.used_items == 100


def test_random_workload_never_evicts_processing() -> None:
    rng = random.Random(7)
    pool = SequenceIdPool(8)
    kv = KVCacheManager(KVLimits(max_items=400, eviction_threshold=0.8))
    processing: set[int] = set()
    for step in range(2000):
        now = float(step)
        op = rng.random()
        if op < 0.3:
            rid = step
            seq = pool.acquire(rid)
            if seq is None:
                continue
            victim = kv.parked_on(seq)
            if victim is not None:
                kv.drop(victim.request_id)
            kv.open(rid, seq, now, [rng.randrange(50) for _ in range(rng.randrange(1, 40))])
            processing.add(rid)
        elif op < 0.6 and processing:
            rid = rng.choice(sorted(processing))
            kv.append(rid, [1] * rng.randrange(1, 20), now)
        elif op < 0.8 and processing:
            rid = rng.choice(sorted(processing))
            processing.discard(rid)
            pool.release(rid)
            kv.set_state(rid, RequestState.COMPLETED, now)
        else:
            for e in kv.evict_over_threshold():
                assert e.request_id not in processing
                assert e.state != RequestState.PROCESSING
        for rid in processing:
            assert rid in kv
        assert kv.used_items == sum(len(e.tokens) for e in kv.entries())


def test_best_prefix_only_among_allowed_parked_entries() -> None:
    kv = KVCacheManager(KVLimits())
    kv.open(1, 0, 0.0, [1, 2, 3, 4])
    kv.set_state(1, RequestState.COMPLETED, 0.0)
    kv.open(2, 1, 0.0, [1, 2, 3, 4, 5])  # PROCESSING: not reusable
    entry, n = kv.best_prefix([1, 2, 3, 4, 5, 6], seq_ids=[0, 1])
    assert entry is not None and entry.request_id == 1 and n == 4
    assert kv.best_prefix([1, 2], seq_ids=[1]) == (None, 0)
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2


def test_seq_id_pool_bounds_and_mapping() -> None:
    with pytest.raises(ValueError):
        SequenceIdPool(0)
    with pytest.raises(ValueError):
        SequenceIdPool(257)
    pool = SequenceIdPool(2)
    assert pool.acquire(10) == 0 and pool.acquire(11) == 1 and pool.acquire(12) is None
    assert pool.release(10) == 0 and pool.acquire(12, prefer=1) == 0
    assert pool.seq_of(12) == 0 and pool.owner(1) == 11
