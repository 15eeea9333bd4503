"""`modelpool trace generate | run | convert | compare`: traces made, replayed, converted and compared.

    modelpool trace generate --sessions 2000 --span-s 600 --seed 1 --out agentic.jsonl
    modelpool trace generate --shape bursty --requests 3000 --out bursty.jsonl
    modelpool trace generate --shape mooncake-conversation --requests 2000 --out conversation.jsonl
    modelpool trace run agentic.jsonl --url http://127.0.0.1:8000 --model smollm2-135m --out ear.json
    modelpool trace run bursty.jsonl --open-loop --url ... --model ... --out bursty.json
    modelpool trace run conversation_trace.jsonl --start 600 --duration 300 --speedup 10 --url ... --model ...
    modelpool trace convert agentic.jsonl --out agentic-mooncake.jsonl
    modelpool trace compare ear.json sticky.json --plot compare.png

Two formats: the project's agentic one (seed 004, `shared/contracts/trace.py`)
and Mooncake's (`shared/contracts/mooncake.py`, the FAST'25 release's), told
apart by their fields (or `--format`). A Mooncake trace is replayed open loop
at its timestamps (`services/ops/mooncake_replay.py`); its generator
(`simulation/mooncake.py`) follows the released traces' published statistics.

The file's format is `shared/contracts/trace.py`; the shapes and their defaults
`simulation/agentic.py`; the replay `services/ops/trace_replay.py` (closed
loop as agents send, or open loop, against any OpenAI endpoint). Each prints a
JSON summary last: for `generate`, the input/output ratio and the skew beside
the seed's production trace; for `run`, TTFT, TPOT and E2E, the prefix cache's
hit rate against what could be reused, per-instance TTFT p90, how often a
session changed instance and the wall-clock amplification (`--out` also keeps
every request, for `compare`); for `compare`, the runs side by side, and plots.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from dataclasses import fields
from pathlib import Path

import orjson

from services.ops.mooncake_replay import MooncakeReplay, select, summarise_mooncake
from services.ops.trace_replay import Replay, ReplayedRequest, replay_client, summarise
from shared.contracts.config import ConfigError
from shared.contracts.mooncake import BLOCK_TOKENS, conversations, is_mooncake, read_mooncake, write_mooncake
from shared.contracts.trace import read_trace, write_trace
from simulation.mooncake import SHAPES as MOONCAKE_SHAPES
from simulation.mooncake import agentic_to_mooncake, generate_mooncake, mooncake_to_agentic
from simulation.mooncake import statistics as mooncake_statistics
from simulation.agentic import SEED_SKEW, AgenticShape, BurstyShape, generate_agentic, generate_bursty, io_ratio, skew

COMPARED = ("answered", "failed", "ttft_s", "tpot_s", "e2e_s", "apc", "apc_upper_bound_intra_session",
            "apc_upper_bound_any_session", "instance_ttft_p90_s", "instance_changes_per_request", "amplification")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelpool trace", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="write a skewed agentic trace, or bursty independent requests")
    generate.add_argument("--out", type=Path, required=True, help="the JSON Lines file to write")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--shape", choices=["agentic", "bursty", *MOONCAKE_SHAPES], default="agentic")
    added: set[str] = set()
    for shape in (AgenticShape(), BurstyShape()):
        for f in fields(shape):
            if f.name not in added:
                added.add(f.name)
                generate.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(shape, f.name)), default=None)
    run = commands.add_parser("run", help="replay a trace against an OpenAI endpoint")
    run.add_argument("trace", type=Path)
    run.add_argument("--url", default="http://127.0.0.1:8000", help="the endpoint, without /v1")
    run.add_argument("--model", required=True)
    run.add_argument("--api-key", help="sent as `Authorization: Bearer`")
    run.add_argument("--timeout-s", type=float, default=600.0, help="longest wait for one answer")
    run.add_argument("--open-loop", action="store_true", help="send every request at its time, without waiting for answers")
    run.add_argument("--speedup", type=float, default=1.0,
                     help="the engines run this much faster than real time (simulated engines' --speedup)")
    run.add_argument("--out", type=Path, help="write the summary and every request here (JSON), for `compare`")
    run.add_argument("--format", choices=["auto", "agentic", "mooncake"], default="auto",
                     help="the trace's format (auto: told by its fields)")
    mooncake = run.add_argument_group("Mooncake traces (replayed open loop at their timestamps)")
    mooncake.add_argument("--start", type=float, default=0.0, help="seconds into the trace to start at")
    mooncake.add_argument("--duration", type=float, help="seconds of the trace to replay (default: all)")
    mooncake.add_argument("--warmup-s", type=float, default=0.0,
                          help="replay this much of the trace before --start first, left out of the figures: "
                               "caches and queues as a pool in steady state has them")
    mooncake.add_argument("--max-tokens", type=int, help="cap on each request's output_length")
    mooncake.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS,
                          help="words per 512-token block of the prompts built (smaller keeps a small model's context)")
    convert = commands.add_parser("convert", help="an agentic trace to Mooncake format, or back")
    convert.add_argument("trace", type=Path)
    convert.add_argument("--out", type=Path, required=True)
    compare = commands.add_parser("compare", help="replays side by side: a table, and plots")
    compare.add_argument("runs", type=Path, nargs="+", help="files written by `run --out`")
    compare.add_argument("--plot", type=Path, help="write TTFT CDFs, per-instance TTFT p90 and instance changes here")
    return parser


async def replay(args: argparse.Namespace) -> tuple[dict, list[ReplayedRequest]]:
    mooncake = args.format == "mooncake" or (args.format == "auto" and is_mooncake(args.trace))
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with replay_client(args.timeout_s, headers) as client:
        if mooncake:
            whole = read_mooncake(args.trace)
            sessions_of = dict(zip(map(id, whole), conversations(whole)))  # inferred over the whole trace
            scored = select(whole, args.start, args.duration)
            if not scored:
                raise ConfigError("--start", f"no request of the trace arrives in the {args.duration or 'rest'} "
                                             f"seconds from {args.start:g} s", str(args.trace))
            if args.warmup_s < 0:
                raise ConfigError("--warmup-s", f"must be 0 or more, not {args.warmup_s:g}", str(args.trace))
            warm_from = max(0.0, args.start - args.warmup_s)
            warm = select(whole, warm_from, args.start - warm_from)
            requests = warm + scored
            sessions = [sessions_of[id(r)] for r in requests]
            run = MooncakeReplay(args.url.rstrip("/"), args.model, client, speedup=args.speedup, open_loop=True,
                                 progress=progress(len(requests)))
            wall = await run.run_mooncake(requests, sessions, args.block_tokens, args.max_tokens)
            print(file=sys.stderr)
            return summarise_mooncake(run.served, requests, sessions, wall, args.speedup, len(warm)), run.served
        trace = read_trace(args.trace)
        run = Replay(args.url.rstrip("/"), args.model, client, speedup=args.speedup, open_loop=args.open_loop,
                     progress=progress(len(trace)))
        wall = await run.run(trace)
    print(file=sys.stderr)
    return summarise(run.served, trace, wall, args.speedup), run.served


def convert(args: argparse.Namespace) -> dict:
    """An agentic trace to Mooncake format, or a Mooncake trace to agentic sessions (its conversations inferred)."""
    if is_mooncake(args.trace):
        requests = read_mooncake(args.trace)
        written = write_trace(mooncake_to_agentic(requests, conversations(requests)), args.out)
        return {"out": str(args.out), "from": "mooncake", "to": "agentic", "requests": written}
    requests = agentic_to_mooncake(read_trace(args.trace))
    write_mooncake(requests, args.out)
    return {"out": str(args.out), "from": "agentic", "to": "mooncake", **mooncake_statistics(requests)}


def progress(total: int):
    step = max(1, total // 50)

    def answered(n: int) -> None:
        if n % step == 0 or n == total:
            print(f"\r{n}/{total} requests answered", end="", file=sys.stderr, flush=True)

    return answered


def save_run(path: Path, summary: dict, served: list[ReplayedRequest]) -> None:
    path.write_bytes(orjson.dumps({"summary": summary, "requests": [dataclasses.asdict(s) for s in served]}))


def load_run(path: Path) -> tuple[dict, list[ReplayedRequest]]:
    try:
        data = orjson.loads(path.read_bytes())
        return data["summary"], [ReplayedRequest(**r) for r in data["requests"]]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError("<file>", f"not a file written by `modelpool trace run --out`: {exc}", str(path)) from None


def compare(args: argparse.Namespace) -> dict:
    runs = {path.stem: load_run(path) for path in args.runs}
    table = {name: {key: summary.get(key) for key in COMPARED} for name, (summary, _) in runs.items()}
    print(f"{'run':<16}{'TTFT p50':>10}{'TTFT p90':>10}{'TTFT p99':>10}{'APC':>8}{'bound':>8}{'worst inst p90':>16}"
          f"{'changes/req':>12}{'amplif.':>9}", file=sys.stderr)
    for name, row in table.items():
        ttft, inst = row["ttft_s"] or {}, row["instance_ttft_p90_s"] or {}
        print(f"{name:<16}{ttft.get('p50') or 0:>10.3f}{ttft.get('p90') or 0:>10.3f}{ttft.get('p99') or 0:>10.3f}"
              f"{row['apc'] or 0:>8.3f}{row['apc_upper_bound_intra_session'] or 0:>8.3f}{inst.get('max') or 0:>16.3f}"
              f"{row['instance_changes_per_request'] or 0:>12.3f}{row['amplification'] or 0:>9.2f}", file=sys.stderr)
    result: dict = {"runs": table}
    if args.plot:
        from services.ops.trace_plots import plot_runs

        result["plot"] = str(plot_runs(runs, args.plot))
    return result


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            summary, served = asyncio.run(replay(args))
            if args.out:
                save_run(args.out, summary, served)
            print(json.dumps(summary))
            return 0 if summary["failed"] == 0 and summary["not_sent"] == 0 else 1
        if args.command == "compare":
            print(json.dumps(compare(args)))
            return 0
        if args.command == "convert":
            print(json.dumps(convert(args)))
            return 0
    except ConfigError as exc:
        print(f"modelpool trace {args.command}: {exc}", file=sys.stderr)
        return 2
    return generate(args)


def generate(args: argparse.Namespace) -> int:
    if args.shape in MOONCAKE_SHAPES:
        shape = MOONCAKE_SHAPES[args.shape]
        mooncake = generate_mooncake(shape, args.seed, args.requests)
        write_mooncake(mooncake, args.out)
        print(json.dumps({"out": str(args.out), "shape": args.shape, **mooncake_statistics(mooncake),
                          "published": {"requests_per_hour": shape.requests, "mean_input": shape.mean_input,
                                        "mean_output": shape.mean_output}}))
        return 0
    shape_type = BurstyShape if args.shape == "bursty" else AgenticShape
    given = {f.name: getattr(args, f.name) for f in fields(shape_type) if getattr(args, f.name) is not None}
    shape = shape_type(**given)
    try:
        requests = generate_bursty(shape, args.seed) if args.shape == "bursty" else generate_agentic(shape, args.seed)
    except ValueError as exc:
        raise SystemExit(f"modelpool trace generate: {exc}") from None
    write_trace(requests, args.out)
    sessions = len({r.session_id for r in requests})
    summary = {"out": str(args.out), "shape": args.shape, "requests": len(requests), "sessions": sessions,
               "requests_per_session": round(len(requests) / sessions, 2), "io_ratio": round(io_ratio(requests), 1)}
    if args.shape == "agentic":
        summary["top_share_of_input"] = {f"{top:.0%}": round(share, 3) for top, share in skew(requests).items()}
        summary["seed_004_top_share_of_input"] = {f"{top:.0%}": share for top, share in SEED_SKEW.items()}
    print(json.dumps(summary))
    return 0
