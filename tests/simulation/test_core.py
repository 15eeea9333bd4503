"""The decode system's invariants and the scheduler's documented choices."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from simulation.core import (
    DecodeCost,
    DecodeSystem,
    PreemptionMode,
    SimRequestState,
    SimRequest,
    Strategy,
    SystemParams,
    VictimPolicy,
)
from simulation.prefix_cache import block_hashes
from simulation.runner import run_until_idle


def make_requests(n: int, seed: int, rate: float = 0.5, max_prefill: int = 60, max_decode: int = 40):
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(f"r{i}", t, rng.randint(1, max_prefill), rng.randint(1, max_decode)))
    return out


ALL_COMBOS = [
    (mode, strategy, victim)
    for mode in PreemptionMode
    for strategy in Strategy
    for victim in VictimPolicy
]


@pytest.mark.parametrize(("mode", "strategy", "victim"), ALL_COMBOS)
def test_memory_bound_completion_once_and_conservation(mode, strategy, victim):
    params = SystemParams(M_total=400, B=300, d_0=1.0, d_1=0.01, mode=mode, strategy=strategy,
                          victim_policy=victim, seed=3)
    system = DecodeSystem(params)
    requests = make_requests(150, seed=11, rate=0.8)
    completions: Counter[str] = Counter()
    decodes: Counter[str] = Counter()
    arrived = 0

    def on_arrival(req, t):
        nonlocal arrived
        arrived += 1

    def on_step(res):
        assert res.memory_peak <= params.M_total
        assert res.memory_used <= params.M_total
        assert system.memory_used == sum(
            system.get(rid).footprint for rid in system.members()[1]
        )
        completions.update(res.completed)
        decodes.update(res.decoded)
        # conservation: every arrival is either completed or still in the system
        assert arrived == sum(completions.values()) + system.in_system
        assert system.in_system == system.running + system.waiting + system.swapped

    run_until_idle(system, requests, on_arrival=on_arrival, on_step=on_step)
    assert set(completions) == {r.request_id for r in requests}
    assert all(c == 1 for c in completions.values())
    for r in requests:
        assert r.state is SimRequestState.COMPLETED
        assert r.decoded == r.decode_length
        # every decode step either survives or was wasted by a sacrifice
        assert decodes[r.request_id] == r.decode_length + r.wasted_tokens
    assert system.memory_used == 0
    if mode is PreemptionMode.SWAP:
        assert system.counters["sacrifices"] == 0
    else:
        assert system.counters["swap_out"] == 0


def two_request_system(mode, strategy=Strategy.AGGRESSIVE):
    # A and B use 10 + 10 tokens at admission and grow by 2 per batch: the
    # sixth batch would need 32 > 30 tokens, so B (the later to enter RUNNING) is preempted.
    params = SystemParams(M_total=30, B=1000, d_0=1.0, d_1=0.0, mode=mode, strategy=strategy)
    system = DecodeSystem(params)
    a = SimRequest("A", 0.0, 10, 10)
    b = SimRequest("B", 0.0, 10, 10)
    system.add(a)
    system.add(b)
    return system, a, b


def step_until_preempted(system):
    t = 0.0
    for _ in range(50):
        res = system.step(t)
        t = res.end_time
        if res.preempted:
            return res, t
    raise AssertionError("no preemption happened")


def test_swap_keeps_progress():
    system, a, b = two_request_system(PreemptionMode.SWAP)
    res, t = step_until_preempted(system)
    assert res.preempted == ("B",)
    assert b.state is SimRequestState.SWAPPED
    assert b.decoded == 5
    decoded_b = 5
    while system.has_work():
        res = system.step(t)
        t = res.end_time
        decoded_b += res.decoded.count("B")
    assert b.decoded == 10 and decoded_b == 10
    assert b.swap_count == 1 and b.total_swapped_time > 0
    assert b.wasted_tokens == 0


def test_sacrifice_resets_progress():
    system, a, b = two_request_system(PreemptionMode.SACRIFICE)
    res, t = step_until_preempted(system)
    assert res.preempted == ("B",)
    assert res.preemptions[0].decode_position == 5
    assert res.preemptions[0].memory_freed == 15
    assert b.state is SimRequestState.WAITING and b.decoded == 0
    decoded_b = 5
    while system.has_work():
        res = system.step(t)
        t = res.end_time
        decoded_b += res.decoded.count("B")
    assert b.decoded == 10
    # aggressive admission lets B back in at once, so it may be sacrificed again: every lost
    # token is recomputed
    assert b.wasted_tokens >= 5 and b.sacrifice_count >= 1
    assert decoded_b == 10 + b.wasted_tokens
    assert system.counters["wasted_tokens"] == b.wasted_tokens


def test_lifo_victims_are_the_latest_to_enter_running():
    params = SystemParams(M_total=60, B=10_000, d_0=1.0, d_1=0.0, mode=PreemptionMode.SWAP,
                          strategy=Strategy.AGGRESSIVE)
    system = DecodeSystem(params)
    t = 0.0
    order = []
    for name in ("A", "B", "C", "D"):
        system.add(SimRequest(name, t, 10, 40))
        res = system.step(t)
        order.extend(res.admitted)
        t = res.end_time
    assert order == ["A", "B", "C", "D"]
    preempted = []
    while len(preempted) < 3:
        res = system.step(t)
        t = res.end_time
        preempted.extend(res.preempted)
    assert preempted == ["D", "C", "B"]


def test_lru_victim_is_the_least_recently_executed():
    # B=15 lets only the oldest request (cost 10 + position) run each batch, so B and C are never executed;
    # LRU picks B (idle longest, entered before C), LIFO would pick C.
    params = SystemParams(M_total=40, B=15, d_0=1.0, d_1=0.0, mode=PreemptionMode.SWAP,
                          strategy=Strategy.AGGRESSIVE, victim_policy=VictimPolicy.LRU,
                          decode_cost=DecodeCost.CONTEXT)
    system = DecodeSystem(params)
    for name in ("A", "B", "C"):
        system.add(SimRequest(name, 0.0, 10, 20))
    t = 0.0
    for _ in range(30):
        res = system.step(t)
        t = res.end_time
        assert res.decoded in ((), ("A",))
        if res.preempted:
            assert res.preempted == ("B",)
            return
    raise AssertionError("no preemption")


@pytest.mark.parametrize("strategy", list(Strategy))
def test_aggressive_admits_swapped_strictly_before_waiting(strategy):
    system, a, b = two_request_system(PreemptionMode.SWAP, strategy=strategy)
    res, t = step_until_preempted(system)
    assert b.state is SimRequestState.SWAPPED
    # W is small enough to fit next to A at once; B (15 tokens) does not fit until A completes
    w = SimRequest("W", t, 1, 1)
    system.add(w)
    admitted_at = swapped_in_at = None
    while system.has_work():
        res = system.step(t)
        t = res.end_time
        if "B" in res.swapped_in:
            swapped_in_at = res.batch_id
        if "W" in res.admitted:
            admitted_at = res.batch_id
            if strategy is Strategy.AGGRESSIVE:
                assert b.state is not SimRequestState.SWAPPED
    assert admitted_at is not None and swapped_in_at is not None
    if strategy is Strategy.AGGRESSIVE:
        assert swapped_in_at <= admitted_at
    else:
        assert admitted_at < swapped_in_at  # a blocked SWAPPED head does not block WAITING


def test_conservative_keeps_growth_headroom_and_preempts_less():
    requests = make_requests(200, seed=5, rate=1.0)
    counts = {}
    for strategy in Strategy:
        params = SystemParams(M_total=300, B=10_000, d_0=1.0, d_1=0.0, strategy=strategy)
        system = DecodeSystem(params)
        run_until_idle(system, [SimRequest(r.request_id, r.arrival_time, r.prefill_length, r.decode_length)
                                for r in requests])
        counts[strategy] = system.counters["preemptions"]
    assert counts[Strategy.CONSERVATIVE] < counts[Strategy.AGGRESSIVE]


def test_budget_limits_the_batch_and_duration_follows_it():
    params = SystemParams(M_total=10_000, B=100, d_0=2.0, d_1=0.5, decode_cost=DecodeCost.CONTEXT)
    system = DecodeSystem(params)
    for i in range(5):
        system.add(SimRequest(f"r{i}", 0.0, 30, 5))
    res = system.step(0.0)
    # context cost 30 each: three fit in B=100
    assert res.batch_count == 3 and res.batch_tokens == 90
    assert res.running == 5
    assert res.duration == pytest.approx(2.0 + 0.5 * 90)
    assert res.decoded == ("r0", "r1", "r2")


def test_one_token_per_decode_is_the_default_budget():
    params = SystemParams(M_total=10_000, B=3, d_0=1.0, d_1=0.1)
    system = DecodeSystem(params)
    for i in range(5):
        system.add(SimRequest(f"r{i}", 0.0, 30, 5))
    res = system.step(0.0)
    assert res.batch_count == 3 and res.batch_tokens == 3 and res.running == 5
    assert res.duration == pytest.approx(1.3)


def test_cancel_frees_memory_in_every_state():
    system, a, b = two_request_system(PreemptionMode.SWAP)
    res, t = step_until_preempted(system)
    used = system.memory_used
    assert system.cancel("A")
    assert system.memory_used == used - a.footprint
    assert system.cancel("B")  # swapped
    system.add(SimRequest("C", t, 5, 5))
    assert system.cancel("C")  # waiting
    assert not system.cancel("C")
    assert not system.has_work() and system.memory_used == 0
    assert system.step(t) is None


def test_add_rejects_requests_that_can_never_fit():
    system = DecodeSystem(SystemParams(M_total=100, B=100, d_0=1, d_1=0))
    with pytest.raises(ValueError, match="M_total"):
        system.add(SimRequest("big", 0.0, 90, 20))
    with pytest.raises(ValueError):
        system.add(SimRequest("zero", 0.0, 5, 0))


def test_chunked_prefill_counts_against_budget():
    params = SystemParams(M_total=10_000, B=64, d_0=0.01, d_1=0.001, prefill=True)
    system = DecodeSystem(params)
    system.add(SimRequest("long", 0.0, 150, 3))
    system.add(SimRequest("short", 0.0, 10, 3))
    r1 = system.step(0.0)
    assert r1.prefilled == (("long", 64),) and r1.batch_tokens == 64 and r1.decoded == ()
    r2 = system.step(r1.end_time)
    assert r2.prefilled == (("long", 64),)
    r3 = system.step(r2.end_time)
    # 22 prompt tokens finish "long" (and give its first token); "short" prefills its 10 as well
    assert r3.prefilled == (("long", 22), ("short", 10))
    assert r3.decoded == ("long", "short") and r3.batch_tokens == 32
    r4 = system.step(r3.end_time)
    assert r4.batch_tokens == 2  # decodes cost one token each in serving mode
    assert system.counters["prompt_tokens"] == 160


def test_prefix_cache_skips_repeated_prefixes_and_reports_apc():
    params = SystemParams(M_total=10_000, B=512, d_0=0.01, d_1=0.001, prefill=True,
                          prefix_cache_blocks=64, block_size=16)
    system = DecodeSystem(params)
    prompt = list(range(100))
    hashes = block_hashes(prompt, 16)
    assert len(hashes) == 6
    system.add(SimRequest("turn1", 0.0, 100, 2, hashes))
    t = 0.0
    while system.has_work():
        t = system.step(t).end_time
    assert system.counters["prefix_cache_hits"] == 0
    follow_up = prompt + list(range(1000, 1040))
    system.add(SimRequest("turn2", t, 140, 2, block_hashes(follow_up, 16)))
    res = system.step(t)
    assert res.prefilled == (("turn2", 140 - 96),)
    assert system.get("turn2").cached_tokens == 96
    assert system.apc == pytest.approx(96 / 240)


def test_prefix_cache_evicts_least_recently_used():
    from simulation.prefix_cache import PrefixCache

    cache = PrefixCache(3)
    cache.insert([1, 2, 3])
    assert cache.match([1]) == 1  # 1 becomes most recent
    cache.insert([4])  # evicts 2
    assert cache.match([2]) == 0
    assert cache.match([1]) == 1 and cache.match([3]) == 1 and cache.match([4]) == 1


def test_emitted_tokens_are_not_repeated_after_a_sacrifice():
    system, a, b = two_request_system(PreemptionMode.SACRIFICE)
    t = 0.0
    emitted = Counter()
    while system.has_work():
        res = system.step(t)
        t = res.end_time
        emitted.update(res.emitted)
    assert emitted == {"A": 10, "B": 10}


def test_allow_waiting_preempt_lets_an_earlier_arrival_displace_later_ones():
    # A (arrived first) is swapped out; C and D arrived later and hold memory. With
    # allow_waiting_preempt, the aggressive scheduler preempts the later arrivals for A at once.
    for allow in (False, True):
        params = SystemParams(M_total=100, B=1000, d_0=1.0, d_1=0.0, mode=PreemptionMode.SWAP,
                              strategy=Strategy.AGGRESSIVE, allow_waiting_preempt=allow)
        system = DecodeSystem(params)
        a = SimRequest("A", 0.0, 40, 50)
        system.add(a)
        t = system.step(0.0).end_time
        system.add(SimRequest("C", t, 20, 50))
        system.add(SimRequest("D", t, 20, 50))
        res = system.step(t)
        assert res.admitted == ("C", "D")
        # force A out, as memory pressure would, then see who gets the memory back
        system.cancel("A")
        system.add(SimRequest("A2", 0.0, 60, 30))  # earlier arrival time than C and D, needs 61 tokens
        res = system.step(res.end_time)
        if allow:
            assert res.admitted == ("A2",)
            assert [p.request_id for p in res.preemptions] == ["D"] and res.preemptions[0].phase == 1
        else:
            assert res.admitted == () and res.preemptions == ()


@pytest.mark.parametrize(("mode", "strategy"), [(m, s) for m in PreemptionMode for s in Strategy])
def test_serving_mode_invariants_with_prefill_and_prefix_cache(mode, strategy):
    # chunked prefill and shared prompt prefixes under memory pressure
    params = SystemParams(M_total=600, B=64, d_0=0.01, d_1=0.001, mode=mode, strategy=strategy,
                          prefill=True, prefix_cache_blocks=32, block_size=8)
    system = DecodeSystem(params)
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(48)] for _ in range(3)]
    requests = []
    t = 0.0
    for i in range(120):
        t += rng.expovariate(20.0)
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
        requests.append(SimRequest(f"s{i}", t, len(prompt), rng.randint(1, 80), block_hashes(prompt, 8)))
    emitted: Counter[str] = Counter()
    completions: Counter[str] = Counter()

    def on_step(res):
        assert res.memory_peak <= params.M_total
        assert res.batch_tokens <= params.B
        emitted.update(res.emitted)
        completions.update(res.completed)

    run_until_idle(system, requests, on_step=on_step)
    assert all(completions[r.request_id] == 1 for r in requests)
    assert all(emitted[r.request_id] == r.decode_length for r in requests)
    assert system.memory_used == 0
    assert 0.2 < system.apc < 1.0
    if strategy is Strategy.AGGRESSIVE:
        assert system.counters["preemptions"] > 0  # the case exercises preemption during prefill/decode
    assert system.counters["prompt_tokens"] + system.counters["prefix_cache_hits"] >= sum(
        r.prefill_length for r in requests)
