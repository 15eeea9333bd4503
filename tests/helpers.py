"""Small helpers shared by tests."""

from __future__ import annotations

import asyncio
import inspect


async def eventually(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Wait until `predicate()` (sync or async) is truthy; return its value or fail with the last one."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value {value!r})")
        await asyncio.sleep(interval)
