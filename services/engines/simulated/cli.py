"""`modelpool engine sim --profile vllm|llama.cpp ...`: run a simulated engine.

Settings are layered: profile defaults, then `MODELPOOL_SIM_ENGINE_*` environment
variables, then the profile's own `MODELPOOL_SIM_VLLM_*` / `MODELPOOL_SIM_LLAMA_CPP_*`,
then these options.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from services.engines.simulated.config import EngineConfig
from shared.contracts.config import ConfigError
from shared.internal_auth import SecretError, secret_from_environment


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="modelpool engine sim",
        description="A simulated inference engine: the real engine's HTTP API, timing from the decode model "
        "of seed 002, synthetic text. No model runs; every response says so.",
    )
    p.add_argument("--profile", choices=["vllm", "llama.cpp"], default="vllm", help="which engine to look like")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000 for vllm, 8080 for llama.cpp)")
    p.add_argument("--internal-host", help="bind address of the internal port (default 127.0.0.1)")
    p.add_argument("--internal-port", type=int,
                   help="port for other modelpool services only: modelled KV export and import (default: none)")
    p.add_argument("--kv-transfer-gb-s", type=float, help="modelled KV link bandwidth between engines, GB/s (10)")
    p.add_argument("--model", help="served model name (default qwen3-vl-2b)")
    p.add_argument("--speedup", type=float, help="simulated seconds per wall second (tests use large values)")
    p.add_argument("--seed", type=int)
    p.add_argument("--middleware", action="append", default=None,
                   help="an ASGI middleware class by import path, added as vLLM adds it (repeatable)")
    p.add_argument("--otlp-traces-endpoint", help="send a span per request here (OTLP/HTTP), continuing the caller's traceparent")
    g = p.add_argument_group("lifecycle delays, simulated seconds")
    g.add_argument("--startup-s", type=float, help="cold start (vllm 60, llama.cpp 2)")
    g.add_argument("--wake-l1-s", type=float, help="wake from sleep level 1 (0.3)")
    g.add_argument("--wake-l2-s", type=float, help="wake from sleep level 2 (2.6)")
    g.add_argument("--sleep-l1-s", type=float, help="time to enter sleep level 1 (0.4)")
    g.add_argument("--sleep-l2-s", type=float, help="time to enter sleep level 2 (0.1)")
    g.add_argument("--fail-start", action="store_const", const=True,
                   help="exit with code 1 at the end of the start-up delay instead of serving")
    g = p.add_argument_group("decode model")
    g.add_argument("--d-0", dest="d_0", type=float, help="batch base duration, seconds")
    g.add_argument("--d-1", dest="d_1", type=float, help="batch duration per token, seconds")
    g.add_argument("--max-num-batched-tokens", type=int, help="token budget B per batch")
    g.add_argument("--max-num-seqs", type=int, help="requests in the decode system at once (llama.cpp: slots)")
    g.add_argument("--parallel", dest="max_num_seqs", type=int, help="llama.cpp spelling of --max-num-seqs")
    g.add_argument("--max-model-len", type=int, help="context length per request")
    g.add_argument("--kv-cache-tokens", type=int, help="KV capacity M_total in tokens (default: from memory)")
    g.add_argument("--preemption-mode", choices=["swap", "sacrifice"])
    g.add_argument("--preemption-strategy", choices=["conservative", "aggressive"])
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const", const=False)
    g.add_argument("--prefix-caching", dest="enable_prefix_caching", action="store_const", const=True,
                   help="keep finished requests' KV for later prompts that share its prefix (the llama.cpp "
                        "profile's default is off: a slot keeps only its own last prompt)")
    g.add_argument("--natural-output-tokens", type=int, help="mean answer length when max_tokens is larger")
    g = p.add_argument_group("memory accounting")
    g.add_argument("--gpu-memory-gib", type=float)
    g.add_argument("--gpu-memory-utilization", type=float)
    g.add_argument("--weights-gib", type=float)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str]) -> int:
    args = vars(build_parser().parse_args(argv))
    profile = args.pop("profile")
    log_level = args.pop("log_level")
    try:
        config = EngineConfig.resolve(profile, **args)
    except ConfigError as exc:
        print(f"modelpool engine sim: invalid settings: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    from services.engines.simulated.app import create_app
    from services.engines.simulated.kv_transfer import create_internal_app
    from shared.net import serve_beside

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(
        f"modelpool: SIMULATED {config.profile} engine (no real inference) serving {config.model!r} "
        f"on http://{config.host}:{config.port}, speed-up x{config.speedup}, "
        f"start-up {config.startup_s / config.speedup:.1f} s" + (" then a failed start (fail_start)" if config.fail_start else ""),
        file=sys.stderr, flush=True,
    )
    app = create_app(config)
    if config.internal_port is None:
        uvicorn.run(app, host=config.host, port=config.port, log_level=log_level,
                    access_log=False, timeout_graceful_shutdown=5)
        return 0
    try:
        secret = secret_from_environment(os.environ)
    except SecretError as exc:
        print(f"modelpool engine sim: {exc}", file=sys.stderr)
        return 2
    serve_beside((app, config.host, config.port),
                 (create_internal_app(app.state.server, secret=secret), config.internal_host, config.internal_port),
                 log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
    return 0
