"""Small helpers shared by tests."""

from __future__ import annotations

import asyncio


async def eventually(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Wait until `await predicate()` is truthy; return its value or fail with the last one."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value {value!r})")
        await asyncio.sleep(interval)
