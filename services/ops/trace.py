"""`modelpool trace generate | run`: agentic traces in the JSON Lines format of seed 004, made and replayed.

    modelpool trace generate --sessions 2000 --span-s 600 --seed 1 --out agentic.jsonl
    modelpool trace run agentic.jsonl --url http://127.0.0.1:8000 --model smollm2-135m

The file's format is `shared/contracts/trace.py`; the shape and its defaults
`simulation/agentic.py`; the replay `services/ops/trace_replay.py` (closed
loop, against any OpenAI endpoint). Each prints a JSON summary last: for
`generate`, the input/output ratio and the skew beside the seed's production
trace; for `run`, TTFT, TPOT and E2E, the prefix cache's hit rate against what
the sessions could reuse, per-instance TTFT p90 and the wall-clock amplification.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import fields
from pathlib import Path

import httpx

from services.ops.trace_replay import Replay, summarise
from shared.contracts.config import ConfigError
from shared.contracts.trace import read_trace, write_trace
from simulation.agentic import SEED_SKEW, AgenticShape, generate_agentic, io_ratio, skew


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelpool trace", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="write a skewed agentic trace")
    generate.add_argument("--out", type=Path, required=True, help="the JSON Lines file to write")
    generate.add_argument("--seed", type=int, default=0)
    defaults = AgenticShape()
    for f in fields(AgenticShape):
        generate.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)),
                              default=getattr(defaults, f.name))
    run = commands.add_parser("run", help="replay a trace against an OpenAI endpoint, closed loop")
    run.add_argument("trace", type=Path)
    run.add_argument("--url", default="http://127.0.0.1:8000", help="the endpoint, without /v1")
    run.add_argument("--model", required=True)
    run.add_argument("--api-key", help="sent as `Authorization: Bearer`")
    run.add_argument("--timeout-s", type=float, default=600.0, help="longest wait for one answer")
    return parser


async def replay(args: argparse.Namespace) -> dict:
    requests = read_trace(args.trace)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=args.timeout_s, headers=headers, limits=limits) as client:
        run = Replay(args.url.rstrip("/"), args.model, client)
        wall = await run.run(requests)
    return summarise(run.served, requests, wall)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        try:
            summary = asyncio.run(replay(args))
        except ConfigError as exc:
            print(f"modelpool trace run: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(summary))
        return 0 if summary["failed"] == 0 and summary["not_sent"] == 0 else 1
    shape = AgenticShape(**{f.name: getattr(args, f.name) for f in fields(AgenticShape)})
    try:
        requests = generate_agentic(shape, args.seed)
    except ValueError as exc:
        raise SystemExit(f"modelpool trace generate: {exc}") from None
    write_trace(requests, args.out)
    shares = skew(requests)
    print(json.dumps({
        "out": str(args.out), "requests": len(requests), "sessions": shape.sessions,
        "requests_per_session": round(len(requests) / shape.sessions, 2), "io_ratio": round(io_ratio(requests), 1),
        "top_share_of_input": {f"{top:.0%}": round(share, 3) for top, share in shares.items()},
        "seed_004_top_share_of_input": {f"{top:.0%}": share for top, share in SEED_SKEW.items()},
    }))
    return 0
