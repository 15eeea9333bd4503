"""Per-key limits over a sliding minute, shared between gateway replicas by their usage reports
(`services/gateway/quotas.py`), on a clock the test moves."""

from __future__ import annotations

import pytest

from services.gateway.quotas import STALE_S, KeyLimits, Quotas
from shared.contracts.config import ConfigError, GatewayConfig, TenantKey, key_id
from shared.openai_protocol import APIError


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def quotas(clock: Clock, gateway: str = "g1") -> Quotas:
    return Quotas(gateway, wall=clock, clock=clock)


def refusal(call) -> APIError:
    with pytest.raises(APIError) as raised:
        call()
    return raised.value


def test_requests_per_minute_slide_and_say_when_to_retry() -> None:
    clock = Clock()
    q = quotas(clock)
    limits = KeyLimits("k", rpm=3)
    for _ in range(2):
        q.enter(limits, "chat", 10, lambda: 0)
    clock.now += 20
    q.enter(limits, "chat", 10, lambda: 0)
    clock.now += 10
    error = refusal(lambda: q.enter(limits, "chat", 10, lambda: 0))
    assert error.status == 429 and error.body.error.code == "rpm_exceeded"
    assert "`rpm` (3 requests per minute)" in error.body.error.message
    assert error.headers["Retry-After"] == "30"  # the first two age out 60 s after they came, 30 s from now
    clock.now += 30.5
    q.enter(limits, "chat", 10, lambda: 0)  # the minute slid past them


def test_tokens_per_minute_count_prompts_at_once_and_completions_as_they_stream() -> None:
    clock = Clock()
    q = quotas(clock)
    limits = KeyLimits("k", tpm=1000)
    streamed = [0]
    ticket = q.enter(limits, "chat", 300, lambda: streamed[0])
    streamed[0] = 400
    q.report()  # charges what streamed so far
    error = refusal(lambda: q.enter(limits, "chat", 400, lambda: 0))
    assert error.body.error.code == "tpm_exceeded" and "used 700 tokens" in error.body.error.message
    streamed[0] = 500
    q.leave(ticket, (350, 500))  # the engine's count: 50 more prompt, 100 more completion than charged
    assert sum(b.tokens for b in q.ledgers["k"].seconds) == 850
    q.enter(limits, "chat", 150, lambda: 0)  # exactly the limit
    too_big = refusal(lambda: quotas(Clock()).enter(limits, "chat", 1001, lambda: 0))
    assert "allows at all" in too_big.body.error.message


def test_concurrency_is_freed_when_a_request_ends() -> None:
    clock = Clock()
    q = quotas(clock)
    limits = KeyLimits("k", max_concurrent=2)
    first = q.enter(limits, "chat", 1, lambda: 0)
    q.enter(limits, "chat", 1, lambda: 0)
    error = refusal(lambda: q.enter(limits, "chat", 1, lambda: 0))
    assert error.body.error.code == "max_concurrent_exceeded" and error.headers["Retry-After"] == "1"
    q.leave(first, None)
    q.leave(first, None)  # twice changes nothing
    q.enter(limits, "chat", 1, lambda: 0)
    refusal(lambda: q.enter(limits, "chat", 1, lambda: 0))


def test_a_key_limited_to_some_aliases_is_refused_the_others() -> None:
    q = quotas(Clock())
    error = refusal(lambda: q.enter(KeyLimits("k", aliases=frozenset({"code"})), "chat", 1, lambda: 0))
    assert error.status == 403 and error.body.error.code == "model_not_allowed"
    q.enter(KeyLimits("k", aliases=frozenset({"code"})), "code", 1, lambda: 0)


def test_replicas_count_each_others_use_and_forget_a_silent_ones_requests_under_way() -> None:
    clock = Clock()
    one, two = quotas(clock, "g1"), quotas(clock, "g2")
    limits = KeyLimits("k", rpm=4, max_concurrent=3)
    for _ in range(2):
        one.enter(limits, "chat", 1, lambda: 0)
    two.hear(one.report())
    two.enter(limits, "chat", 1, lambda: 0)
    assert refusal(lambda: two.enter(limits, "chat", 1, lambda: 0)).body.error.code == "max_concurrent_exceeded"
    clock.now += STALE_S + 1  # g1 went silent: its requests under way ended with it, its minute still counts
    two.enter(limits, "chat", 1, lambda: 0)
    assert refusal(lambda: two.enter(limits, "chat", 1, lambda: 0)).body.error.code == "rpm_exceeded"
    two.hear(two.report())  # its own report is not counted twice
    assert len(two.heard) == 1


def test_new_sessions_are_bounded_per_minute() -> None:
    clock = Clock()
    q = quotas(clock)
    ticket = q.enter(KeyLimits("k", sessions_per_minute=2), "chat", 1, lambda: 0)
    assert [q.may_bind(ticket) for _ in range(3)] == [True, True, False]
    clock.now += 61
    assert q.may_bind(ticket)


def test_keys_carry_limits_in_the_pool_file_and_in_the_keys_file(tmp_path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("sk-a tenant=a rpm=60 tpm=10000 max_concurrent=4 aliases=chat,code sessions_per_minute=5\n")
    config = GatewayConfig(api_keys_file=str(keys_file), tenant_keys=[{"key": "sk-b", "tenant": "b", "rpm": 1}])
    keys = config.keys()
    assert keys["sk-a"].aliases == ("chat", "code") and keys["sk-a"].tpm == 10000
    limits = KeyLimits.of(keys["sk-b"], config.sessions_per_minute)
    assert limits.rpm == 1 and limits.sessions_per_minute == 300 and limits.key_id == key_id("sk-b")
    assert "sk-b" not in repr(keys["sk-b"])
    keys_file.write_text("sk-a rpm=0\n")
    with pytest.raises(ConfigError, match="rpm"):
        config.keys()
    keys_file.write_text("sk-a burst=3\n")
    with pytest.raises(ConfigError, match="burst"):
        config.keys()
    with pytest.raises(ValueError, match="max_concurrent"):
        TenantKey(key="k", tenant="t", max_concurrent=0)
