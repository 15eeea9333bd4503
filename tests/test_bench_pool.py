"""bench/pool.py's pool files: every pool is a valid pool file, with the peers and inputs the benchmark states."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from services.engines.llamacpp.settings import EngineSettings
from shared.configuration import pool_config
from shared.contracts.backends import BackendType

SPEC = importlib.util.spec_from_file_location("bench_pool", Path(__file__).resolve().parent.parent / "bench" / "pool.py")
bench_pool = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = bench_pool  # its dataclasses look their module up
SPEC.loader.exec_module(bench_pool)
VLLM_INPUTS = {"startup-s": 48.0, "wake-l1-s": 0.3, "wake-l2-s": 2.6}


def alias_of(kind: str):
    text = bench_pool.pool_yaml(kind, 0.5, VLLM_INPUTS, 3)
    return pool_config(yaml.safe_load(text), environ={}).alias(bench_pool.ALIAS)


@pytest.mark.parametrize("kind, tiers", [
    ("hybrid", {BackendType.LLAMA_CPP, BackendType.VLLM}), ("vllm", {BackendType.VLLM}),
    ("vllm_asleep_l1", {BackendType.VLLM}), ("vllm_asleep_l2", {BackendType.VLLM}), ("llamacpp", {BackendType.LLAMA_CPP}),
])
def test_every_pool_is_a_valid_pool_file_with_its_tiers(kind: str, tiers: set[BackendType]) -> None:
    alias = alias_of(kind)
    assert set(alias.backends) == tiers
    if BackendType.VLLM in tiers:
        assert alias.backends[BackendType.VLLM].engine_args == VLLM_INPUTS
    if BackendType.LLAMA_CPP in tiers:  # the real engine's default slots, not the simulated profile's
        assert alias.backends[BackendType.LLAMA_CPP].engine_args["max-num-seqs"] == EngineSettings().n_seq_max == 8


def test_only_the_asleep_peers_keep_a_standby_at_their_level_and_sleep_within_seconds() -> None:
    for kind, level in bench_pool.ASLEEP.items():
        alias = alias_of(kind)
        vllm = alias.backends[BackendType.VLLM]
        assert (vllm.standby_replicas, vllm.standby_sleep_level) == (1, level)
        assert alias.autoscaling_policy.vllm_sleep_l1_idle_s == alias.autoscaling_policy.vllm_sleep_l2_idle_s == 1
        # Everything else is seed 000's defaults, as for the other pools.
        assert alias.autoscaling_policy.down_hold_s == alias_of("vllm").autoscaling_policy.down_hold_s
    for kind in ("hybrid", "vllm"):
        assert alias_of(kind).backends[BackendType.VLLM].standby_replicas == 0
