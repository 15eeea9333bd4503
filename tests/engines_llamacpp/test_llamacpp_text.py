"""Stop sequences never leak, and streamed text equals whole text."""

from __future__ import annotations

from services.engines.llamacpp.settings import EngineSettings
from services.engines.llamacpp.text_stream import TextAssembler

import pytest


def feed_all(stops: list[str], pieces: list[bytes]) -> tuple[str, bool]:
    t = TextAssembler(stops)
    out, stopped = "", False
    for p in pieces:
        text, stopped = t.feed(p)
        out += text
        if stopped:
            return out, True
    return out + t.flush(), False


def test_stop_split_across_tokens_is_cut() -> None:
    assert feed_all(["END"], [b"Paris", b" E", b"N", b"D and more"]) == ("Paris ", True)


def test_partial_stop_that_does_not_complete_is_released() -> None:
    assert feed_all(["END"], [b"Paris E", b"NGLAND"]) == ("Paris ENGLAND", False)


def test_held_text_is_flushed_at_the_end() -> None:
    assert feed_all(["\n\n"], [b"a", b"\n"]) == ("a\n", False)


def test_multibyte_characters_split_across_tokens() -> None:
    data = "Größe – 東京".encode()
    assert feed_all([], [data[i : i + 1] for i in range(len(data))]) == ("Größe – 東京", False)


def test_settings_layering_defaults_env_args() -> None:
    s = EngineSettings.load({}, env={})
    assert (s.max_queue, s.max_running, s.request_timeout_s, s.kv_cache_eviction_threshold) == (256, 8, 60.0, 0.8)
    s = EngineSettings.load({"port": 9000}, env={"MODELPOOL_LLAMACPP_PORT": "7000", "MODELPOOL_LLAMACPP_N_SEQ_MAX": "4"})
    assert s.port == 9000 and s.n_seq_max == 4 and s.ctx_per_seq == 2048
    with pytest.raises(ValueError):
        EngineSettings.load({"n_seq_max": 300}, env={})
    with pytest.raises(ValueError):
        EngineSettings.load({"max_batch_size": 9}, env={})
