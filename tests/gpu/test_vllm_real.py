"""The worker's vLLM adapter against a real `vllm serve` (needs an NVIDIA GPU and vLLM; `make test-gpu`).

`modelpool vllm-check` starts the engine with the worker's own launcher, answers, sleeps at level 1 and 2 and
wakes from each (level 2: weights woken, reloaded, KV cache woken), answering greedily after each wake, then
stops it. A wake that left the weights empty changes the answer; the test fails where the check does. Where
there is no GPU or no vLLM, the check exits 2 and this test fails saying so: it is run only where both are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.processes, pytest.mark.timeout(1800)]


def test_a_real_vllm_serves_the_same_answer_after_waking_from_either_sleep_level() -> None:
    model = os.environ.get("MODELPOOL_VLLM_CHECK_MODEL", "Qwen/Qwen3-0.6B")
    done = subprocess.run([sys.executable, "-m", "services.cli", "vllm-check", "--model", model],
                          capture_output=True, text=True, timeout=1700)
    assert done.returncode != 2, f"this machine cannot run a real vLLM: {done.stderr.strip()[-500:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=2), file=sys.stderr)
    assert result["engine"] == "vllm (real)" and result["capacity"] > 0
    assert result["same_answer_after_each_wake"], result["answers"]
    assert result["wake_l1_s"] < result["start_s"] and result["wake_l2_s"] < result["start_s"]
