"""Signed calls to engines' internal ports and signed KV frames (shared/internal_auth.py, shared/kv_frames.py):
what is refused, and that nothing unsigned reaches an app."""

from __future__ import annotations

import os
import stat

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from shared import kv_frames
from shared.internal_auth import (
    MAX_NONCES,
    MAX_SKEW_S,
    SECRET_ENV,
    SECRET_FILE_ENV,
    SecretError,
    SignedOnly,
    Unauthorized,
    Verifier,
    make_secret_file,
    secret_from_environment,
    sign,
)
from shared.settings import Settings

KEY = b"k" * 40
OTHER = b"o" * 40


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def signed_app(secret: bytes | None = KEY, limit: int = 1024, clock: Clock | None = None) -> tuple[SignedOnly, list]:
    reached: list[bytes] = []

    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        reached.append(body)
        return JSONResponse({"bytes": len(body)})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[Route("/kv/import", echo, methods=["POST"]), Route("/health", health)])
    verifier = Verifier(secret, clock=clock or Clock())
    return SignedOnly(app, verifier, limits={"/kv/import": lambda: limit}), reached


async def post(app, body: bytes, headers: dict[str, str], path: str = "/kv/import") -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
        return await client.post(path, content=body, headers=headers)


async def test_a_signed_call_reaches_the_app_with_its_body() -> None:
    clock = Clock()
    app, reached = signed_app(clock=clock)
    answer = await post(app, b"frame", sign(KEY, "POST", "/kv/import", b"frame", now=clock.now))
    assert answer.status_code == 200 and answer.json() == {"bytes": 5}
    assert reached == [b"frame"]


@pytest.mark.parametrize("case", ["unsigned", "other key", "other body", "other path", "stale", "future",
                                  "bad timestamp"])
async def test_a_call_not_signed_for_exactly_this_is_refused_before_the_app_sees_it(case: str) -> None:
    clock = Clock()
    app, reached = signed_app(clock=clock)
    body, headers = b"frame", sign(KEY, "POST", "/kv/import", b"frame", now=clock.now)
    if case == "unsigned":
        headers = {}
    elif case == "other key":
        headers = sign(OTHER, "POST", "/kv/import", body, now=clock.now)
    elif case == "other body":
        body = b"frame!"
    elif case == "other path":
        headers = sign(KEY, "POST", "/kv/export", body, now=clock.now)
    elif case == "stale":
        clock.now += MAX_SKEW_S + 1
    elif case == "future":
        clock.now -= MAX_SKEW_S + 1
    else:
        headers["x-modelpool-timestamp"] = "yesterday"
    answer = await post(app, body, headers)
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["code"] == "unsigned_internal_call"
    assert reached == []


async def test_a_replayed_call_is_refused_and_nonces_are_bounded() -> None:
    clock = Clock()
    app, reached = signed_app(clock=clock)
    headers = sign(KEY, "POST", "/kv/import", b"x", now=clock.now)
    assert (await post(app, b"x", headers)).status_code == 200
    replayed = await post(app, b"x", headers)
    assert replayed.status_code == 401 and "replayed" in replayed.json()["error"]["message"]
    assert len(reached) == 1

    verifier = Verifier(KEY, clock=clock)
    for _ in range(MAX_NONCES + 10):
        verifier.verify("POST", "/p", sign(KEY, "POST", "/p", b"", now=clock.now))
    assert len(verifier._seen) == MAX_NONCES


async def test_a_body_over_the_limit_is_refused_by_its_length_or_as_it_streams() -> None:
    clock = Clock()
    app, reached = signed_app(limit=100, clock=clock)
    big = b"x" * 101
    declared = await post(app, big, sign(KEY, "POST", "/kv/import", big, now=clock.now))
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "body_too_large"

    async def chunks():
        for _ in range(5):
            yield b"x" * 30  # no content-length: read until the limit, then refused

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
        streamed = await client.post("/kv/import", content=chunks(),
                                     headers=sign(KEY, "POST", "/kv/import", b"x" * 150, now=clock.now))
    assert streamed.status_code == 413
    assert reached == []


async def test_without_a_secret_every_call_is_refused_but_health_answers() -> None:
    app, reached = signed_app(secret=None)
    refused = await post(app, b"x", sign(KEY, "POST", "/kv/import", b"x"))
    assert refused.status_code == 401 and "no cluster secret" in refused.json()["error"]["message"]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
        assert (await client.get("/health")).status_code == 200
    with pytest.raises(Unauthorized):
        Verifier(None).verify("POST", "/kv/import", {})


def frame(key: bytes = KEY, **header) -> bytes:
    return kv_frames.encode({"engine": "llama.cpp", "model": "m", "session": "s", "n_tokens": 3, **header},
                            b"state-bytes", key=key)


def test_a_kv_frame_decodes_only_with_the_key_that_signed_it_and_unaltered() -> None:
    good = frame()
    header, blob = kv_frames.decode(good, engine="llama.cpp", model="m", key=KEY)
    assert header["session"] == "s" and blob == b"state-bytes"
    with pytest.raises(kv_frames.Forged):
        kv_frames.decode(frame(OTHER), engine="llama.cpp", model="m", key=KEY)
    for i in range(0, len(good), 7):  # any flipped bit anywhere: header, blob or signature
        flipped = bytearray(good)
        flipped[i] ^= 0x01
        with pytest.raises(kv_frames.Forged):
            kv_frames.decode(bytes(flipped), engine="llama.cpp", model="m", key=KEY)
    for cut in (0, 5, 31, 32, 40, len(good) - 1):
        with pytest.raises(kv_frames.Forged):
            kv_frames.decode(good[:cut], engine="llama.cpp", model="m", key=KEY)
    with pytest.raises(kv_frames.Incompatible):  # signed by this cluster, but for another model
        kv_frames.decode(frame(model="other"), engine="llama.cpp", model="m", key=KEY)


def test_the_secret_comes_from_the_environment_or_its_file_and_a_bad_one_is_named(tmp_path) -> None:
    assert secret_from_environment({}) is None
    assert secret_from_environment({SECRET_ENV: "s" * 32}) == b"s" * 32
    path = make_secret_file(tmp_path / "creds" / "cluster-secret")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    made = path.read_text().strip()
    assert len(made) >= 32 and make_secret_file(path).read_text().strip() == made  # kept, not remade
    assert secret_from_environment({SECRET_FILE_ENV: str(path)}) == made.encode()
    with pytest.raises(SecretError, match=SECRET_ENV):
        secret_from_environment({SECRET_ENV: "short"})
    with pytest.raises(SecretError, match=SECRET_FILE_ENV):
        secret_from_environment({SECRET_FILE_ENV: str(tmp_path / "missing")})
    with pytest.raises(ValueError, match=SECRET_FILE_ENV):
        Settings.load({SECRET_FILE_ENV: str(tmp_path / "missing")})
    settings = Settings.load({SECRET_ENV: "v" * 40})
    assert settings.cluster_key == b"v" * 40 and "v" * 40 not in repr(settings)
