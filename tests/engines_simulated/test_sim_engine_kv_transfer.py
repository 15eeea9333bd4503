"""The simulated engine's internal port: a session's KV moved as a model (blocks named, bytes / bandwidth waited)."""

from __future__ import annotations

import time

import httpx
import pytest

from helpers import post_signed, start_engine, wait_healthy
from shared import kv_frames

MODEL = "sim-test"
BYTES_PER_TOKEN = 114_688  # the simulated engine's default shape


def request(text: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}


@pytest.fixture
def engines(tmp_path):
    started = [start_engine(tmp_path, "vllm", model, "--kv-transfer-gb-s", "1", internal=True)
               for model in (MODEL, MODEL, "another-model")]
    try:
        wait_healthy(started)
        yield started
    finally:
        for engine in started:
            engine.stop()


def test_an_exported_prefix_is_imported_after_its_transfer_time_and_then_hits_on_the_new_engine(engines) -> None:
    source, target, other = engines
    context = "the service's logs from last night " * 60
    export = {"session": "s1", "endpoint": "/v1/chat/completions", "request": request(context)}
    with httpx.Client(timeout=30) as client:
        assert client.post(f"{source.url}/v1/chat/completions", json=request(context)).status_code == 200
        assert client.post(f"{source.url}/kv/export", json=export).status_code == 404  # not on the public port

        unsigned = client.post(f"{source.internal_url}/kv/export", json=export)
        assert unsigned.status_code == 401 and unsigned.json()["error"]["code"] == "unsigned_internal_call"
        frame = post_signed(client, source.internal_url, "/kv/export", export)
        assert frame.status_code == 200 and frame.headers["content-type"] == kv_frames.MEDIA_TYPE
        started = time.monotonic()
        imported = post_signed(client, target.internal_url, "/kv/import", frame.content, kv_frames.MEDIA_TYPE)
        took = time.monotonic() - started
        assert imported.status_code == 200, imported.text
        moved = imported.json()
        assert moved["n_tokens"] >= 256 and moved["bytes"] == moved["n_tokens"] * BYTES_PER_TOKEN
        assert moved["transfer_s"] == pytest.approx(moved["bytes"] / 1e9)
        assert took >= moved["transfer_s"]  # 1 GB/s at speed-up 1: the wait is real

        hit = client.post(f"{target.url}/v1/chat/completions", json=request(context)).json()
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= moved["n_tokens"] - 16

        elsewhere = post_signed(client, other.internal_url, "/kv/import", frame.content, kv_frames.MEDIA_TYPE)
        assert elsewhere.status_code == 409 and elsewhere.json()["error"]["code"] == "incompatible_kv"
        unknown = post_signed(client, target.internal_url, "/kv/export",
                              {"session": "s1", "endpoint": "/v1/chat/completions", "request": request("never seen")})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "no_cached_prefix"
        garbage = post_signed(client, target.internal_url, "/kv/import", b"not a frame", kv_frames.MEDIA_TYPE)
        assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "bad_kv_frame"
        forged = kv_frames.encode({"engine": "simulated-vllm", "model": "x", "n_tokens": 16, "block_hashes": [1]},
                                  key=b"f" * 40)  # made without the cluster's secret
        garbage = post_signed(client, target.internal_url, "/kv/import", forged, kv_frames.MEDIA_TYPE)
        assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "bad_kv_frame"
