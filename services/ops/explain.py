"""`modelpool explain REQUEST_ID`: why a past request went where it went, from the gateway's access log.

The gateway writes one JSON line per request to `MODELPOOL_ACCESS_LOG` (which
`modelpool up` keeps in its data directory, `.modelpool/access.log`); this finds
the request's line (the newest first, the rotated copies too) and says what
served it, by which router and why, each retry's cause, and its times.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from services.gateway.access_log import files
from shared.settings import data_dir


def find(request_id: str, log: Path) -> dict[str, Any] | None:
    """The request's line, the newest if the id was sent more than once; None when no copy of the log has it."""
    needle = orjson.dumps(request_id)
    for path in files(log):
        found = None
        with open(path, "rb") as f:
            for line in f:
                if needle in line:
                    try:
                        record = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        continue  # a line cut short as the log rotated
                    if record.get("request_id") == request_id:
                        found = record
        if found is not None:
            return found
    return None


def explain(r: dict[str, Any]) -> str:
    lines = [f"request {r['request_id']} {r.get('path', '')}{' (stream)' if r.get('stream') else ''}"
             f"{' for ' + r['alias'] if r.get('alias') else ''}, ended {r.get('at', '?')}: "
             f"{r.get('status') or 'no status (the client left)'} {r.get('outcome', '')}"]
    if r.get("outcome") == "rejected":
        lines.append(f"  refused at the edge: {r.get('error') or 'bad request'}; it reached no instance")
        return "\n".join(lines)
    if r.get("instance"):
        lines.append(f"  served by {r['backend']} instance {r['instance']} (engine {r.get('engine') or '?'})")
    else:
        lines.append("  no instance took it")
    if r.get("route"):
        lines += [f"  why: {part}" for part in r["route"].split("; ")[1:]]
    if r.get("moved_from"):
        lines.append(f"  its session moved here from {r['moved_from']}")
    times = [f"{name} {r[key]:g} s" for name, key in (("queued", "queue_s"), ("first token", "ttft_s"),
                                                      ("whole", "e2e_s")) if r.get(key) is not None]
    if times:
        lines.append(f"  {', '.join(times)}")
    if r.get("prompt_tokens") is not None or r.get("completion_tokens") is not None:
        lines.append(f"  tokens: {r.get('prompt_tokens')} prompt, {r.get('completion_tokens')} completion")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool explain", description=__doc__.splitlines()[0])
    parser.add_argument("request_id", help="the request's x-request-id (sent by the client, or returned by the gateway)")
    parser.add_argument("--access-log", type=Path, default=None,
                        help="the gateway's access log (default: MODELPOOL_ACCESS_LOG, else .modelpool/access.log)")
    parser.add_argument("--json", action="store_true", help="print the access-log line as it is")
    args = parser.parse_args(argv)
    log = args.access_log or Path(os.environ.get("MODELPOOL_ACCESS_LOG") or data_dir(os.environ) / "access.log")
    if not files(log):
        print(f"modelpool explain: no access log at {log} (the gateway writes one where MODELPOOL_ACCESS_LOG says; "
              "`modelpool up` sets it)", file=sys.stderr)
        return 2
    record = find(args.request_id, log)
    if record is None:
        print(f"modelpool explain: no request {args.request_id!r} in {', '.join(map(str, files(log)))}", file=sys.stderr)
        return 1
    print(orjson.dumps(record).decode() if args.json else explain(record))
    return 0
