
import pytest

from routing.plugins.testing import endpoints, make_router, request

T_HOT, T_COOL = 8000, 30.0


@pytest.fixture
def ear():
    return make_router("ear", t_hot_tokens=T_HOT, t_cool_s=T_COOL)


@pytest.fixture
def unbudgeted():
    """EAR whose moves recompute whatever they save more wait than."""
    return make_router("ear", t_hot_tokens=T_HOT, t_cool_s=T_COOL, recompute_budget=None)


def test_a_new_session_goes_to_the_fewest_pending_prefill_tokens(ear):
    choice = ear.choose(request(), endpoints(3000, 500, 9000))
    assert (choice.instance_id, choice.moved_from) == ("i1", None)


def test_a_new_session_goes_by_load_even_where_another_instance_holds_part_of_its_prompt(ear):
    # i0 holds 1,000 of the 4,000-token prompt (a shared tool description) but has 500 more tokens pending: the
    # session goes to i1, which computes the prefix once and serves it from its own cache thereafter.
    pool = endpoints(1000, 500, 3000, cached_tokens=[1000, 0, 0])
    assert ear.choose(request(prompt_tokens=4000), pool).instance_id == "i1"
    kv_aware = make_router("kv-aware")  # the baseline that weighs the prefix 2:1 over load keeps it on i0
    assert kv_aware.choose(request(prompt_tokens=4000), pool).instance_id == "i0"


def earn(router, hits: int) -> None:
    """Place one bound request whose host holds `hits` of its prompt: the expected hit a recompute budget earns on."""
    choice = router.choose(request(session="earner", host="i0", prompt_tokens=hits), endpoints(0, cached_tokens=[hits]))
    assert choice.reason == "bound"


def test_later_turns_stay_on_the_host_while_it_is_not_hot_even_when_others_are_idler(ear):
    choice = ear.choose(request(host="i2"), endpoints(0, 0, T_HOT))  # at T_hot, not over it
    assert (choice.instance_id, choice.moved_from, choice.reason) == ("i2", None, "bound")


def test_a_hot_host_moves_the_session_to_the_least_loaded_instance_that_can_hold_it(ear):
    # i1 is the least loaded but cannot hold the session's 20k tokens of context; i0 can.
    pool = endpoints(2000, 100, T_HOT + 1, 4000, kv_free_tokens=[50_000, 10_000, 0, None])
    choice = ear.choose(request(host="i2", context_tokens=20_000), pool)
    assert (choice.instance_id, choice.moved_from, choice.reason) == ("i0", "i2", "host_hot")


def test_a_move_that_recomputes_counts_the_context_against_the_wait_it_saves(unbudgeted):
    ear = unbudgeted
    # The host holds 11k of the 12k-token prompt: 1k to compute behind 9k queued, 10k in all. An idle instance
    # would compute all 12k: more than staying. One holding 8k of it (say a shared prefix) would compute 4k, 3k
    # of them recomputed context: 7k.
    pool = endpoints(9000, 0, 0, cached_tokens=[11_000, 0, 8_000])
    turn = request(host="i0", prompt_tokens=12_000, context_tokens=11_000)
    assert ear.choose(turn, pool[:2]).instance_id == "i0"
    assert (ear.choose(turn, pool).instance_id, ear.choose(turn, pool).moved_from) == ("i2", "i0")


def test_a_move_that_recomputes_must_save_more_than_the_work_it_adds(unbudgeted):
    ear = unbudgeted
    # Staying: 20k queued + 1k new. Moving to the idle i1 recomputes 11k of context: the request waits 12k, but
    # the 11k it adds to the pool count too (23k), so it stays; behind 25k queued it moves.
    turn = request(host="i0", prompt_tokens=12_000, context_tokens=11_000)
    assert ear.choose(turn, endpoints(20_000, 0, cached_tokens=[11_000, 0])).instance_id == "i0"
    assert ear.choose(turn, endpoints(25_000, 0, cached_tokens=[11_000, 0])).instance_id == "i1"


def test_a_move_that_carries_the_kv_counts_only_the_new_tokens_and_needs_both_ends_to_move_it(ear):
    pool = endpoints(9000, 0, cached_tokens=[11_000, 0], moves_kv=[True, True])
    turn = request(host="i0", prompt_tokens=12_000, context_tokens=11_000)
    assert ear.choose(turn, pool).instance_id == "i1"  # 1k on i1 against 10k on the host
    assert ear.choose(turn, endpoints(9000, 0, cached_tokens=[11_000, 0], moves_kv=[True, False])).instance_id == "i0"
    recompute = make_router("ear", t_hot_tokens=T_HOT, t_cool_s=T_COOL, move_kv=False)
    assert recompute.choose(turn, pool).instance_id == "i0"


def test_moves_that_recompute_spend_at_most_the_budget_of_the_hits_placements_expect():
    # Behind 25k queued, the session would recompute its 11k of context on the idle i1 (test above). With a 2 %
    # budget a move waits until 2 % of the hits placed so far cover the 11k: 550k of them.
    ear = make_router("ear", t_hot_tokens=T_HOT, t_cool_s=T_COOL)
    turn = request(host="i0", prompt_tokens=12_000, context_tokens=11_000)
    hot = endpoints(25_000, 0, cached_tokens=[11_000, 0])
    assert ear.choose(turn, hot).instance_id == "i0"  # nothing earned yet; staying, the turn earns its 11k of hits
    earn(ear, 550_000 - 11_000 - 1)
    assert ear.choose(turn, hot).instance_id == "i0"  # one hit short; staying earns 11k more
    assert ear.choose(turn, hot).instance_id == "i1"  # the move spends 11k of the 11.2k allowed
    assert ear.choose(turn, hot).instance_id == "i0"  # and the next waits again
    # A move that carries the KV recomputes nothing, and spends nothing.
    carried = endpoints(25_000, 0, cached_tokens=[11_000, 0], moves_kv=[True, True])
    assert ear.choose(turn, carried).instance_id == "i1"
    assert make_router("ear", t_hot_tokens=T_HOT, recompute_budget=0).choose(turn, carried).instance_id == "i1"


def test_no_target_strictly_less_loaded_or_with_room_means_stay(ear):
    hot = T_HOT + 5000
    assert ear.choose(request(host="i0"), endpoints(hot, hot, hot + 1)).instance_id == "i0"
    assert ear.choose(request(host="i0", context_tokens=9000), endpoints(hot, 0, kv_free_tokens=[0, 8000])).instance_id == "i0"
    assert ear.choose(request(host="i0"), endpoints(hot, 0, full=[False, True])).instance_id == "i0"
    # Equal wait: the move gains nothing.
    assert ear.choose(request(host="i0", prompt_tokens=1000), endpoints(hot, hot - 1000, cached_tokens=[1000, 0])).instance_id == "i0"


def test_a_session_that_moved_within_t_cool_stays_and_may_move_again_after_it(ear):
    pool = endpoints(T_HOT * 2, 0)
    assert ear.choose(request(host="i0", moved_at=1000.0 - T_COOL + 1), pool).instance_id == "i0"
    assert ear.choose(request(host="i0", moved_at=1000.0 - T_COOL), pool).moved_from == "i0"


def test_a_full_host_is_hot_and_in_cooldown_the_session_waits_for_it(ear):
    pool = endpoints(0, 0, full=[True, False])
    assert ear.choose(request(host="i0"), pool).instance_id == "i1"
    assert ear.choose(request(host="i0", moved_at=999.0), pool) is None


def test_a_host_that_is_gone_is_replaced_by_load(ear):
    choice = ear.choose(request(host="gone"), endpoints(300, 100))
    assert (choice.instance_id, choice.moved_from, choice.reason) == ("i1", "gone", "host_gone")


def test_affinity_is_ear_without_moves():
    affinity = make_router("affinity", t_hot_tokens=T_HOT, t_cool_s=T_COOL)
    assert affinity.choose(request(host="i0"), endpoints(T_HOT * 10, 0)).instance_id == "i0"
    assert affinity.choose(request(host="i0"), endpoints(0, 0, full=[True, False])) is None
    assert affinity.choose(request(), endpoints(T_HOT * 10, 0)).instance_id == "i1"


def test_with_pull_prefix_a_new_session_goes_by_load_and_pulls_the_prefix_from_its_holder():
    # i0 holds half the prompt but has 5,500 more tokens pending than i1: EAR places by load and i1 computes the
    # prefix again; pulling, i1 takes it from i0 instead. kv-aware's scorers keep the request on i0 unless they
    # pull: then every instance that moves KV holds as much, so load decides for them too.
    pool = endpoints(6000, 500, 9000, cached_tokens=[2000, 0, 0], moves_kv=[True, True, True])
    assert make_router("ear").choose(request(prompt_tokens=4000), pool).prefix_from is None
    assert make_router("kv-aware").choose(request(prompt_tokens=4000), pool).instance_id == "i0"
    for plugin in ("ear", "kv-aware"):
        choice = make_router(plugin, pull_prefix=True).choose(request(prompt_tokens=4000), pool)
        assert (choice.instance_id, choice.prefix_from) == ("i1", "i0")
        assert choice.why.endswith("2.0k tokens pulled")
    # An engine that cannot import KV does not see the holder's prefix as its own, nor pull it; one that cannot
    # export it is no source; the move_kv switch turns pulling off with moving.
    stuck = endpoints(6000, 500, 9000, cached_tokens=[2000, 0, 0], moves_kv=[True, False, True])
    choice = make_router("kv-aware", pull_prefix=True).choose(request(prompt_tokens=4000), stuck)
    assert choice.instance_id == "i0" and choice.prefix_from is None
    assert make_router("ear", pull_prefix=True).choose(request(prompt_tokens=4000), stuck).prefix_from is None
    mute = endpoints(6000, 500, 9000, cached_tokens=[2000, 0, 0], moves_kv=[False, True, True])
    assert make_router("ear", pull_prefix=True).choose(request(prompt_tokens=4000), mute).prefix_from is None
    assert make_router("ear", pull_prefix=True, move_kv=False).choose(request(prompt_tokens=4000), pool).prefix_from is None


def test_nothing_is_pulled_for_a_bound_session_or_a_prefix_shorter_than_a_block():
    router = make_router("ear", pull_prefix=True, t_hot_tokens=T_HOT)
    pool = endpoints(6000, 500, 9000, cached_tokens=[2000, 0, 0], moves_kv=[True, True, True])
    bound = router.choose(request(prompt_tokens=4000, host="i1"), pool)  # its host holds its KV
    assert (bound.instance_id, bound.prefix_from) == ("i1", None)
    short = endpoints(6000, 500, 9000, cached_tokens=[400, 0, 0], moves_kv=[True, True, True])
    assert router.choose(request(prompt_tokens=4000), short).prefix_from is None
    kv_aware = make_router("kv-aware", pull_prefix=True)  # any router may pull: each request is placed anew
    assert kv_aware.choose(request(prompt_tokens=4000), pool).prefix_from == "i0"
