"""What a simulated engine says about its configuration, and how it fails a start when told to."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from shared.net import free_port


def test_metrics_carry_vllms_cache_config_info(engine) -> None:
    """`vllm:cache_config_info` as vLLM writes it: value 1, the configuration in labels; with
    /v1/models' max_model_len it says how many full-length requests the KV cache holds."""
    text = httpx.get(f"{engine.url}/metrics").text
    assert "# TYPE vllm:cache_config_info gauge" in text
    (line,) = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert line.endswith(" 1.0") and labels["engine"] == "0"
    config = engine.config
    assert labels["block_size"] == str(config.block_size) == "16"
    assert int(labels["num_gpu_blocks"]) == config.kv_tokens // config.block_size
    max_model_len = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["max_model_len"]
    full_length_requests = int(labels["num_gpu_blocks"]) * int(labels["block_size"]) // max_model_len
    assert full_length_requests == config.kv_tokens // config.max_model_len >= 1


@pytest.mark.parametrize("profile", ["vllm", "llama.cpp"])
def test_an_engine_told_to_fail_its_start_exits_with_code_1_after_its_start_up_delay(profile: str) -> None:
    argv = [sys.executable, "-m", "services.cli", "engine", "sim", "--profile", profile,
            "--port", str(free_port()), "--startup-s", "0.5"]
    result = subprocess.run(argv, env={"PATH": "/usr/bin:/bin", f"MODELPOOL_SIM_{profile.upper().replace('.', '_')}_FAIL_START": "1"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert "then a failed start (fail_start)" in lines[0]
    assert lines[-1] == f"modelpool: SIMULATED {profile} engine was told to fail its start (fail_start); exiting with code 1"
