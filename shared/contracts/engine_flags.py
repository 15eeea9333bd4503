"""The engine flags a pool file may give an alias's backend (`engine_args`), per engine: an allow-list.

A worker runs what a `StartInstance` says; the flags it passes on decide what an engine process does with
the host. Some must stay the worker's (where an engine listens, what it is called, its model file: a pool
file saying `host: 0.0.0.0` would put an engine's control endpoints on every network); some load and run
code of someone else's choosing (vLLM's `--middleware`, `--worker-extension-cls`, `--tool-parser-plugin`).
Only the flags below pass: tuning, batching, memory, sampling defaults and the like. `trust-remote-code`
runs a model repository's own Python on the GPU host: allowed, as vLLM allows it, only where an alias's
configuration says so, and the worker starts nothing that its alias's recorded configuration does not say.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.contracts.backends import EngineKind

SIMULATOR_FLAGS = frozenset({
    "d-0", "d-1", "fail-start", "gpu-memory-gib", "gpu-memory-utilization", "kv-cache-tokens", "kv-transfer-gb-s",
    "max-num-batched-tokens", "max-num-seqs", "natural-output-tokens", "no-prefix-caching", "parallel",
    "preemption-mode", "preemption-strategy", "prefix-caching", "seed", "sleep-l1-s", "sleep-l2-s", "startup-s",
    "wake-l1-s", "wake-l2-s", "weights-gib", "otlp-traces-endpoint",
})
"""`modelpool engine sim`'s options but those the worker sets (profile, host, ports, model, speed-up, log level)."""

LLAMA_CPP_FLAGS = frozenset({
    "admission-wait-ms", "kv-cache-eviction-threshold", "kv-cache-max-memory-mb", "max-batch-size",
    "max-input-tokens", "max-output-tokens", "max-queue", "max-running", "n-batch", "n-ctx", "n-seq-max",
    "no-prefix-cache", "prompt-cache-mb", "request-timeout", "threads",
})
"""`modelpool engine llama.cpp`'s options but those the worker sets (model, alias, host, ports, log level)."""

LLAMA_SERVER_FLAGS = frozenset({
    "parallel", "ctx-size", "threads", "threads-batch", "threads-http", "batch-size", "ubatch-size", "keep",
    "n-predict", "n-gpu-layers", "main-gpu", "split-mode", "tensor-split", "flash-attn", "cache-type-k",
    "cache-type-v", "cache-reuse", "cache-ram", "defrag-thold", "kv-unified", "swa-full", "no-kv-offload", "mlock",
    "no-mmap", "numa", "temp", "top-k", "top-p", "min-p", "repeat-penalty", "seed", "jinja", "reasoning-format",
    "reasoning-budget", "rope-scaling", "rope-freq-base", "rope-freq-scale", "yarn-orig-ctx", "timeout",
})
"""llama-server's serving and tuning options; not its address, model, alias, API key, slot directory, web UI or
anything that reads a file of the caller's choosing (`--chat-template-file`, `--lora`, `--mmproj` come with
the model's own configuration when modelpool supports them)."""

VLLM_FLAGS = frozenset({
    "gpu-memory-utilization", "max-num-seqs", "max-num-batched-tokens", "enable-prefix-caching",
    "no-enable-prefix-caching", "enable-chunked-prefill", "no-enable-chunked-prefill", "dtype", "quantization",
    "kv-cache-dtype", "block-size", "swap-space", "cpu-offload-gb", "enforce-eager", "seed", "trust-remote-code",
    "revision", "code-revision", "tokenizer-revision", "tokenizer-mode", "max-logprobs", "pipeline-parallel-size",
    "data-parallel-size", "enable-expert-parallel", "disable-log-stats", "disable-log-requests",
    "limit-mm-per-prompt", "generation-config", "speculative-config", "compilation-config", "rope-scaling",
    "load-format", "calculate-kv-scales", "scheduling-policy", "long-prefill-token-threshold",
    "max-num-partial-prefills", "async-scheduling", "enable-auto-tool-choice", "tool-call-parser",
    "reasoning-parser", "chat-template-content-format", "max-seq-len-to-capture", "max-lora-rank",
})
"""vLLM's engine and serving options; not its address, served name, API key, TLS, tensor parallelism or context
length (the worker sets those from the alias), nor any that imports code (`--middleware`,
`--worker-extension-cls`, `--tool-parser-plugin`) or reads files of the caller's choosing."""

ENGINE_FLAGS: Mapping[EngineKind, frozenset[str]] = {
    EngineKind.SIMULATOR: SIMULATOR_FLAGS, EngineKind.LLAMA_CPP: LLAMA_CPP_FLAGS,
    EngineKind.LLAMA_SERVER: LLAMA_SERVER_FLAGS, EngineKind.VLLM: VLLM_FLAGS,
}


def refused_flags(engine: EngineKind, engine_args: Mapping[str, object]) -> list[str]:
    """The flags of `engine_args` that `engine` may not be given, in order."""
    allowed = ENGINE_FLAGS[engine]
    return [name for name in engine_args if name not in allowed]
