"""Engines' internal ports read as an attacker would: unsigned, replayed, forged, truncated, bit-flipped,
oversized and wrong-model KV frames all get a 4xx, nothing of them reaches llama.cpp, and the engine serves on."""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest

from helpers import CLUSTER_KEY, signed, start_llama_engine, wait_healthy
from shared import kv_frames
from shared.openai_protocol import SESSION_TAG_HEADER

pytestmark = [pytest.mark.processes, pytest.mark.model]

ALIAS = "smollm2"
CHAT = {"model": ALIAS, "messages": [{"role": "user", "content": "Say hello to the team."}], "max_tokens": 8,
        "temperature": 0}


def frame_header(frame: bytes) -> dict:
    """A frame's header, its signature checked (the model read from the header itself)."""
    model = json.loads(frame[36 : 36 + int.from_bytes(frame[32:36], "big")])["model"]
    return kv_frames.decode(frame, engine="llama.cpp", model=model, key=CLUSTER_KEY)[0]


def export_body(session: str = "s1") -> bytes:
    return json.dumps({"session": session, "endpoint": "/v1/chat/completions", "request": CHAT}).encode()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two real engines of the same model and layout, and one of another layout; a small context, so a whole
    sequence's frame (the import limit) is a few MB."""
    work = tmp_path_factory.mktemp("engines")
    started = [start_llama_engine(work, ALIAS, "--n-seq-max", "4", "--n-ctx", "1024"),
               start_llama_engine(work, ALIAS, "--n-seq-max", "4", "--n-ctx", "1024"),
               start_llama_engine(work, ALIAS, "--n-seq-max", "2", "--n-ctx", "1024")]
    try:
        wait_healthy(started, timeout=120)
        yield started
    finally:
        for engine in started:
            engine.stop()


def test_every_hostile_import_gets_a_4xx_and_the_engine_serves_on(engines) -> None:
    source, target, other_layout = engines
    with httpx.Client(timeout=120) as client:
        served = client.post(f"{source.url}/v1/chat/completions", json=CHAT, headers={SESSION_TAG_HEADER: "s1"})
        assert served.status_code == 200, served.text
        exported = client.post(f"{source.internal_url}/kv/export", content=export_body(),
                               headers=signed("/kv/export", export_body()))
        assert exported.status_code == 200, exported.text
        good = exported.content

        def import_(frame: bytes, headers: dict[str, str] | None = None, engine=target) -> httpx.Response:
            return client.post(f"{engine.internal_url}/kv/import", content=frame,
                               headers=headers if headers is not None else signed("/kv/import", frame, kv_frames.MEDIA_TYPE))

        rng = random.Random(7)
        header_end = 32 + 4 + int.from_bytes(good[32:36], "big")
        hostile: dict[str, tuple[bytes, dict[str, str] | None]] = {
            "unsigned call": (good, {"content-type": kv_frames.MEDIA_TYPE}),
            "call signed with another key": (good, signed("/kv/import", good, kv_frames.MEDIA_TYPE, key=b"x" * 40)),
            "empty": (b"", None),
            "truncated in the header": (good[: header_end - 10], None),
            "truncated in the state": (good[: header_end + 100], None),
            "a flipped bit in the signature": (bytes([good[0] ^ 1]) + good[1:], None),
            "a flipped bit in the header": (good[:40] + bytes([good[40] ^ 1]) + good[41:], None),
            **{f"a flipped bit in the state at {i}": (good[:i] + bytes([good[i] ^ (1 << rng.randrange(8))]) + good[i + 1:], None)
               for i in sorted(rng.sample(range(header_end, len(good)), 5))},
            "a frame forged without the secret": (kv_frames.encode(
                {"engine": "llama.cpp", "model": "x", "session": "s9", "n_tokens": 3, "tokens": [1, 2, 3]},
                b"\x00" * 64, key=b"f" * 40), None),
            "random bytes": (rng.randbytes(4096), None),
        }
        for name, (frame, headers) in hostile.items():
            answer = import_(frame, headers)
            assert 400 <= answer.status_code < 500, f"{name}: {answer.status_code} {answer.text[:200]}"
            assert "error" in answer.json(), name

        oversized = b"\x00" * (8 << 20)  # past a whole sequence's frame at this context
        answer = import_(oversized)
        assert answer.status_code == 413, answer.text
        wrong_layout = import_(good, engine=other_layout)
        assert wrong_layout.status_code == 409 and wrong_layout.json()["error"]["code"] == "incompatible_kv"
        headers = signed("/kv/import", good, kv_frames.MEDIA_TYPE)
        assert import_(good, headers).status_code == 200  # the real frame, signed: taken
        replayed = import_(good, headers)
        assert replayed.status_code == 401 and "replayed" in replayed.json()["error"]["message"]

        for engine in engines:
            again = client.post(f"{engine.url}/v1/chat/completions", json=CHAT)
            assert again.status_code == 200, again.text
            assert engine.proc.poll() is None
        # One import taken of all of them: the real frame's.
        assert re.search(r"^llamacpp:kv_imports_total\{[^}]*\} 1$", client.get(f"{target.url}/metrics").text, re.M)


def test_an_export_hands_out_only_the_named_sessions_kv(engines) -> None:
    source = engines[0]
    with httpx.Client(timeout=120) as client:
        assert client.post(f"{source.url}/v1/chat/completions", json=CHAT,
                           headers={SESSION_TAG_HEADER: "alice"}).status_code == 200
        # Mallory names her own session with Alice's opening: nothing of Alice's comes out.
        mallory = client.post(f"{source.internal_url}/kv/export", content=export_body("mallory"),
                              headers=signed("/kv/export", export_body("mallory")))
        assert mallory.status_code == 404 and mallory.json()["error"]["code"] == "no_cached_prefix"
        alice = client.post(f"{source.internal_url}/kv/export", content=export_body("alice"),
                            headers=signed("/kv/export", export_body("alice")))
        assert alice.status_code == 200
        assert frame_header(alice.content)["session"] == "alice"

