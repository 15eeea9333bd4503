
from routing.plugins.testing import endpoints, make_router, request


def test_the_fewest_pending_prefill_tokens_wins_and_requests_in_flight_break_a_tie():
    router = make_router("least-load")
    assert router.choose(request(), endpoints(5000, 200, 3000)).instance_id == "i1"
    assert router.choose(request(), endpoints(0, 0, 0, inflight=[3, 1, 2])).instance_id == "i1"
    # A session is not bound: its next turn goes wherever the load is least.
    assert router.choose(request(host="i1"), endpoints(5000, 9000, 10)).instance_id == "i2"
    assert router.choose(request(host="i1"), endpoints(5000, 9000, 10)).moved_from is None


def test_a_full_instance_is_passed_over_however_idle():
    router = make_router("least-load")
    assert router.choose(request(), endpoints(0, 4000, full=[True, False])).instance_id == "i1"
