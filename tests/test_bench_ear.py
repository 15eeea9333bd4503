"""bench/ear_mooncake.py's capacity-bounded oracle: one pooled LRU cache that sees every block."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from shared.contracts.mooncake import MooncakeRequest, reuse_bound

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # the script imports its sibling bench/ear.py
SPEC = importlib.util.spec_from_file_location("bench_ear_mooncake", BENCH / "ear_mooncake.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def req(t: int, *blocks: int, tokens: int | None = None) -> MooncakeRequest:
    return MooncakeRequest(timestamp=t, input_length=tokens or 512 * len(blocks), output_length=1, hash_ids=blocks)


def test_with_room_for_everything_the_oracle_is_the_traces_own_bound():
    trace = [req(0, 1, 2, 3), req(1, 1, 2, 4), req(2, 1, 5), req(3, 1, 2, 4, 6, tokens=1800)]
    assert bench.capacity_bound(trace, 10**9) == reuse_bound(trace)
    assert bench.capacity_bound(trace, 10**9) == (512 * (2 + 1 + 3), 512 * 8 + 1800)


def test_a_small_cache_evicts_the_least_recently_used_and_reuses_only_leading_blocks():
    # Room for 3 blocks: after [1,2,3] and [4,5,6], blocks 1-3 are evicted; [1,2] then reuses nothing.
    trace = [req(0, 1, 2, 3), req(1, 4, 5, 6), req(2, 1, 2)]
    assert bench.capacity_bound(trace, 3 * 512) == (0, 512 * 8)
    # [4,5,6] again finds 4 evicted by [1,2] (LRU), so nothing of its prefix: a later cached block does not count.
    assert bench.capacity_bound([*trace, req(3, 4, 5, 6)], 3 * 512)[0] == 0
    # A request that touches its blocks keeps them: [1,2,3], [1,2,3] reuses all three.
    assert bench.capacity_bound([req(0, 1, 2, 3), req(1, 1, 2, 3)], 3 * 512) == (3 * 512, 6 * 512)


def test_every_router_takes_every_place_in_the_order_over_as_many_repeats():
    routers = ["a", "b", "c"]
    orders = [bench.in_turn(routers, repeat) for repeat in range(3)]
    assert orders[0] == routers and all(sorted(order) == routers for order in orders)
    assert {order[-1] for order in orders} == set(routers)  # none always last
