"""The lone-stream step-gap benchmark counts only the decode thread's time between two decode steps of one request."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.llamacpp_step_gaps import step_gaps  # noqa: E402


def step(step_id: int, started_at: float, duration_ms: float, request_id: int, kind: str = "decode") -> dict:
    return {"step_id": step_id, "started_at": started_at, "duration_ms": duration_ms,
            "seqs": [{"seq_id": 0, "request_id": request_id, "n_tokens": 1 if kind == "decode" else 30, "kind": kind}]}


def test_gaps_span_decode_steps_of_one_request_only():
    steps = [
        step(1, 10.000, 20.0, 1, "prefill"),  # the prompt: neither a decode duration nor the start of a gap
        step(2, 10.021, 12.0, 1),
        step(3, 10.0335, 12.0, 1),  # 0.5 ms after step 2 ended
        step(4, 10.050, 12.0, 2),  # another request: the time between requests is no gap
        step(5, 10.0624, 12.0, 2),  # 0.4 ms
    ]
    durations, gaps = step_gaps(steps)
    assert durations == [12.0, 12.0, 12.0, 12.0]
    assert gaps == pytest.approx([0.5, 0.4])
