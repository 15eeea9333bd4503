"""Routers from the pool file: presets as lists of named filters and weighted scorers, and lists of one's own."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from routing.plugins.testing import endpoints, make_router, request
from routing.registry import preset
from routing.scheduler import Endpoint
from shared.contracts.config import BINDING_FILTERS, RouterConfig


@pytest.mark.parametrize("plugin,binds,per_session,reads_cache", [
    ("round-robin", False, False, False), ("least-load", False, False, False), ("kv-aware", False, False, True),
    ("sticky", False, True, False), ("affinity", True, True, False), ("ear", True, True, True)])
def test_what_a_preset_does_with_sessions_follows_from_its_filters(plugin, binds, per_session, reads_cache):
    router = make_router(plugin)
    assert router.name == plugin
    assert (router.binds_sessions, router.per_session, router.reads_cache) == (binds, per_session, reads_cache)
    # The configuration says whether it binds (the controller reads it) as its preset's filters do.
    assert any(f in BINDING_FILTERS for f in preset(RouterConfig(plugin=plugin))[0]) == binds


def test_scorers_of_ones_own_replace_the_presets():
    pool = endpoints(0, 6000, cached_tokens=[0, 6000])
    assert make_router("least-load").choose(request(prompt_tokens=10_000), pool).instance_id == "i0"
    cache_first = make_router("least-load", scorers=[{"name": "prefix-hit", "weight": 3},
                                                     {"name": "least-pending-prefill", "weight": 1}])
    assert cache_first.name == "least-load (custom)" and cache_first.reads_cache
    assert cache_first.choose(request(prompt_tokens=10_000), pool).instance_id == "i1"
    load_again = make_router("least-load", scorers=[{"name": "prefix-hit", "weight": 0},
                                                    {"name": "least-pending-prefill", "weight": 1}])
    assert load_again.choose(request(prompt_tokens=10_000), pool).instance_id == "i0"  # weight 0: left out


def test_filters_of_ones_own_keep_sessions_and_never_pass_an_instances_capacity():
    router = make_router("least-load", filters=["session-host"])
    assert router.binds_sessions and router.per_session
    pool = [Endpoint("i0", pending_prefill=10), Endpoint("i1", pending_prefill=9000, full=True)]
    assert router.choose(request(host="i0"), pool).instance_id == "i0"  # its host, however loaded the others
    assert router.choose(request(host="i1"), pool) is None  # has-room applies though not listed: it waits
    assert make_router("least-load", filters=[]).choose(request(), [Endpoint("i0", full=True)]) is None


@pytest.mark.parametrize("router,error", [
    ({"filters": ["session-hash", "session-host"]}, "at most one of session-hash, session-host"),
    ({"filters": ["has-room", "has-room"]}, "a filter is listed twice"),
    ({"filters": ["nearest"]}, "filters.0"),
    ({"scorers": [{"name": "prefix-hit", "weight": -1}]}, "scorers.0.weight"),
    ({"scorers": [{"name": "fastest"}]}, "scorers.0.name"),
])
def test_a_router_list_that_cannot_work_is_refused_naming_it(router, error):
    with pytest.raises(ValidationError, match=error):
        make_router("least-load", **router)


def test_every_choice_says_why_in_the_words_of_what_decided_it():
    def why(router, pool, **asked) -> str:
        return make_router(router).choose(request(**asked), pool).why

    busy = endpoints(0, 0, 0, inflight=[5, 2, 7], capacity=[8, 8, 8])
    assert why("least-load", busy) == "2 of 8 slots busy"  # no prefill pending anywhere: requests in flight decided
    assert why("least-load", endpoints(4000, 1200)) == "1.2k tokens of prompt pending"
    assert why("kv-aware", endpoints(0, 0, cached_tokens=[0, 2048])) == "2.0k tokens cached"
    assert why("least-load", endpoints(0, 0, inflight=[1, 1])) == "0 tokens of prompt pending, 2 of 2 tied, drawn"
    assert why("least-load", endpoints(0, 9, full=[False, True])) == "the only instance with room"
    assert why("sticky", endpoints(0, 0)) == "session hash"
    assert why("round-robin", endpoints(0, 0)) == "next in turn"
    assert why("ear", endpoints(1000, 500, cached_tokens=[2500, 0]), prompt_tokens=4000) == "500 tokens of prompt pending"
    assert why("ear", endpoints(0, 0), host="i1") == "session bound"
    assert why("ear", endpoints(0, 0), host="i9") == "session's host gone, placed anew"
    hot = endpoints(0, 0, inflight=[0, 8], full=[False, True])
    assert why("ear", hot, host="i1", context_tokens=3100, moved_at=0.0) == "moved off hot instance with 3.1k tokens of KV"
