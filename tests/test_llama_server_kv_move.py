"""A session's KV moved between two real llama-server instances over modelpool's KV port (their slot files):
the next turn on the target reuses the moved prefix instead of computing it, and hostile frames are refused
while the server keeps serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.engines.llama_server.binary import llama_server_binary
from services.engines.llamacpp.model_files import default_model_path
from services.processes import descendants_of
from helpers import CLUSTER_KEY, CLUSTER_SECRET, post_signed
from shared import kv_frames
from shared.internal_auth import SECRET_ENV
from shared.net import free_ports

pytestmark = [pytest.mark.processes, pytest.mark.model]


class Server:
    def __init__(self, tmp: Path, name: str) -> None:
        port, internal = free_ports(2, "127.0.0.1")
        self.url, self.internal = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{internal}"
        slots = tmp / f"{name}.slots"
        slots.mkdir()
        self.log = (tmp / f"{name}.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "engine", "llama-server", "--binary", str(llama_server_binary()),
             "--internal-port", str(internal), "--", "--model", str(default_model_path()), "--host", "127.0.0.1",
             "--port", str(port), "--alias", "smol", "--parallel", "2", "--ctx-size", "4096", "--threads", "1",
             "--no-webui", "--slot-save-path", str(slots)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, SECRET_ENV: CLUSTER_SECRET})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health").status_code == 200 and httpx.get(f"{self.internal}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.process.poll() is None, f"{name} exited with {self.process.returncode}"
            time.sleep(0.2)
        raise AssertionError(f"{name} did not come up")

    def stop(self) -> int:
        self.process.terminate()
        code = self.process.wait(timeout=20)
        self.log.close()
        return code


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    started: list[Server] = []

    def start(name: str) -> Server:
        started.append(Server(tmp_path, name))
        return started[-1]

    yield start  # type: ignore[misc]
    for server in started:
        if server.process.poll() is None:
            os.killpg(server.process.pid, 9)


def chat(url: str, messages: list[dict[str, str]]) -> dict:
    answer = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "smol", "messages": messages, "max_tokens": 12, "temperature": 0})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_session_moved_between_llama_servers_answers_its_next_turn_from_the_moved_kv(servers) -> None:
    source, target, control = servers("source"), servers("target"), servers("control")
    history = [{"role": "system", "content": "You are a careful assistant who explains geography to students. " * 4},
               {"role": "user", "content": "Name three rivers in Europe."}]
    first = chat(source.url, history)
    turn2 = [*history, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "Which of them is the longest?"}]
    request = {"session": "s1", "endpoint": "/v1/chat/completions", "request": {"model": "smol", "messages": turn2}}
    client = httpx.Client(timeout=30)

    # Another conversation under the same system prompt shares its opening only: the slot is not its to take.
    stranger = [history[0], {"role": "user", "content": "Name three mountains in Africa."}]
    taken = post_signed(client, source.internal, "/kv/export", {**request, "request": {"messages": stranger}})
    assert taken.status_code == 404 and taken.json()["error"]["code"] == "no_cached_prefix"
    assert client.post(f"{source.internal}/kv/export", json=request).status_code == 401  # unsigned
    exported = post_signed(client, source.internal, "/kv/export", request)
    assert exported.status_code == 200, exported.text
    header, blob = kv_frames.decode(exported.content, engine="llama-server", model=header_model(exported.content),
                                    key=CLUSTER_KEY)
    assert header["n_tokens"] > 60 and header["bytes"] == len(blob) > 0 and header["session"] == "s1"
    imported = post_signed(client, target.internal, "/kv/import", exported.content, kv_frames.MEDIA_TYPE)
    assert imported.status_code == 200, imported.text
    assert imported.json()["n_tokens"] == header["n_tokens"]

    moved, fresh = chat(target.url, turn2), chat(control.url, turn2)
    assert moved["timings"]["cache_n"] >= 60  # the moved prefix, not computed again
    assert fresh["timings"]["cache_n"] == 0
    # Greedy from the moved KV says what the recomputed one says (to the last few tokens: a prefix computed
    # in another batch shape differs in the last bits, which can move where the answer stops).
    said, recomputed = moved["choices"][0]["message"]["content"], fresh["choices"][0]["message"]["content"]
    assert said[:24] == recomputed[:24], (said, recomputed)

    # Nothing to offer for an unrelated prompt; hostile or foreign frames are refused and the server serves on.
    other = {"session": "s2", "endpoint": "/v1/chat/completions",
             "request": {"messages": [{"role": "user", "content": "Hi?"}]}}
    assert post_signed(client, target.internal, "/kv/export", other).json()["error"]["code"] == "no_cached_prefix"
    for frame, status in ((b"\x00\x00\x00\x05{}", 400), (exported.content[:40], 400),
                          (kv_frames.encode({"engine": "llama.cpp", "model": "x", "n_tokens": 3}, b"abc", key=CLUSTER_KEY), 409),
                          (kv_frames.encode({**header, "format": None} | {"engine": "llama-server"}, b"qsgg",
                                            key=CLUSTER_KEY), 400),
                          (kv_frames.encode(header, blob, key=b"f" * 40), 400)):  # forged without the secret
        refused = post_signed(client, target.internal, "/kv/import", frame, kv_frames.MEDIA_TYPE)
        assert refused.status_code == status, refused.text
    client.close()
    assert chat(target.url, history)["choices"][0]["message"]["content"]
    assert source.stop() == 0 and target.stop() == 0  # a SIGTERM ends the server and its KV port cleanly


def header_model(frame: bytes) -> str:
    import json
    import struct

    (n,) = struct.unpack_from(">I", frame, 32)  # after the frame's signature
    return json.loads(frame[36 : 36 + n])["model"]


def test_the_server_does_not_outlive_its_kv_port(servers) -> None:
    """The worker stops the whole process group; should the KV port's process die alone, its server goes too."""
    server = servers("orphan")
    (child,) = descendants_of(server.process.pid)
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and pid_alive(child):
        time.sleep(0.1)
    assert not pid_alive(child), "llama-server outlived the process that started it"


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
