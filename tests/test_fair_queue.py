"""The order a saturated alias's waiters are served in (routing/fairness.py over routing/queue.py): priority
classes with aging, then token-fair shares between tenants, then arrival; and the keys that say whose a request is."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from routing.fairness import HIGH, LOW, NORMAL, FairShare, Tenancy
from routing.queue import AdmissionQueue
from shared.configuration import pool_config
from shared.contracts.config import ConfigError, anonymous_tenant

A, B = Tenancy("a"), Tenancy("b")


@dataclass(eq=False)
class Req:
    name: str
    tenancy: Tenancy
    entered: float
    tokens: int = 100


def served(share: FairShare, queue: AdmissionQueue, now: float, slots: int, completion: int = 0) -> list[str]:
    """Grant `slots` slots one at a time (as they free), charging prompts at grant and completions at once."""
    order = []

    def take(req: Req):
        nonlocal slots
        if slots <= 0:
            return None
        slots -= 1
        share.charge(req.tenancy, req.tokens + completion)
        return "slot"

    for req, _ in queue.pump(now, take, False, lambda w: share.order(w, now, lambda r: r.tenancy, lambda r: r.entered)):
        order.append(req.name)
    return order


def enqueue(share: FairShare, queue: AdmissionQueue, req: Req) -> None:
    waiting = {r.tenancy.tenant for r in queue.waiting}
    queue.enqueue(req, req.entered)
    if req.tenancy.tenant not in waiting:
        share.joined(req.tenancy.tenant, waiting)


def test_a_flooding_tenant_does_not_hold_back_a_light_one() -> None:
    share, queue = FairShare(), AdmissionQueue("m", 1000)
    for i in range(100):
        enqueue(share, queue, Req(f"a{i}", A, i * 0.01))
    enqueue(share, queue, Req("b0", B, 2.0))
    first = served(share, queue, 2.0, 3)
    assert "b0" in first[:2], first  # FIFO would serve it 101st
    fifo = AdmissionQueue("m", 1000)
    for i in range(100):
        fifo.enqueue(Req(f"a{i}", A, i * 0.01), 0)
    fifo.enqueue(Req("b0", B, 2.0), 0)
    assert [r.name for r, _ in fifo.pump(2.0, lambda r: "slot", False)][-1] == "b0"


def test_shares_follow_weights_in_tokens_not_requests() -> None:
    heavy, light = Tenancy("heavy", weight=3.0), Tenancy("light", weight=1.0)
    share, queue = FairShare(), AdmissionQueue("m", 10_000)
    for i in range(400):
        enqueue(share, queue, Req(f"h{i}", heavy, 0.0, tokens=100))
        enqueue(share, queue, Req(f"l{i}", light, 0.0, tokens=100))
    order = served(share, queue, 0.0, 200)
    assert abs(sum(n.startswith("h") for n in order) / len(order) - 0.75) < 0.02
    # Long prompts cost what they cost: a tenant sending 4x longer prompts gets a quarter as many requests in.
    long, short = Tenancy("long"), Tenancy("short")
    share, queue = FairShare(), AdmissionQueue("m", 10_000)
    for i in range(400):
        enqueue(share, queue, Req(f"L{i}", long, 0.0, tokens=400))
        enqueue(share, queue, Req(f"S{i}", short, 0.0, tokens=100))
    order = served(share, queue, 0.0, 250)
    assert abs(sum(n.startswith("S") for n in order) / sum(n.startswith("L") for n in order) - 4.0) < 0.2


def test_an_idle_tenant_banks_no_credit() -> None:
    share, queue = FairShare(), AdmissionQueue("m", 10_000)
    for i in range(50):  # A alone for a while: served 50 requests
        enqueue(share, queue, Req(f"a{i}", A, 0.0))
    served(share, queue, 0.0, 50)
    for i in range(50, 100):
        enqueue(share, queue, Req(f"a{i}", A, 1.0))
    for i in range(50):  # B arrives after being idle all along: it does not get 50 requests in a row
        enqueue(share, queue, Req(f"b{i}", B, 1.0))
    order = served(share, queue, 1.0, 20)
    assert 8 <= sum(n.startswith("b") for n in order) <= 12, order


def test_higher_classes_go_first_and_a_lower_one_ages_into_them() -> None:
    share, queue = FairShare(aging_s=10.0), AdmissionQueue("m", 100)
    low, normal, high = Tenancy("l", priority=LOW), Tenancy("n", priority=NORMAL), Tenancy("h", priority=HIGH)
    enqueue(share, queue, Req("low-old", low, 0.0))
    enqueue(share, queue, Req("normal", normal, 5.0))
    enqueue(share, queue, Req("high", high, 6.0))
    assert served(share, queue, 6.0, 1) == ["high"]
    assert served(share, queue, 6.0, 1) == ["normal"]
    enqueue(share, queue, Req("high-2", high, 25.0))
    # 25 s waited is two classes up: the low request competes as a high one, and is older.
    assert served(share, queue, 25.0, 1) == ["low-old"]


def test_keys_carry_their_tenant_weight_and_priority(tmp_path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("sk-a tenant=team-a weight=2 priority=high  # team A\nsk-plain\n\n# nothing\n")
    pool = pool_config({"gateway": {"api_keys": "sk-listed", "api_keys_file": str(keys_file),
                                    "tenant_keys": [{"key": "sk-b", "tenant": "team-b", "priority": "low"}]}},
                       environ={})
    keys = pool.gateway.keys()
    assert (keys["sk-a"].tenant, keys["sk-a"].weight, keys["sk-a"].priority) == ("team-a", 2.0, "high")
    assert keys["sk-b"].tenant == "team-b" and keys["sk-plain"].tenant == anonymous_tenant("sk-plain")
    assert keys["sk-listed"].tenant.startswith("key-") and "sk-listed" not in repr(keys["sk-listed"])
    keys_file.write_text("sk-a tenant=team-a colour=blue\n")
    with pytest.raises(ConfigError, match=r"gateway.api_keys_file: .*:1: 'colour=blue'"):
        pool.gateway.keys()
    keys_file.write_text("sk-a weight=-1\n")
    with pytest.raises(ConfigError, match=r"gateway.api_keys_file: .*:1: .*weight"):
        pool.gateway.keys()
