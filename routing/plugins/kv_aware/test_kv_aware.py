
from routing.plugins.testing import endpoints, make_router, request


def test_the_expected_hit_outweighs_a_moderately_higher_load():
    router = make_router("kv-aware", kv_weight=2.0, load_weight=1.0)
    # i1 holds 90 % of the prompt but has the most pending prefill: 2 x 0.9 + 0 beats 2 x 0 + 1.
    pool = endpoints(0, 6000, 3000, cached_tokens=[0, 9000, 0])
    assert router.choose(request(prompt_tokens=10_000), pool).instance_id == "i1"


def test_with_no_hit_anywhere_it_is_least_load_and_the_weights_move_the_balance():
    assert make_router("kv-aware", kv_weight=2.0, load_weight=1.0).choose(request(), endpoints(700, 100, 400)).instance_id == "i1"
    pool = endpoints(0, 6000, cached_tokens=[0, 3000])
    assert make_router("kv-aware", kv_weight=2.0, load_weight=1.0).choose(request(prompt_tokens=10_000), pool).instance_id == "i0"
    assert make_router("kv-aware", kv_weight=4.0, load_weight=1.0).choose(request(prompt_tokens=10_000), pool).instance_id == "i1"
