"""The lone-stream step-gap benchmark counts only the decode thread's time between two decode steps of one request."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.llamacpp_step_gaps import outside_compute_s, step_gaps, thread_cpu_s  # noqa: E402


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


def test_cpu_outside_the_compute_threads_leaves_out_the_busiest():
    before = {1: 10.0, 2: 10.0, 3: 1.0}
    after = {1: 18.0, 2: 17.5, 3: 1.25, 4: 0.05}  # thread 4 started between the readings
    assert outside_compute_s(before, after, 2) == pytest.approx(0.30)
    assert outside_compute_s(before, after, 0) == pytest.approx(15.8)


def test_thread_cpu_reads_every_thread_of_a_live_process():
    import os
    import threading

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        first = thread_cpu_s(os.getpid())
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            pass
        second = thread_cpu_s(os.getpid())
    finally:
        stop.set()
        spinner.join()
    assert spinner.native_id in second and threading.get_native_id() in second
    assert second[threading.get_native_id()] > first[threading.get_native_id()]
