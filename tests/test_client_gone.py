"""The one disconnect watcher: it returns on `http.disconnect` and on nothing else."""

from __future__ import annotations

import asyncio

from shared.client_gone import client_gone


async def test_the_watcher_returns_only_when_the_client_disconnects():
    messages: asyncio.Queue[dict] = asyncio.Queue()
    watcher = asyncio.ensure_future(client_gone(messages.get))
    await messages.put({"type": "http.request", "body": b"late", "more_body": False})
    await asyncio.sleep(0.05)
    assert not watcher.done()  # another message is read and let pass
    await messages.put({"type": "http.disconnect"})
    await asyncio.wait_for(watcher, 1.0)
    assert messages.empty()
