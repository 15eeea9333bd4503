"""Seed 003's request management, decided without llama.cpp or HTTP."""

from __future__ import annotations

import pytest

from services.engines.llamacpp.kv_cache import KVCacheManager, KVLimits
from services.engines.llamacpp.prompt_cache import HostPromptCache
from services.engines.llamacpp.requests import GenerationRequest, RequestState, SamplingParams
from services.engines.llamacpp.scheduler import (
    LengthLimitExceeded,
    QueueFull,
    BatchScheduler,
    SchedulerLimits,
    effective_max_tokens,
)
from services.engines.llamacpp.seq_ids import SequenceIdPool


def make(n_seq: int = 2, **limits: object) -> BatchScheduler:
    base = dict(max_queue=4, max_running=3, max_batch_size=2, batch_tokens=16, request_timeout_s=10.0)
    base.update(limits)
    return BatchScheduler(SchedulerLimits(**base), SequenceIdPool(n_seq), KVCacheManager(KVLimits(max_items=1000)))  # type: ignore[arg-type]


def req(rid: int, prompt: list[int] | None = None, at: float = 0.0) -> GenerationRequest:
    return GenerationRequest(rid, prompt or [1, 2, 3], SamplingParams(max_tokens=4), lambda e: None, at)


def test_queue_bound_rejects_and_reports_retry_after() -> None:
    s = make()
    for i in range(4):
        s.submit(req(i))
    with pytest.raises(QueueFull) as exc:
        s.submit(req(99))
    assert exc.value.retry_after_s >= 1
    assert s.counts["rejected_queue_full"] == 1
    assert len(s.queue) == 4


def test_running_set_batch_and_seq_ids_bound_processing() -> None:
    s = make(n_seq=2)
    for i in range(4):
        s.submit(req(i))
    plan = s.schedule(now=1.0)
    states = {rid: t.state for rid, t in s.running.items()}
    assert states == {0: RequestState.PROCESSING, 1: RequestState.PROCESSING, 2: RequestState.PENDING}
    assert [t.request_id for t in s.queue] == [3]
    assert sorted(w.seq_id for w in plan.work) == [0, 1]
    assert all(w.kind == "prefill" and w.wants_logits for w in plan.work)


def test_pending_request_gets_freed_seq_id_and_prefill_joins_running_decodes() -> None:
    s = make(n_seq=2)
    for i in range(3):
        s.submit(req(i))
    plan = s.schedule(1.0)
    for w in plan.work:
        s.record_decoded(w, 1.0)
        s.add_generated(w.request_id, 7)
    s.finish(0, RequestState.COMPLETED, 2.0)
    plan = s.schedule(2.0)
    kinds = {(w.request_id, w.kind) for w in plan.work}
    # request 1 keeps decoding while request 2's prompt joins the same step
    assert kinds == {(1, "decode"), (2, "prefill")}
    assert s.running[2].seq_id == 0


def test_prompt_chunks_respect_token_budget_and_decodes_go_first() -> None:
    s = make(n_seq=2, batch_tokens=8)
    s.submit(req(0, [1, 2]))
    plan = s.schedule(0.0)
    s.record_decoded(plan.work[0], 0.0)
    s.add_generated(0, 5)
    s.submit(req(1, list(range(100, 120))))
    plan = s.schedule(0.1)
    assert [(w.request_id, len(w.tokens), w.wants_logits) for w in plan.work] == [(0, 1, True), (1, 7, False)]
    s.record_decoded(plan.work[1], 0.1)
    plan = s.schedule(0.2)
    chunk = next(w for w in plan.work if w.request_id == 1)
    assert chunk.pos0 == 7 and chunk.tokens == list(range(107, 114))


def test_timeout_frees_seq_id_and_clears_its_kv() -> None:
    s = make(n_seq=1, request_timeout_s=5.0)
    s.submit(req(0, at=0.0))
    s.submit(req(1, at=3.0))
    s.schedule(1.0)
    assert s.seq_ids.seq_of(0) == 0
    expired = s.expire(now=5.5)
    assert [t.request_id for t in expired] == [0]
    assert expired[0].state == RequestState.TIMEOUT
    assert s.seq_ids.free_ids() == [0] and 0 not in s.kv
    plan = s.schedule(5.6)
    assert (0, 0) in plan.clears  # the decode thread wipes the sequence before reuse
    assert s.running[1].seq_id == 0


def test_queued_requests_time_out_too() -> None:
    s = make(max_running=1, n_seq=1, request_timeout_s=5.0)
    s.submit(req(0, at=0.0))
    s.submit(req(1, at=0.0))
    s.schedule(0.0)
    assert {t.request_id for t in s.expire(6.0)} == {0, 1}
    assert not s.queue and not s.running


def test_cancel_releases_everything_wherever_the_request_is() -> None:
    s = make(n_seq=1, max_running=2)
    for i in range(3):
        s.submit(req(i))
    s.schedule(0.0)  # 0 PROCESSING, 1 PENDING, 2 QUEUED
    assert s.cancel(2, 0.1).state == RequestState.CANCELLED  # type: ignore[union-attr]
    assert s.cancel(1, 0.1).state == RequestState.CANCELLED  # type: ignore[union-attr]
    assert s.cancel(0, 0.1).state == RequestState.CANCELLED  # type: ignore[union-attr]
    assert s.cancel(0, 0.1) is None
    assert s.seq_ids.free_ids() == [0] and s.kv.used_items == 0


def test_void_results_of_a_request_that_left_during_the_step() -> None:
    s = make(n_seq=1)
    s.submit(req(0))
    plan = s.schedule(0.0)
    s.cancel(0, 0.0)
    assert s.record_decoded(plan.work[0], 0.1) is False


def test_completed_kv_is_parked_and_reused_by_the_next_turn() -> None:
    s = make(n_seq=2)
    s.submit(req(0, [1, 2, 3, 4]))
    plan = s.schedule(0.0)
    s.record_decoded(plan.work[0], 0.0)
    s.add_generated(0, 9)
    plan = s.schedule(0.1)
    s.record_decoded(plan.work[0], 0.1)
    s.finish(0, RequestState.COMPLETED, 0.2)
    entry = s.kv.get(0)
    assert entry is not None and entry.state == RequestState.COMPLETED and entry.tokens == [1, 2, 3, 4, 9]
    s.submit(req(1, [1, 2, 3, 4, 9, 10, 11]))
    plan = s.schedule(0.3)
    t = s.running[1]
    assert t.cached_tokens == 5 and t.seq_id == entry.seq_id
    assert plan.work[0].pos0 == 5 and plan.work[0].tokens == [10, 11]
    assert (entry.seq_id, 5) in plan.clears


def test_identical_prompt_keeps_one_token_to_decode() -> None:
    s = make(n_seq=1)
    s.submit(req(0, [1, 2, 3]))
    plan = s.schedule(0.0)
    s.record_decoded(plan.work[0], 0.0)
    s.finish(0, RequestState.COMPLETED, 0.1)
    s.submit(req(1, [1, 2, 3]))
    plan = s.schedule(0.2)
    assert s.running[1].cached_tokens == 2 and plan.work[0].tokens == [3]


def test_failed_request_kv_is_not_parked() -> None:
    s = make(n_seq=1)
    s.submit(req(0))
    plan = s.schedule(0.0)
    s.record_decoded(plan.work[0], 0.0)
    s.finish(0, RequestState.FAILED, 0.1)
    assert 0 not in s.kv and s.kv.used_items == 0


def test_no_free_seq_id_keeps_request_pending_then_lru_parked_seq_is_reused() -> None:
    s = make(n_seq=2, max_running=3, max_batch_size=2)
    for i, prompt in enumerate([[1, 1], [2, 2]]):
        s.submit(req(i, prompt))
    plan = s.schedule(0.0)
    for w in plan.work:
        s.record_decoded(w, 0.0)
    s.finish(0, RequestState.COMPLETED, 1.0)
    s.finish(1, RequestState.COMPLETED, 2.0)
    s.submit(req(2, [3, 3]))
    s.schedule(3.0)
    # no prefix matches: the least recently used parked entry (request 0) is evicted
    assert s.running[2].seq_id == 0 and 0 not in s.kv and 1 in s.kv


def test_effective_max_tokens_names_the_limit_and_the_excess() -> None:
    kw = dict(max_input=100, max_output=50, ctx_per_seq=120)
    assert effective_max_tokens(10, None, **kw) == 50
    assert effective_max_tokens(90, None, **kw) == 30
    with pytest.raises(LengthLimitExceeded, match="101 tokens, 1 over the input limit of 100"):
        effective_max_tokens(101, 1, **kw)
    with pytest.raises(LengthLimitExceeded, match="over the output limit of 50") as exc:
        effective_max_tokens(10, 60, **kw)
    assert exc.value.param == "max_tokens"
    with pytest.raises(LengthLimitExceeded, match="over by 10"):
        effective_max_tokens(90, 40, **kw)


def test_shared_system_prompt_is_copied_and_the_source_stays_parked() -> None:
    s = make(n_seq=2, batch_tokens=64)
    system = list(range(100, 110))
    s.submit(req(0, system + list(range(200, 230))))
    plan = s.schedule(0.0)
    s.record_decoded(plan.work[0], 0.0)
    s.finish(0, RequestState.COMPLETED, 0.1)
    s.submit(req(1, system + [300, 301]))
    plan = s.schedule(0.2)
    t = s.running[1]
    assert t.cached_tokens == 10 and t.seq_id == 1
    assert plan.kv_ops == [("copy", 0, 1), ("trim", 1, 10)]
    assert plan.work[0].pos0 == 10 and plan.work[0].tokens == [300, 301]
    parked = s.kv.get(0)
    assert parked is not None and parked.state == RequestState.COMPLETED and len(parked.tokens) == 40


def test_prefix_is_copied_from_a_running_request_too() -> None:
    s = make(n_seq=2, batch_tokens=64)
    system = list(range(100, 112))
    s.submit(req(0, system + [1, 2]))
    plan = s.schedule(0.0)
    s.record_decoded(plan.work[0], 0.0)
    s.add_generated(0, 7)
    s.submit(req(1, system + [3, 4]))
    plan = s.schedule(0.1)
    assert ("copy", 0, 1) in plan.kv_ops and s.running[1].cached_tokens == 12
    assert {(w.request_id, w.kind) for w in plan.work} == {(0, "decode"), (1, "prefill")}


def test_short_shared_prefix_is_recomputed_not_copied() -> None:
    s = make(n_seq=2, batch_tokens=64)
    s.submit(req(0, [1, 2, 3] + list(range(50, 80))))
    plan = s.schedule(0.0)
    s.record_decoded(plan.work[0], 0.0)
    s.finish(0, RequestState.COMPLETED, 0.1)
    s.submit(req(1, [1, 2, 3, 9, 9]))
    plan = s.schedule(0.2)
    assert not any(op == "copy" for op, _, _ in plan.kv_ops)
    assert s.running[1].cached_tokens == 0 and s.running[1].seq_id == 1 and 0 in s.kv


def run_to_completion(s: BatchScheduler, rid: int, prompt: list[int], now: float) -> None:
    s.submit(req(rid, prompt, at=now))
    plan = s.schedule(now)
    for w in plan.work:
        s.record_decoded(w, now)
    s.finish(rid, RequestState.COMPLETED, now)


def test_new_requests_fill_holes_so_busy_ids_stay_consecutive() -> None:
    s = make(n_seq=8, max_running=8, max_batch_size=8, batch_tokens=256)
    for rid in range(4):
        s.submit(req(rid, [rid + 1] * 3))
    plan = s.schedule(0.0)
    assert [w.seq_id for w in plan.work] == [0, 1, 2, 3]
    for w in plan.work:
        s.record_decoded(w, 0.0)
    s.finish(1, RequestState.COMPLETED, 0.1)  # a hole at id 1
    s.submit(req(4, [9, 9, 9]))
    s.schedule(0.2)
    assert s.running[4].seq_id == 1


def test_a_continued_conversation_parked_off_the_run_is_copied_next_to_it() -> None:
    s = make(n_seq=8, max_running=8, max_batch_size=8, batch_tokens=256)
    conversation = list(range(100, 120))
    # the conversation's first turn ends parked on id 0, then ids 0..2 go to other requests
    run_to_completion(s, 0, conversation, 0.0)
    for rid in (1, 2, 3):
        s.submit(req(rid, [rid] * 3))
    s.schedule(0.1)
    busy = {s.running[rid].seq_id for rid in (1, 2, 3)}
    assert busy == {1, 2, 3}  # id 0 holds the parked turn; the others fill 1, 2, 3
    s.finish(2, RequestState.COMPLETED, 0.2)  # hole at 2; the parked turn is still on 0
    s.submit(req(4, conversation + [7, 8]))
    plan = s.schedule(0.3)
    t = s.running[4]
    # id 0 would start a second run; id 2 keeps 1..3 one run, so the prefix is copied there
    assert t.seq_id == 2 and t.cached_tokens == 20
    assert ("copy", 0, 2) in plan.kv_ops and ("trim", 2, 20) in plan.kv_ops


def test_batch_lists_sequences_in_ascending_id_order() -> None:
    s = make(n_seq=3, max_running=3, max_batch_size=3, batch_tokens=256)
    for rid in range(3):
        s.submit(req(rid, [rid + 1] * 3))
    plan = s.schedule(0.0)
    for w in plan.work:
        s.record_decoded(w, 0.0)
    s.finish(0, RequestState.COMPLETED, 0.1)
    for rid in (1, 2):
        s.add_generated(rid, 5)
    s.submit(req(3, [7, 7, 7]))  # admitted last, bound to the only free id, 0
    plan = s.schedule(0.2)
    assert [w.seq_id for w in plan.work] == [0, 1, 2]
    assert plan.work[0].request_id == 3 and plan.work[0].kind == "prefill"


def with_host_cache(n_seq: int = 1, max_bytes: int = 1000, **limits: object) -> BatchScheduler:
    base = dict(max_queue=8, max_running=n_seq, max_batch_size=n_seq, batch_tokens=256, request_timeout_s=10.0)
    base.update(limits)
    return BatchScheduler(SchedulerLimits(**base), SequenceIdPool(n_seq), KVCacheManager(KVLimits(max_items=1000)),  # type: ignore[arg-type]
                          HostPromptCache(max_bytes, bytes_per_token=10))


def test_an_evicted_conversation_is_saved_to_host_memory_and_restored_for_its_next_turn() -> None:
    s = with_host_cache(n_seq=1)
    first = list(range(100, 130))
    run_to_completion(s, 0, first, 0.0)
    other = list(range(500, 520))
    s.submit(req(1, other))
    plan = s.schedule(0.1)
    # the parked turn leaves id 0 for the other prompt: saved before its cells are cleared
    assert plan.kv_ops == [("save", 0, 1), ("trim", 0, 0)]
    assert s.prompts is not None and s.prompts.used_bytes == 300
    for w in plan.work:
        s.record_decoded(w, 0.1)
    s.finish(1, RequestState.COMPLETED, 0.2)
    s.submit(req(2, first + [7, 8]))
    plan = s.schedule(0.3)
    # the other prompt is saved in turn; the first conversation comes back from host memory, not prefilled
    assert plan.kv_ops == [("save", 0, 2), ("trim", 0, 0), ("restore", 0, 1), ("trim", 0, 30)]
    assert s.running[2].cached_tokens == 30 and plan.work[0].pos0 == 30 and plan.work[0].tokens == [7, 8]
    assert s.prompts.restores == 1


def test_the_host_cache_keeps_its_bound_drops_earlier_turns_and_skips_short_sequences() -> None:
    cache = HostPromptCache(max_bytes=500, bytes_per_token=10)
    turn_1, other = list(range(20)), list(range(100, 120))
    assert cache.save(turn_1) == (1, [])
    assert cache.save(other) == (2, [])
    assert cache.save(turn_1[:10]) == (None, [])  # held by a saved sequence already
    assert cache.save(turn_1 + list(range(50, 60))) == (3, [1])  # the next turn holds the first: it goes
    assert cache.used_bytes == 500
    assert cache.save(list(range(200, 220))) == (4, [2])  # the least recently used out until it fits
    assert cache.used_bytes == 500
    assert cache.save(list(range(60))) == (None, [])  # bigger than the whole cache
    s = with_host_cache(n_seq=1)
    run_to_completion(s, 0, [1, 2, 3], 0.0)
    s.submit(req(1, [4, 5, 6]))
    assert s.schedule(0.1).kv_ops == [("trim", 0, 0)]  # a few tokens: recomputed rather than saved
