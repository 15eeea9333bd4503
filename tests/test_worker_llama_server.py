"""How the worker runs llama.cpp's C++ server (`llama-server`): its command line, and the pool file choosing
engines a backend can run. The real binary serving through the pool: tests/scenarios/test_llama_server.py and
tests/test_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engines.llama_server.binary import cached_binary
from services.worker.engines import EngineError, EngineOptions, engine_argv
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.commands import StartInstance
from shared.configuration import pool_config
from shared.contracts.config import ConfigError


def llama_server_start(**engine_args: str | int) -> StartInstance:
    return StartInstance(instance_id="smol/fast-1", alias="smol", backend_type=BackendType.LLAMA_CPP, worker_id="w1",
                         engine=EngineKind.LLAMA_SERVER, model_name="SmolLM2", model_path="/models/smol.gguf",
                         gpu_memory_gb=0, engine_args=engine_args)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_llama_server_runs_like_modelpools_engine_unless_the_alias_says_otherwise(tmp_path: Path) -> None:
    options = EngineOptions(log_dir=tmp_path, host="10.0.0.7", llama_threads=2)
    argv, env = engine_argv(llama_server_start(), 8081, options)
    assert argv[0] == str(cached_binary()) and env == {}
    assert (flag(argv, "--model"), flag(argv, "--host"), flag(argv, "--port"), flag(argv, "--alias")) == (
        "/models/smol.gguf", "10.0.0.7", "8081", "smol")
    assert {"--cont-batching", "--metrics", "--slots"} <= set(argv)
    assert (flag(argv, "--parallel"), flag(argv, "--ctx-size"), flag(argv, "--threads")) == ("8", "16384", "2")
    assert flag(argv, "--slot-save-path") == str(tmp_path / "smol_fast-1.slots")  # the instance's own directory

    # With an internal port, the server runs under modelpool's KV port, its own arguments after `--`.
    wrapped, _ = engine_argv(llama_server_start(), 8081, options, internal_port=9999)
    assert wrapped[3:5] == ["engine", "llama-server"] and flag(wrapped, "--binary") == str(cached_binary())
    assert (flag(wrapped, "--internal-host"), flag(wrapped, "--internal-port")) == ("10.0.0.7", "9999")
    assert wrapped[wrapped.index("--") + 1:] == argv[1:]

    argv, _ = engine_argv(llama_server_start(parallel=4, **{"ctx-size": 4096}), 8081, options)
    assert argv.count("--parallel") == 1 and (flag(argv, "--parallel"), flag(argv, "--ctx-size")) == ("4", "4096")


def test_a_missing_llama_server_fails_the_start_saying_how_to_build_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MODELPOOL_LLAMA_SERVER", str(tmp_path / "nowhere"))
    with pytest.raises(EngineError, match="services.engines.llama_server.binary"):
        engine_argv(llama_server_start(), 8081, EngineOptions(log_dir=tmp_path))


@pytest.mark.parametrize("backend, engine, ok", [
    ("llama.cpp", "llama-server", True), ("llama.cpp", "llama.cpp", True), ("llama.cpp", "simulator", True),
    ("vllm", "llama-server", False), ("vllm", "llama.cpp", False), ("llama.cpp", "vllm", False),
])
def test_the_pool_file_gives_a_backend_only_an_engine_that_speaks_its_api(backend, engine, ok) -> None:
    pool = {"aliases": [{"alias": "a", "backends": {
        backend: {"model_name": "m", "model_path": "default", "gpu_memory_gb": 0, "engine": engine}}}]}
    if ok:
        assert pool_config(pool, environ={}).aliases[0].engine_for(BackendType(backend)) is EngineKind(engine)
    else:
        with pytest.raises(ConfigError, match=f"engine {engine} cannot run the {backend} backend"):
            pool_config(pool, environ={})
