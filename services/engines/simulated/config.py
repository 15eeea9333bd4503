"""Settings of the simulated engine: profile defaults, then environment, then arguments (`shared/configuration.py`).

The two profiles mimic the engines the pool really runs. Numbers are defaults a
user can override; the ones that matter for the pool's behaviour (start-up and
wake delays) come from published figures for a 2-3B model:

- vLLM cold start (process start, weight load, CUDA graph capture) about 60 s;
- vLLM sleep-mode wake: about 0.3 s from level 1 (weights copied back from CPU),
  about 2.6 s from level 2 (weights reloaded);
- llama.cpp starts in a couple of seconds and serves a few parallel slots.

Timing constants `d_0`, `d_1` (seconds) feed the decode model of seed 002:
`batch duration = d_0 + d_1 * batch_tokens`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from shared.configuration import environment_names, from_environment, layered

Profile = Literal["vllm", "llama.cpp"]
PreemptionModeName = Literal["swap", "sacrifice"]
StrategyName = Literal["conservative", "aggressive"]

GIB = 1024**3
ENV_PREFIX = "MODELPOOL_SIM_ENGINE_"
PROFILE_ENV_PREFIXES: dict[str, str] = {"vllm": "MODELPOOL_SIM_VLLM_", "llama.cpp": "MODELPOOL_SIM_LLAMA_CPP_"}
"""Variables for one profile only, applied over `ENV_PREFIX`: a worker's environment can make
its simulated vLLM start slowly or fail while its simulated llama.cpp engines start as usual."""


class EngineConfig(BaseModel):
    """Everything the simulated engine needs; built by `EngineConfig.resolve`."""

    profile: Profile = "vllm"
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    internal_host: str = "127.0.0.1"
    internal_port: int | None = Field(default=None, ge=0, le=65535)
    """The port for other modelpool services (KV export and import for session moves); None: not served."""
    model: str = "qwen3-vl-2b"
    speedup: float = Field(default=1.0, gt=0.0)
    """Simulated seconds per wall-clock second: every delay is divided by it."""
    seed: int = 0
    otlp_traces_endpoint: str | None = None
    """Where to send a span per request (OTLP/HTTP, `<url>/v1/traces`), as vLLM's flag of the same name."""
    middleware: tuple[str, ...] = ()
    """ASGI middleware classes by import path, added as vLLM's `--middleware` adds them (the worker guards the
    development endpoints with one: services/engines/vllm_guard.py)."""

    # --- lifecycle delays (simulated seconds) ------------------------------
    startup_s: float = Field(default=60.0, ge=0.0)
    sleep_l1_s: float = Field(default=0.4, ge=0.0)
    sleep_l2_s: float = Field(default=0.1, ge=0.0)
    wake_l1_s: float = Field(default=0.3, ge=0.0)
    wake_l2_s: float = Field(default=2.6, ge=0.0)
    fail_start: bool = False
    """Exit with code 1 at the end of the start-up delay instead of serving (a failed start, on purpose)."""

    # --- decode model (seed 002) -------------------------------------------
    d_0: float = Field(default=0.012, gt=0.0)
    d_1: float = Field(default=0.00004, ge=0.0)
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    """Token budget B of one executed batch."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Requests admitted into the decode system at once (llama.cpp: parallel slots)."""
    max_model_len: int = Field(default=32768, ge=16)
    kv_cache_tokens: int | None = Field(default=None, ge=16)
    """KV capacity M_total in tokens; derived from the memory figures below when unset."""
    preemption_mode: PreemptionModeName = "swap"
    preemption_strategy: StrategyName = "aggressive"
    enable_prefix_caching: bool = True
    block_size: int = Field(default=16, ge=1)
    natural_output_tokens: int = Field(default=256, ge=1)
    """Mean length of an answer when the client's max_tokens does not cut it short."""

    # --- memory accounting (bytes reported per lifecycle state) -------------
    gpu_memory_gib: float = Field(default=24.0, gt=0.0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    weights_gib: float = Field(default=4.3, ge=0.0)
    residual_gib: float = Field(default=0.5, ge=0.0)
    """GPU memory still held while asleep (CUDA context, buffers)."""
    kv_bytes_per_token: int = Field(default=114_688, ge=1)
    """28 layers x 2 (K, V) x 8 KV heads x 128 dims x 2 bytes, a Qwen3-VL-2B-like shape."""
    kv_transfer_gb_s: float = Field(default=10.0, gt=0.0)
    """Bandwidth of the modelled KV link between engines (GB/s, simulated time): a moved session's KV
    takes bytes / bandwidth to import. About a 100 Gb/s RDMA NIC; vLLM itself has no export API."""

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.kv_tokens < self.max_model_len:
            # vLLM refuses to start in the same case: one full-length request must fit.
            raise ValueError(
                f"KV capacity ({self.kv_tokens} tokens) is smaller than max_model_len {self.max_model_len}"
            )
        return self

    # ------------------------------------------------------------------ views

    @property
    def engine_name(self) -> str:
        """What every response names as its source."""
        return f"simulated-{self.profile}"

    @property
    def kv_pool_bytes(self) -> int:
        budget = self.gpu_memory_gib * self.gpu_memory_utilization - self.weights_gib - self.residual_gib
        return max(0, int(budget * GIB))

    @property
    def kv_tokens(self) -> int:
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens
        if self.profile == "llama.cpp":
            return self.max_model_len * self.max_num_seqs  # llama-server: -c = per-slot context x slots
        return max(16, self.kv_pool_bytes // self.kv_bytes_per_token)

    @property
    def num_gpu_blocks(self) -> int:
        """KV blocks of `block_size` tokens, as vLLM counts its cache."""
        return self.kv_tokens // self.block_size

    def cache_config_info(self) -> dict[str, str]:
        """vLLM's `vllm:cache_config_info` labels: its cache configuration, values as vLLM writes them."""
        return {
            "block_size": str(self.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "gpu_memory_utilization": str(self.gpu_memory_utilization),
            "num_gpu_blocks": str(self.num_gpu_blocks),
        }

    # ------------------------------------------------------------------ layering

    @classmethod
    def profile_defaults(cls, profile: Profile) -> dict[str, Any]:
        if profile == "vllm":
            return {"profile": "vllm"}
        # llama.cpp on CPU: a few slots sharing one context, slow per-token compute,
        # no cross-request prefix cache, no sleep mode; weights and KV live in RAM.
        return {
            "profile": "llama.cpp",
            "port": 8080,
            "startup_s": 2.0,
            "d_0": 0.035,
            "d_1": 0.002,
            "max_num_batched_tokens": 2048,
            "max_num_seqs": 4,
            "max_model_len": 4096,  # context per slot; the KV cache holds one per slot
            "enable_prefix_caching": False,
            "preemption_mode": "sacrifice",
            "preemption_strategy": "conservative",
            "weights_gib": 1.5,
            "residual_gib": 0.0,
        }

    @classmethod
    def resolve(
        cls,
        profile: Profile = "vllm",
        env: Mapping[str, str] | None = None,
        **explicit: Any,
    ) -> "EngineConfig":
        """Defaults of the profile, then `MODELPOOL_SIM_ENGINE_*`, then the profile's own variables
        (`MODELPOOL_SIM_VLLM_*` / `MODELPOOL_SIM_LLAMA_CPP_*`), then explicit arguments (None = unset)."""
        env = os.environ if env is None else env
        return layered(cls, [
            (f"the {profile} profile", cls.profile_defaults(profile)),
            *from_environment(env, environment_names(cls, ENV_PREFIX)),
            *from_environment(env, environment_names(cls, PROFILE_ENV_PREFIXES[profile])),
            ("arguments", explicit), ("the profile", {"profile": profile}),
        ])
