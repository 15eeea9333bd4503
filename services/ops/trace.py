"""`modelpool trace generate`: a seeded, skewed agentic trace in the JSON Lines format of seed 004.

    modelpool trace generate --sessions 2000 --span-s 600 --seed 1 --out agentic.jsonl

The file's format is `shared/contracts/trace.py`; the shape and its defaults
`simulation/agentic.py`. The last line printed is a JSON summary: requests,
sessions, the input/output ratio and the skew (share of input tokens in the top
sessions) beside the seed's production trace.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

from shared.contracts.trace import write_trace
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
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
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
