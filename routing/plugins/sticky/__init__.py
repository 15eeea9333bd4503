"""sticky: every request of a session to the same instance, chosen by a hash of the session.

Rendezvous hashing (highest random weight): each session ranks the instances by
a hash of (session, instance) and takes the first, so an instance coming or
going moves only the sessions it wins or held. Nothing is recorded: any gateway
replica computes the same instance. A session whose instance is full waits for
it, as hard pinning does.
"""

from __future__ import annotations

import hashlib

from routing.scheduler import Endpoint, RoutingRequest


def rank(session_id: str, instance_id: str) -> int:
    digest = hashlib.blake2b(f"{session_id}\x00{instance_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def session_hash(request: RoutingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
    """Only the instance the session's hash ranks first among all the candidates."""
    return [max(endpoints, key=lambda e: rank(request.session.session_id, e.instance_id))]
