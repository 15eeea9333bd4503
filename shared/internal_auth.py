"""The cluster secret, and requests signed with it: how an engine knows a call to its internal port is the pool's.

An engine's internal port moves conversations' KV in and out (seed 004): whoever
could call it could read a session's cache or plant one. Every call is signed
by a holder of the cluster secret (the gateway, the worker): an HMAC-SHA256 over
the method, the path with its query, a timestamp, a one-time nonce and the
body's SHA-256, sent as four headers. The receiving side (`SignedOnly`)
refuses a call that is unsigned, signed with another key, older or newer than
`MAX_SKEW_S`, or whose nonce it has already seen (a replay), with 401 before it
reads a byte of the body; it then reads the body up to its path's limit (413
beyond) and refuses it (401) unless it is the body that was signed.

The secret comes from `MODELPOOL_CLUSTER_SECRET` or a file named by
`MODELPOOL_CLUSTER_SECRET_FILE` (compose and Kubernetes secrets); `modelpool up`
makes one at the embedded cluster's first start (`.modelpool/cluster-secret`,
mode 0600). Without one, internal ports refuse every call: nothing is
unauthenticated by default.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.openai_protocol import APIError

SECRET_ENV = "MODELPOOL_CLUSTER_SECRET"
SECRET_FILE_ENV = "MODELPOOL_CLUSTER_SECRET_FILE"
MIN_SECRET_CHARS = 32

TIMESTAMP_HEADER = "x-modelpool-timestamp"
NONCE_HEADER = "x-modelpool-nonce"
SIGNATURE_HEADER = "x-modelpool-signature"
BODY_DIGEST_HEADER = "x-modelpool-content-sha256"
MAX_SKEW_S = 30.0
"""A signed call is good this long either side of its timestamp; its nonce is remembered as long."""
MAX_NONCES = 100_000
"""Nonces remembered at most (oldest forgotten first): a flood of signed calls cannot grow memory without bound."""
DEFAULT_BODY_LIMIT = 1 << 20


class SecretError(ValueError):
    """The configured cluster secret is unusable (the message names the setting)."""


def secret_from_environment(environ: Mapping[str, str]) -> bytes | None:
    """The cluster secret the environment gives, by value or by file; None when neither is set."""
    return load_secret(environ.get(SECRET_ENV), environ.get(SECRET_FILE_ENV))


def load_secret(value: str | None, path: str | None) -> bytes | None:
    """The cluster secret given by `value`, else read from the file at `path`; None when neither is."""
    source = SECRET_ENV
    if not value and path:
        source = f"{SECRET_FILE_ENV} ({path})"
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise SecretError(f"{source}: cannot read it: {exc.strerror}") from None
    if not value:
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise SecretError(f"{source}: the cluster secret must be {MIN_SECRET_CHARS} characters at least")
    return value.encode()


def make_secret_file(path: Path, min_chars: int = MIN_SECRET_CHARS) -> Path:
    """A secret in `path` (the cluster's, or a token), made if absent or shorter than `min_chars`, readable by its
    owner only; the path."""
    if path.exists() and len(path.read_text().strip()) >= min_chars:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(32) + "\n")
    return path


def _mac(secret: bytes, method: str, target: str, timestamp: str, nonce: str, digest: str) -> str:
    message = "\n".join((method.upper(), target, timestamp, nonce, digest)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, target: str, body: bytes = b"", *, now: float | None = None) -> dict[str, str]:
    """The headers that sign a call of `method` on `target` (path and query, as sent) carrying `body`."""
    timestamp = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    digest = hashlib.sha256(body).hexdigest()
    return {TIMESTAMP_HEADER: timestamp, NONCE_HEADER: nonce, BODY_DIGEST_HEADER: digest,
            SIGNATURE_HEADER: _mac(secret, method, target, timestamp, nonce, digest)}


class Unauthorized(Exception):
    """Why a call was refused."""


class Verifier:
    """Checks signed calls against one secret, remembering nonces for `MAX_SKEW_S` to refuse replays."""

    def __init__(self, secret: bytes | None, *, clock: Callable[[], float] = time.time) -> None:
        self.secret = secret
        self.clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()

    def verify(self, method: str, target: str, headers: Mapping[str, str]) -> str:
        """Check a call's signed headers (its body is checked against the digest returned, once read)."""
        if self.secret is None:
            raise Unauthorized("this engine has no cluster secret: its internal port refuses every call")
        timestamp, nonce, digest, signature = (
            headers.get(h) for h in (TIMESTAMP_HEADER, NONCE_HEADER, BODY_DIGEST_HEADER, SIGNATURE_HEADER))
        if not (timestamp and nonce and digest and signature):
            raise Unauthorized("the call is not signed")
        try:
            sent = float(timestamp)
        except ValueError:
            raise Unauthorized("the call's timestamp is not a number") from None
        now = self.clock()
        if abs(now - sent) > MAX_SKEW_S:
            raise Unauthorized(f"the call's timestamp is {now - sent:+.0f} s off this host's clock")
        if not hmac.compare_digest(signature, _mac(self.secret, method, target, timestamp, nonce, digest)):
            raise Unauthorized("the call's signature does not match")
        self._forget_before(now - 2 * MAX_SKEW_S)
        if nonce in self._seen:
            raise Unauthorized("the call was replayed")
        self._seen[nonce] = now
        while len(self._seen) > MAX_NONCES:
            self._seen.popitem(last=False)
        return digest

    def _forget_before(self, cutoff: float) -> None:
        while self._seen and next(iter(self._seen.values())) < cutoff:
            self._seen.popitem(last=False)


class SignedOnly:
    """ASGI middleware: every call but `GET /health` must be signed, and its body within its path's limit.

    The signed headers are checked first (an unsigned caller's body is never
    read), then the body, up to the limit whatever Content-Length says, against
    the signed digest; the app then reads it as usual.
    """

    def __init__(self, app: ASGIApp, verifier: Verifier, *,
                 limits: Mapping[str, Callable[[], int]] | None = None) -> None:
        self.app = app
        self.verifier = verifier
        self.limits = dict(limits or {})
        """Body limits by path, where a path's differs from `DEFAULT_BODY_LIMIT` (read per call: an engine knows
        its sequences' size only once its model is loaded)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"] == "GET" and scope["path"] == "/health"):
            await self.app(scope, receive, send)
            return
        limit = self.limits[scope["path"]]() if scope["path"] in self.limits else DEFAULT_BODY_LIMIT
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        target = scope["path"] + (f"?{scope['query_string'].decode('latin-1')}" if scope["query_string"] else "")
        try:
            try:
                digest = self.verifier.verify(scope["method"], target, headers)
            except Unauthorized as exc:
                raise _unauthorized(str(exc)) from None
            declared = headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > limit):
                raise _too_large(limit)
            body = await _read_body(receive, limit)
            if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), digest):
                raise _unauthorized("the body is not the one that was signed")
        except APIError as err:
            await _send_error(send, err)
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(400, "the client went away before its body was read", type="invalid_request_error")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _unauthorized(why: str) -> APIError:
    return APIError(401, why, type="authentication_error", code="unsigned_internal_call")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the body is over this endpoint's limit of {limit} bytes", type="invalid_request_error",
                    code="body_too_large")


async def _send_error(send: Send, err: APIError) -> None:
    body = orjson.dumps(err.to_dict())
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
