
from routing.plugins.testing import endpoints, make_router, request


def test_a_session_always_lands_on_its_hashed_instance_whatever_the_load_or_order():
    router = make_router("sticky")
    pool = endpoints(0, 0, 0, 0, 0, 0, 0, 0)
    home = {s: router.choose(request(session=s), pool).instance_id for s in map(str, range(200))}
    assert len(set(home.values())) == 8  # the sessions spread over every instance
    loaded = endpoints(*(10_000 * i for i in range(8)))
    assert all(router.choose(request(session=s), loaded[::-1]).instance_id == i for s, i in home.items())


def test_an_instance_leaving_moves_only_its_own_sessions_and_a_full_one_makes_them_wait():
    router = make_router("sticky")
    pool = endpoints(0, 0, 0, 0)
    home = {s: router.choose(request(session=s), pool).instance_id for s in map(str, range(100))}
    fewer = [e for e in pool if e.instance_id != "i2"]
    for s, i in home.items():
        if i != "i2":
            assert router.choose(request(session=s), fewer).instance_id == i
    s = next(s for s, i in home.items() if i == "i0")
    assert router.choose(request(session=s), endpoints(0, 0, 0, 0, full=[True, False, False, False])) is None
