"""`modelpool health`: a container's health check, from the file its service writes every second.

A service run with `MODELPOOL_HEALTH_FILE` writes there whether it reaches
Postgres and NATS (`services/links.py`). This command reads the file and exits 0
when the service is checking its servers and has not been cut off from either
for longer than `--down-after` seconds, else 1 with one line per problem. It
never connects to anything itself, so a check is as cheap as reading a file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from services.links import judge_health


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool health", description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", default=os.environ.get("MODELPOOL_HEALTH_FILE"),
                        help="the service's health file (default: MODELPOOL_HEALTH_FILE)")
    parser.add_argument("--down-after", type=float, default=30.0,
                        help="seconds a server may be unreachable before the service counts as unhealthy (default 30)")
    parser.add_argument("--stale-after", type=float, default=10.0,
                        help="seconds without a fresh check before the service counts as unhealthy (default 10)")
    args = parser.parse_args(argv)
    if not args.file:
        parser.error("no health file: pass --file or set MODELPOOL_HEALTH_FILE (the service writes it)")
    try:
        with open(args.file) as f:
            health = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"unhealthy: cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    problems = judge_health(health, time.time(), stale_after_s=args.stale_after, down_after_s=args.down_after)
    for problem in problems:
        print(f"unhealthy: {problem}", file=sys.stderr)
    if not problems:
        links = ", ".join(f"{server} {'up' if (health.get(server) or {}).get('up') else 'down'}"
                          for server in ("postgres", "nats"))
        print(f"healthy: {health.get('service')} (pid {health.get('pid')}): {links}")
    return 1 if problems else 0
