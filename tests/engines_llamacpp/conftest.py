"""Fixtures: real llama.cpp engines on the default model (SmolLM2-135M), served over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from llamacpp_helpers import THREADS, RunningServer, start_server


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    """The engine with its defaults (prefix cache on), shared by the tests that do not need special limits."""
    running = start_server()
    yield running
    running.stop()


@pytest.fixture
def make_server() -> Iterator[Any]:
    started: list[RunningServer] = []

    def make(**overrides: Any) -> RunningServer:
        running = start_server(**overrides)
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()


@pytest.fixture(scope="session")
def backend8() -> Iterator[Any]:
    """A bare llama.cpp context with 8 sequences, for tests that drive decode steps by hand."""
    from services.engines.llamacpp.llama_backend import LlamaModelConfig, LlamaBackend
    from services.engines.llamacpp.model_files import default_model_path

    backend = LlamaBackend(LlamaModelConfig(default_model_path(), n_ctx=8 * 512, n_seq_max=8, n_batch=512, threads=THREADS))
    yield backend
    backend.close()
