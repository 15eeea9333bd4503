"""Fixtures: simulated engines served over real HTTP by uvicorn in a background thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sim_engine_support import RunningEngine, start_engine


@pytest.fixture(scope="module")
def engine() -> Iterator[RunningEngine]:
    """A vLLM-profile engine with fast timing, shared by a module's tests."""
    running = start_engine()
    yield running
    running.stop()
