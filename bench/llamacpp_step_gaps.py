"""Benchmark: where a lone stream's time goes in modelpool's llama.cpp engine.

One client stream sends chat requests back to back (as `bench/llamacpp_engine.py` does at 1 stream) for
--seconds per repeat; after each repeat the engine's own `/debug/steps` log gives every decode step's duration
and the gap between two consecutive steps of the same request: the time the decode thread spends per token
outside `llama_decode` (sampling, the token's bookkeeping, its event to the HTTP edge, the next schedule). The
bare loop of `llama_decode` calls (the `limit` of `bench/llamacpp_engine.py`, one sequence) is timed after the
engine stops, so the two never share the cores. Reported per repeat and as median and range; the last line
printed is one JSON object.

    .venv/bin/python bench/llamacpp_step_gaps.py [--threads 2] [--seconds 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.llamacpp_engine import (  # noqa: E402
    CTX_PER_SLOT,
    BareDecodeLimit,
    engine_command,
    load_level,
    start_server,
    stop_server,
    warm_up,
)
from services.engines.llamacpp.model_files import default_model_path  # noqa: E402
from shared.net import free_port  # noqa: E402

SLOTS = 8


def step_gaps(steps: list[dict]) -> tuple[list[float], list[float]]:
    """(decode-only step durations, gaps between consecutive decode steps of one request), in ms."""
    def decoding(step: dict) -> bool:
        return bool(step["seqs"]) and all(q["kind"] == "decode" for q in step["seqs"])

    gaps = [
        (b["started_at"] - a["started_at"]) * 1000 - a["duration_ms"]
        for a, b in zip(steps, steps[1:])
        if decoding(a) and decoding(b) and a["seqs"][0]["request_id"] == b["seqs"][0]["request_id"]
    ]
    return [s["duration_ms"] for s in steps if decoding(s)], gaps


def read_steps(url: str, last: int) -> list[dict]:
    return httpx.get(url + "/debug/steps", params={"last": last}, timeout=10).json()["steps"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--engine-args", default="", help="more arguments for the engine, as one string")
    ap.add_argument("--logs", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    model = args.model or default_model_path()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(engine_command(model, port, args.threads, SLOTS, args.engine_args.split()), port,
                        args.logs / "bench_llamacpp_step_gaps.log", "/health")
    repeats: list[dict] = []
    try:
        warm_up(url, "bench", {})
        last_step = read_steps(url, 1)[-1]["step_id"]
        for k in range(args.repeats):
            run = asyncio.run(load_level(url, "bench", 1, args.seconds, args.max_tokens, {}))
            # The log keeps the last steps only: read it after each repeat, and count this repeat's steps alone.
            steps = [s for s in read_steps(url, 4096) if s["step_id"] > last_step]
            last_step = steps[-1]["step_id"]
            durations, gaps = step_gaps(steps)
            repeats.append({
                "tokens_per_s": round(run["tokens_per_s"], 1),
                "decode_ms_p50": round(statistics.median(durations), 3),
                "gap_ms_p50": round(statistics.median(gaps), 3),
                "gap_ms_mean": round(statistics.mean(gaps), 3),
                "gaps": len(gaps),
            })
            print(json.dumps({"repeat": k, **repeats[-1]}), flush=True)
    finally:
        stop_server(proc)
    limit = BareDecodeLimit(model, args.threads, SLOTS, SLOTS * CTX_PER_SLOT)
    try:
        limit_ms = [1000 / limit.measure(1, args.max_tokens, 8) for _ in range(args.repeats)]
    finally:
        limit.close()
    print(json.dumps({"limit_step_ms": [round(x, 3) for x in limit_ms]}), flush=True)

    gap = [r["gap_ms_p50"] for r in repeats]
    decode = [r["decode_ms_p50"] for r in repeats]
    print(json.dumps({
        "engine": "llama.cpp (modelpool engine over llama-cpp-python)",
        "threads": args.threads,
        "repeats": args.repeats,
        "gap_ms_p50": round(statistics.median(gap), 3),
        "gap_ms_p50_range": [min(gap), max(gap)],
        "decode_ms_p50": round(statistics.median(decode), 3),
        "decode_ms_p50_range": [min(decode), max(decode)],
        "limit_step_ms": round(statistics.median(limit_ms), 3),
        "gap_share_of_step": round(statistics.median(gap) / (statistics.median(decode) + statistics.median(gap)), 4),
        "tokens_per_s": [r["tokens_per_s"] for r in repeats],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
