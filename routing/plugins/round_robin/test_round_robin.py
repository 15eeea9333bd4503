
from routing.plugins.testing import endpoints, make_router, request
from routing.scheduler import Endpoint


def test_each_instance_in_turn_whatever_its_load_and_skipping_a_full_one():
    router = make_router("round-robin")
    pool = endpoints(0, 90_000, 5)
    assert [router.choose(request(), pool).instance_id for _ in range(6)] == ["i0", "i1", "i2"] * 2
    pool[1] = Endpoint("i1", full=True)
    assert [router.choose(request(), pool).instance_id for _ in range(4)] == ["i0", "i2", "i0", "i2"]


def test_nothing_with_room_means_wait():
    assert make_router("round-robin").choose(request(), [Endpoint("i0", full=True)]) is None
