"""Benchmark: where a lone stream's time goes in modelpool's llama.cpp engine, beside llama-server.

One client stream sends chat requests back to back (as `bench/llamacpp_engine.py` does at 1 stream) for
--seconds per repeat; after each repeat the engine's own `/debug/steps` log gives every decode step's duration
and the gap between two consecutive steps of the same request: the time the decode thread spends per token
outside `llama_decode` (sampling, the token's bookkeeping, its event to the HTTP edge, the next schedule). The
same stream then runs against llama-server, and for both servers the kernel's per-thread run time gives the CPU
each spends per token outside its two llama.cpp compute threads (the two busiest with --threads 2): the serving
layer's own work, which shares the cores with the decode. The bare loop of `llama_decode` calls (the `limit` of
`bench/llamacpp_engine.py`, one sequence) is timed after the servers stop, so none shares the cores with it.
Reported per repeat and as median and range; the last line printed is one JSON object.

    .venv/bin/python bench/llamacpp_step_gaps.py [--threads 2] [--seconds 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
    llama_server_command,
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


def thread_cpu_s(pid: int) -> dict[int, float]:
    """Seconds each thread of process `pid` has run on a CPU so far (the kernel's schedstat, in ns)."""
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return out


def outside_compute_s(before: dict[int, float], after: dict[int, float], compute_threads: int) -> float:
    """CPU seconds a process's threads ran between two readings, but for its `compute_threads` busiest ones."""
    used = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    return sum(used[compute_threads:])


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

    port, server_port = free_port(), free_port()
    url, server_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{server_port}"
    proc = start_server(engine_command(model, port, args.threads, SLOTS, args.engine_args.split()), port,
                        args.logs / "bench_llamacpp_step_gaps.log", "/health")
    server = None
    repeats: list[dict] = []

    def measured(url: str, pid: int) -> tuple[dict, float]:
        """One repeat's load on one server, and its CPU ms per token outside the compute threads."""
        before = thread_cpu_s(pid)
        run = asyncio.run(load_level(url, "bench", 1, args.seconds, args.max_tokens, {}))
        return run, 1000 * outside_compute_s(before, thread_cpu_s(pid), args.threads) / run["tokens"]

    try:
        server = start_server(llama_server_command(model, server_port, args.threads, SLOTS, []), server_port,
                              args.logs / "bench_llamacpp_step_gaps_llama_server.log", "/health")
        warm_up(url, "bench", {})
        warm_up(server_url, "bench", {})
        last_step = read_steps(url, 1)[-1]["step_id"]
        for k in range(args.repeats):
            run, outside_ms = measured(url, proc.pid)
            # The log keeps the last steps only: read it after each repeat, and count this repeat's steps alone.
            steps = [s for s in read_steps(url, 4096) if s["step_id"] > last_step]
            last_step = steps[-1]["step_id"]
            durations, gaps = step_gaps(steps)
            server_run, server_outside_ms = measured(server_url, server.pid)
            repeats.append({
                "tokens_per_s": round(run["tokens_per_s"], 1),
                "decode_ms_p50": round(statistics.median(durations), 3),
                "gap_ms_p50": round(statistics.median(gaps), 3),
                "gap_ms_mean": round(statistics.mean(gaps), 3),
                "gaps": len(gaps),
                "outside_compute_ms_per_token": round(outside_ms, 3),
                "llama_server_tokens_per_s": round(server_run["tokens_per_s"], 1),
                "llama_server_outside_compute_ms_per_token": round(server_outside_ms, 3),
            })
            print(json.dumps({"repeat": k, **repeats[-1]}), flush=True)
    finally:
        stop_server(proc)
        if server is not None:
            stop_server(server)
    limit = BareDecodeLimit(model, args.threads, SLOTS, SLOTS * CTX_PER_SLOT)
    try:
        limit_ms = [1000 / limit.measure(1, args.max_tokens, 8) for _ in range(args.repeats)]
    finally:
        limit.close()
    print(json.dumps({"limit_step_ms": [round(x, 3) for x in limit_ms]}), flush=True)

    def median_range(key: str) -> list[float]:
        values = [r[key] for r in repeats]
        return [round(statistics.median(values), 3), min(values), max(values)]

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
        "outside_compute_ms_per_token": median_range("outside_compute_ms_per_token"),
        "llama_server_tokens_per_s": [r["llama_server_tokens_per_s"] for r in repeats],
        "llama_server_outside_compute_ms_per_token": median_range("llama_server_outside_compute_ms_per_token"),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
