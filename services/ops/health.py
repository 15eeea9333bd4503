"""`modelpool health`: a container's health check, from the file its service writes every second.

A service run with `MODELPOOL_HEALTH_FILE` writes there whether it reaches
Postgres and NATS (`services/links.py`). This command reads the file and exits 0
when the service is checking its servers and has not been cut off from either
for longer than `--down-after` seconds, else 1 with one line per problem. It
connects to nothing but the service's own HTTP health endpoint, and only when
given one (`--url`); the gateway, which serves from its view while a server is
away, is judged by that alone (`--url ... --ignore-servers`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool health", description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", default=os.environ.get("MODELPOOL_HEALTH_FILE"),
                        help="the service's health file (default: MODELPOOL_HEALTH_FILE)")
    parser.add_argument("--down-after", type=float, default=30.0,
                        help="seconds a server may be unreachable before the service counts as unhealthy (default 30)")
    parser.add_argument("--stale-after", type=float, default=10.0,
                        help="seconds without a fresh check before the service counts as unhealthy (default 10)")
    parser.add_argument("--url", help="the service's own health endpoint, which must answer 200 within 3 s")
    parser.add_argument("--ignore-servers", action="store_true",
                        help="judge by --url alone: the service serves while Postgres or NATS is away (the gateway)")
    args = parser.parse_args(argv)
    if args.ignore_servers:
        if not args.url:
            parser.error("--ignore-servers needs --url")
        problem = http_problem(args.url)
        print(f"unhealthy: {problem}" if problem else f"healthy: {args.url} answered 200",
              file=sys.stderr if problem else sys.stdout)
        return 1 if problem else 0
    if not args.file:
        parser.error("no health file: pass --file or set MODELPOOL_HEALTH_FILE (the service writes it)")
    try:
        with open(args.file) as f:
            health = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"unhealthy: cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    problems = judge_health(health, time.time(), stale_after_s=args.stale_after, down_after_s=args.down_after)
    if args.url and (problem := http_problem(args.url)):
        problems.append(problem)
    for problem in problems:
        print(f"unhealthy: {problem}", file=sys.stderr)
    if not problems:
        links = ", ".join(f"{server} {'up' if (health.get(server) or {}).get('up') else 'down'}"
                          for server in ("postgres", "nats"))
        print(f"healthy: {health.get('service')} (pid {health.get('pid')}): {links}")
    return 1 if problems else 0


def judge_health(health: dict[str, Any], now: float, *, stale_after_s: float, down_after_s: float) -> list[str]:
    """What is wrong with a service, from its health file: nothing (healthy), or one line per problem."""
    problems = []
    age = now - float(health.get("at", 0))
    if age > stale_after_s:
        problems.append(f"{health.get('service', 'the service')} has not checked its servers for {age:.0f} s")
    for server in ("postgres", "nats"):
        link = health.get(server) or {}
        if not link.get("up") and float(link.get("for_s", 0)) > down_after_s:
            problems.append(f"{server} unreachable for {link['for_s']:.0f} s ({link.get('error')})")
    return problems


def http_problem(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=3.0) as response:
            return None if response.status == 200 else f"{url} answered {response.status}"
    except urllib.error.HTTPError as exc:
        return f"{url} answered {exc.code}"
    except (OSError, ValueError) as exc:
        return f"{url} did not answer: {exc}"
