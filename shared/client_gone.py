"""Noticing that an HTTP client left while its answer is being made: one watcher, for the gateway and both engines.

Once a request's body is read, only this watcher may call the ASGI `receive`: the
next message a server sends is `http.disconnect`, and whoever reads it first is the
one who knows the client is gone. Each caller races it against its own work and
decides what leaving means (the gateway stops waiting and closes the upstream; an
engine frees the request's KV at once).
"""

from __future__ import annotations

from starlette.types import Receive


async def client_gone(receive: Receive) -> None:
    """Return when the client disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass
