"""bench/ear_mooncake.py's capacity-bounded oracle (one pooled LRU cache that sees every block), its rotation of the
routers, and the simulated engines' drift that tells a valid run."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
import time
from pathlib import Path

import aiohttp

from shared.contracts.mooncake import MooncakeRequest, reuse_bound

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # the script imports its sibling bench/ear.py
sys.path.insert(0, str(Path(__file__).resolve().parent / "engines_simulated"))
SPEC = importlib.util.spec_from_file_location("bench_ear_mooncake", BENCH / "ear_mooncake.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)

import ear  # noqa: E402  (bench/ear.py, on the path above)
from sim_engine_support import chat, start_engine  # noqa: E402


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


def test_a_warm_up_fills_the_oracles_cache_and_is_not_counted():
    trace = [req(0, 1, 2, 3), req(1, 4, 5, 6), req(2, 1, 2)]
    # The first two warm it up: [1,2] reuses both blocks, and only its own tokens count.
    assert bench.capacity_bound(trace, 10**9, warm=2) == (2 * 512, 2 * 512)
    assert bench.capacity_bound(trace, 10**9, warm=2) == reuse_bound(trace[2:], warm=trace[:2])
    # With room for 3 blocks the warm-up's last request evicted [1,2,3]: nothing left to reuse.
    assert bench.capacity_bound(trace, 3 * 512, warm=2) == (0, 2 * 512)


def test_every_router_takes_every_place_in_the_order_over_as_many_repeats():
    routers = ["a", "b", "c"]
    orders = [bench.in_turn(routers, repeat) for repeat in range(3)]
    assert orders[0] == routers and all(sorted(order) == routers for order in orders)
    assert {order[-1] for order in orders} == set(routers)  # none always last


def test_an_engine_that_falls_behind_its_model_shows_as_drift():
    """A router run is valid only while the simulated engines keep their model's time (`engine_drift`): an engine
    whose event loop is held up while it serves (as a busy machine holds it up) reports the lag."""
    kept, stalled = start_engine(d_0=0.05, speedup=1.0), start_engine(d_0=0.05, speedup=1.0)

    async def drift(url: str) -> float:
        async with aiohttp.ClientSession() as client:
            return await ear.engine_drift(client, [url])

    try:
        assert asyncio.run(drift(kept.url)) == 0.0  # nothing ran yet: nothing fell behind
        assert chat(kept.url, max_tokens=16).status_code == 200
        answer: list[int] = []
        serving = threading.Thread(target=lambda: answer.append(chat(stalled.url, max_tokens=16).status_code))
        serving.start()
        time.sleep(0.2)  # in the middle of its 16 batches of 50 ms
        stalled.server.driver._loop.call_soon_threadsafe(time.sleep, 0.2)  # the loop held up for 0.2 s
        serving.join(timeout=30)
        assert answer == [200]
        kept_drift, stalled_drift = asyncio.run(drift(kept.url)), asyncio.run(drift(stalled.url))
    finally:
        kept.stop()
        stalled.stop()
    # 0.2 s behind over about 0.85 s of scheduled batches.
    assert stalled_drift > 0.15
    assert 0.0 <= kept_drift < stalled_drift
