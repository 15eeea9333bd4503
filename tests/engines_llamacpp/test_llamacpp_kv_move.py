"""A session's KV moved between two llama.cpp engines (seed 004): exported from one, imported into another,
decoding on as if it had never moved; only through the internal port."""

from __future__ import annotations

import json
import re
import statistics

import httpx
import numpy as np
import pytest

from helpers import signed
from llamacpp_helpers import THREADS, chat
from services.engines.llamacpp.chat_template import ChatTemplate
from services.engines.llamacpp.llama_backend import LlamaModelConfig, DecodeError, LlamaBackend
from services.engines.llamacpp.model_files import default_model_path
from services.engines.llamacpp.scheduler import SeqWork
from shared import kv_frames
from shared.openai_protocol import SESSION_TAG_HEADER

STEPS = 8


def _greedy(backend: LlamaBackend, seq_id: int, first: int, pos0: int) -> tuple[list[int], list[np.ndarray]]:
    """Decode STEPS greedy tokens on `seq_id` from `first` at `pos0`: the tokens and each step's logits."""
    tokens, rows, token = [], [], first
    for k in range(STEPS):
        idx = backend.decode([SeqWork(0, seq_id, [token], pos0 + k, True, "decode")])
        rows.append(backend.logits(idx[0]))
        token = int(rows[-1].argmax())
        tokens.append(token)
    return tokens, rows


@pytest.fixture(scope="module")
def second_backend():
    backend = LlamaBackend(LlamaModelConfig(default_model_path(), n_ctx=8 * 512, n_seq_max=8, n_batch=512, threads=THREADS))
    yield backend
    backend.close()


def test_an_imported_sequence_decodes_with_the_same_logits_as_the_unmoved_one(backend8, second_backend) -> None:
    tmpl = ChatTemplate(backend8.chat_template())
    prompts = [backend8.tokenize(tmpl.render([{"role": "user", "content": f"Explain {topic} to a new colleague."}]))
               for topic in ("the build system", "the release process")]
    prompt = prompts[0]
    backend8.seq_rm(5, 0)
    backend8.decode([SeqWork(0, 5, prompt[:-1], 0, False, "prefill")])
    state = backend8.export_seq(5)
    assert len(state) >= (len(prompt) - 1) * backend8.kv_bytes_per_token()  # the cells, not the whole cache

    unmoved_tokens, unmoved = _greedy(backend8, 5, prompt[-1], len(prompt) - 1)
    second_backend.import_seq(2, state, len(prompt) - 1)
    moved_tokens, moved = _greedy(second_backend, 2, prompt[-1], len(prompt) - 1)

    # The closeness the batching test uses: far below how much two different prompts' logits differ.
    backend8.seq_rm(6, 0)
    idx = backend8.decode([SeqWork(0, 6, prompts[1], 0, True, "prefill")])
    other = backend8.logits(idx[0])
    between = statistics.median(float(np.abs(other - row).max()) for row in unmoved)
    delta = max(float(np.abs(a - b).max()) for a, b in zip(moved, unmoved))
    print(f"max |dlogit| moved vs unmoved {delta:.4f}; between prompts {between:.1f}")
    assert delta < 0.2 * between
    assert moved_tokens == unmoved_tokens


def test_llama_cpp_refuses_a_state_from_another_sequence_layout(backend8) -> None:
    other = LlamaBackend(LlamaModelConfig(default_model_path(), n_ctx=4 * 512, n_seq_max=4, n_batch=512, threads=THREADS))
    try:
        backend8.seq_rm(5, 0)
        backend8.decode([SeqWork(0, 5, [1, 2, 3, 4], 0, False, "prefill")])
        with pytest.raises(DecodeError, match="refused"):
            other.import_seq(1, backend8.export_seq(5), 4)
    finally:
        other.close()


def export(client: httpx.Client, engine, request: dict, session: str = "s1") -> httpx.Response:
    body = json.dumps({"session": session, "endpoint": "/v1/chat/completions", "request": request}).encode()
    return client.post(f"{engine.internal_url}/kv/export", content=body, headers=signed("/kv/export", body))


def import_(client: httpx.Client, engine, frame: bytes) -> httpx.Response:
    return client.post(f"{engine.internal_url}/kv/import", content=frame,
                       headers=signed("/kv/import", frame, kv_frames.MEDIA_TYPE))


def test_a_session_moved_over_the_internal_ports_answers_its_next_turn_from_the_moved_kv(make_server) -> None:
    source, target = make_server(internal=True), make_server(internal=True)
    turn1 = chat(source.alias, "Name three rivers in Europe.", max_tokens=16)
    with httpx.Client(timeout=120) as client:
        first = client.post(f"{source.url}/v1/chat/completions", json=turn1, headers={SESSION_TAG_HEADER: "s1"}).json()
        turn2 = {**turn1, "messages": turn1["messages"] + [first["choices"][0]["message"],
                                                           {"role": "user", "content": "And three in Asia?"}]}
        # Never on the public port; never unsigned; never to another session, however its prompt begins.
        assert client.post(f"{source.url}/kv/export", json={"endpoint": "/v1/chat/completions", "request": turn2}).status_code == 404
        unsigned = client.post(f"{source.internal_url}/kv/export", json={"session": "s1", "endpoint": "/v1/chat/completions", "request": turn2})
        assert unsigned.status_code == 401 and unsigned.json()["error"]["code"] == "unsigned_internal_call"
        assert export(client, source, turn2, session="s2").status_code == 404

        exported = export(client, source, turn2)
        assert exported.status_code == 200, exported.text
        imported = import_(client, target, exported.content)
        assert imported.status_code == 200, imported.text
        n_tokens = imported.json()["n_tokens"]
        assert n_tokens >= first["usage"]["prompt_tokens"]
        # The imported sequence is the same session's on its new host: it moves on again by that name only.
        assert export(client, target, turn2, session="s2").status_code == 404
        assert export(client, target, turn2).status_code == 200

        moved = client.post(f"{target.url}/v1/chat/completions", json=turn2).json()
        unmoved = client.post(f"{source.url}/v1/chat/completions", json=turn2).json()
    assert moved["usage"]["prompt_tokens_details"]["cached_tokens"] >= n_tokens - 1
    assert moved["choices"][0]["message"]["content"] == unmoved["choices"][0]["message"]["content"]
    assert re.search(r"^llamacpp:kv_imports_total\{[^}]*\} 1$", httpx.get(f"{target.url}/metrics").text, re.M)


def test_the_internal_port_refuses_what_it_cannot_use_with_a_clear_error(make_server) -> None:
    engine = make_server(internal=True)
    narrower = make_server(internal=True, n_seq_max=4, n_ctx=4 * 1024)
    with httpx.Client(timeout=60) as client:
        unknown = export(client, engine, chat(engine.alias, "never sent"))
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "no_cached_prefix"
        body = json.dumps({"session": "s1", "endpoint": "/v1/embeddings", "request": {}}).encode()
        bad = client.post(f"{engine.internal_url}/kv/export", content=body, headers=signed("/kv/export", body))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "endpoint"
        body = json.dumps({"endpoint": "/v1/chat/completions", "request": chat(engine.alias, "x")}).encode()
        nameless = client.post(f"{engine.internal_url}/kv/export", content=body, headers=signed("/kv/export", body))
        assert nameless.status_code == 400 and nameless.json()["error"]["param"] == "session"

        client.post(f"{engine.url}/v1/chat/completions", json=chat(engine.alias, "Say hello.", max_tokens=4),
                    headers={SESSION_TAG_HEADER: "s1"})
        frame = export(client, engine, chat(engine.alias, "Say hello.")).content
        other_layout = import_(client, narrower, frame)
        assert other_layout.status_code == 409 and other_layout.json()["error"]["code"] == "incompatible_kv"
        assert "8x" in other_layout.json()["error"]["message"]
