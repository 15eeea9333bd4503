"""`modelpool engine llama-server --internal-host H --internal-port P -- LLAMA_SERVER_ARGS...`: llama.cpp's own
server, with modelpool's internal KV port beside it (`kv_port.py`).

The C++ server runs as this process's child, serving its public port itself; this process serves the
internal port over the server's slot API, and exits with the server's exit code when it ends (a SIGTERM is
passed on). One process group: the worker stops or kills both at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import uvicorn

from services.engines.llama_server.kv_port import LlamaServerKV, build_kv_app
from services.processes import tied_to_us
from shared.internal_auth import SecretError, secret_from_environment


def engine_option(args: list[str], *names: str, default: str | None = None) -> str | None:
    """The value of the first of `names` among llama-server's own arguments."""
    for i, arg in enumerate(args[:-1]):
        if arg in names:
            return args[i + 1]
    return default


KV_BYTES_PER_TOKEN_BOUND = 512 * 1024
"""The most KV one token takes in the models a slot file may come from (a 70B model with grouped-query attention
takes about 320 KiB in 16 bits): an import's frame is bounded by a slot's context at this much per token."""


def max_frame_bytes(args: list[str]) -> int:
    """The largest slot file (and frame) one slot's context can make, within `KV_BYTES_PER_TOKEN_BOUND`."""
    ctx, parallel = engine_option(args, "--ctx-size", "-c"), engine_option(args, "--parallel", "-np")
    slots = int(parallel) if parallel and parallel.isdigit() and int(parallel) > 0 else 1
    per_slot = int(ctx) // slots if ctx and ctx.isdigit() and int(ctx) > 0 else 131072  # unset: the model's own
    return per_slot * KV_BYTES_PER_TOKEN_BOUND + (1 << 20)


def fingerprint(args: list[str]) -> str:
    """What an imported slot must come from: the same model file and the same slot layout."""
    model = Path(engine_option(args, "--model", "-m") or "")
    parallel = engine_option(args, "--parallel", "-np", default="?")
    ctx = engine_option(args, "--ctx-size", "-c", default="?")
    size = model.stat().st_size if model.is_file() else 0
    return f"{model.name}:{size}:{parallel}x{ctx}"


async def serve(binary: str, engine_args: list[str], internal_host: str, internal_port: int) -> int:
    slot_dir = engine_option(engine_args, "--slot-save-path")
    if slot_dir is None:
        print("modelpool engine llama-server: the KV port needs --slot-save-path among the server's arguments",
              file=sys.stderr)
        return 2
    host = engine_option(engine_args, "--host", default="127.0.0.1")
    port = engine_option(engine_args, "--port", default="8080")
    try:
        secret = secret_from_environment(os.environ)
    except SecretError as exc:
        print(f"modelpool engine llama-server: {exc}", file=sys.stderr)
        return 2
    kv = LlamaServerKV(f"http://{host}:{port}", Path(slot_dir), fingerprint(engine_args), secret or b"")
    app = build_kv_app(kv, max_frame_bytes=max_frame_bytes(engine_args))
    server = uvicorn.Server(uvicorn.Config(app, host=internal_host, port=internal_port,
                                          log_level="warning", access_log=False, lifespan="on"))
    # Signals are the child's to act on (its exit ends this process): uvicorn must not take them.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    # In this process's group (the worker stops or kills the group), and ended if this process dies first.
    child = await asyncio.create_subprocess_exec(binary, *engine_args,
                                                 preexec_fn=tied_to_us(None, signal.SIGTERM, os.getpid()))
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, child.terminate)
    loop.add_signal_handler(signal.SIGINT, child.terminate)
    serving = asyncio.ensure_future(server.serve())
    exited = asyncio.ensure_future(child.wait())
    await asyncio.wait([serving, exited], return_when=asyncio.FIRST_COMPLETED)
    if not exited.done():  # the KV port could not serve (its port taken, say): the instance is broken
        print("modelpool engine llama-server: the KV port stopped; stopping the server", file=sys.stderr)
        child.terminate()
        await exited
        return 1
    code = exited.result()
    server.should_exit = True
    with contextlib.suppress(Exception):
        await asyncio.wait_for(serving, 5)
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool engine llama-server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", required=True, help="the llama-server executable")
    parser.add_argument("--internal-host", default="127.0.0.1")
    parser.add_argument("--internal-port", type=int, required=True)
    parser.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then llama-server's own arguments")
    args = parser.parse_args(argv)
    engine_args = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
    return asyncio.run(serve(args.binary, engine_args, args.internal_host, args.internal_port))
