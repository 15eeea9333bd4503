"""Benchmark: every router on Mooncake-format traffic, through the real gateway, against two reuse bounds.

The traffic is a slice of a Mooncake-format trace (`--trace FILE`, e.g. the
released `conversation_trace.jsonl`; by default one generated to the released
conversation trace's published statistics, `simulation/mooncake.py`), replayed
open loop at its timestamps (`services/ops/mooncake_replay.py`): long prompts,
modest reuse spread over many conversations, turns minutes apart, so load
balance and cache capacity matter as much as affinity.

Per router and repeat, from scratch (`bench/ear.py`'s pool): `--engines`
SIMULATED vLLM engines (prefix caching on, `--speedup` times real time) as
processes, recorded as the alias's running instances with `--capacity`
requests each, the alias registered with the router, `modelpool gateway` as its
own process. Routers: round-robin, least-load, kv-aware, sticky, affinity,
ear (KV moved with a migrated session, as llama.cpp and the simulator can) and
ear-recompute (a migrated session recomputes, as on vLLM).

APC is judged against two bounds over the requests sent: the trace's own
(`apc_bound_infinite`: an infinite cache seeing every request) and the
capacity-bounded oracle (`apc_bound_capacity`: one pooled LRU cache of the
engines' total KV capacity that sees every block: what any router could reach
with that much memory). Requests longer than `--max-model-len` allows are left
out of the slice (counted).

Each run first replays the `--warmup-s` (60) seconds of the trace before the
slice, left out of every figure and filling the bounds' caches too: routers
are judged on a pool in steady state, as one under sustained load is, not on
empty engines (`--warmup-s 0` measures from cold).

    .venv/bin/python bench/ear_mooncake.py --speedup 1 --duration 150 --repeats 3

Progress goes to stderr; the last line on stdout is the JSON summary: per
router, TTFT p50/p90/p99, APC, worst-instance TTFT p90, errors, and how far the
simulated engines fell behind their own model (`engine_drift`: over 10 % and
the run measured the machine, which it says), with their spread over the
repeats; and `trace_format`, `apc_bound_infinite`, `apc_bound_capacity`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from services.ops.mooncake_replay import MooncakeReplay, select, summarise_mooncake  # noqa: E402
from shared.contracts.mooncake import BLOCK_TOKENS, MooncakeRequest, conversations, read_mooncake, reuse_bound  # noqa: E402
from simulation.mooncake import SHAPES, generate_mooncake, statistics as trace_statistics  # noqa: E402

from ear import ALIAS, ear_defaults, in_turn, pool_arguments, run_router, say, spread, table_row  # noqa: E402

ROUTERS = ("round-robin", "least-load", "kv-aware", "sticky", "affinity", "ear-recompute", "ear")


def capacity_bound(requests: Sequence[MooncakeRequest], capacity_tokens: int, block: int = BLOCK_TOKENS,
                   warm: int = 0) -> tuple[int, int]:
    """(reusable, total) input tokens for one pooled LRU cache of `capacity_tokens` that sees every request's
    blocks in arrival order: a request reuses its leading blocks still cached. The first `warm` requests fill the
    cache and are not counted."""
    cache: OrderedDict[int, int] = OrderedDict()
    held = reusable = total = 0
    for n, request in enumerate(requests):
        counted = n >= warm
        total += request.input_length if counted else 0
        leading = True
        for index, block_id in enumerate(request.hash_ids):
            tokens = request.block_tokens(index, block)
            if block_id in cache:
                cache.move_to_end(block_id)
                if leading and counted:
                    reusable += tokens
                continue
            leading = False
            cache[block_id] = tokens
            held += tokens
            while held > capacity_tokens and cache:
                _, evicted = cache.popitem(last=False)
                held -= evicted
    return reusable, total


def mooncake_replay(requests: list[MooncakeRequest], sessions: list[str], warm: int, args: argparse.Namespace):
    async def replay(url: str, client: aiohttp.ClientSession, progress: Callable[[int], None]):
        run = MooncakeReplay(url, ALIAS, client, speedup=args.speedup, open_loop=True, progress=progress)
        wall = await run.run_mooncake(requests, sessions, BLOCK_TOKENS, args.max_tokens)
        return summarise_mooncake(run.served, requests, sessions, wall, args.speedup, warm), run.served
    return replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Real time: faster, the engines fall behind their model on two cores (the runs report `engine_drift`).
    pool_arguments(parser, ROUTERS, engines=8, speedup=1.0, kv_cache_tokens=1_000_000, max_model_len=131_072,
                   d_1=0.0001)
    parser.add_argument("--trace", type=Path, help="a Mooncake-format file (default: one generated)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mooncake-conversation")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--start", type=float, default=600.0, help="seconds into the trace to start at")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of the trace scored")
    parser.add_argument("--warmup-s", type=float, default=60.0,
                        help="seconds of the trace before --start replayed first and not scored: every router is "
                             "judged on a pool in steady state, its caches and queues filled (0: from cold)")
    parser.add_argument("--capacity", type=int, default=32, help="requests each engine takes at once")
    parser.add_argument("--max-tokens", type=int, default=None, help="cap on each request's output_length")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    ear_defaults(args)
    whole = read_mooncake(args.trace) if args.trace else generate_mooncake(SHAPES[args.shape], args.seed)
    named = dict(zip(map(id, whole), conversations(whole)))
    warm_from = max(0.0, args.start - args.warmup_s)

    def fitting(requests: list[MooncakeRequest]) -> list[MooncakeRequest]:
        return [r for r in requests if r.input_length + (args.max_tokens or r.output_length) < args.max_model_len]

    sliced = select(whole, args.start, args.duration)
    warm, scored = fitting(select(whole, warm_from, args.start - warm_from)), fitting(sliced)
    requests, sessions = warm + scored, [named[id(r)] for r in warm + scored]
    infinite = reuse_bound(scored, warm=warm)
    capacity = capacity_bound(requests, args.engines * args.kv_cache_tokens, warm=len(warm))
    apc_infinite, apc_capacity = infinite[0] / infinite[1], capacity[0] / capacity[1]
    say(f"trace: {len(scored)} requests scored ({len(sliced) - len(scored)} too long left out) in "
        f"{len(set(sessions[len(warm):]))} conversations over {args.duration:g} s, after {len(warm)} of a "
        f"{args.start - warm_from:g} s warm-up; reuse bound {apc_infinite:.3f} (infinite), {apc_capacity:.3f} "
        f"(pooled LRU of {args.engines} x {args.kv_cache_tokens} tokens)")
    runs: dict[str, list[dict]] = {router: [] for router in args.routers.split(",")}
    with tempfile.TemporaryDirectory(prefix="bench-ear-mooncake-") as tmp:
        for repeat in range(args.repeats):
            for router in in_turn(list(runs), repeat):
                say(f"repeat {repeat + 1}, {router}: {args.engines} engines, gateway, replay at {args.speedup:g}x")
                r = asyncio.run(run_router(router, args, mooncake_replay(requests, sessions, len(warm), args),
                                           len(requests), Path(tmp), capacity=args.capacity))
                r.pop("served")
                runs[router].append(r)
                say(f"{router}: TTFT p90 {r['ttft_s']['p90']} s, worst instance p90 {r['instance_ttft_p90_s']['max']} "
                    f"s, APC {r['apc']}, {r['failed']} failed, {r['migrations']} migrations ({r['kv_moves']} with "
                    f"their KV), engines {r['engine_drift']:.0%} behind their model")

    def of_bound(apc: float | None) -> float | None:
        return round(apc / apc_capacity, 4) if apc is not None and apc_capacity else None

    table = {router: {**table_row(rs), "apc_of_capacity_bound": spread([of_bound(r["apc"]) for r in rs])}
             for router, rs in runs.items()}

    def ear_mode(mode: str, key: str) -> float | None:
        return table[mode][key]["median"] if mode in table else None

    print(json.dumps({
        "engine": "simulated-vllm", "trace_format": "mooncake",
        "trace": str(args.trace) if args.trace else f"generated {args.shape} seed {args.seed}",
        "trace_statistics": trace_statistics(scored), "start_s": args.start, "duration_s": args.duration,
        "warmup_s": args.start - warm_from, "warm_up_requests": len(warm),
        "requests": len(scored), "left_out_too_long": len(sliced) - len(scored), "speedup": args.speedup,
        "engines": args.engines, "capacity": args.capacity, "kv_cache_tokens": args.kv_cache_tokens,
        "t_hot_tokens": args.t_hot_tokens, "repeats": args.repeats, "apc_bound_infinite": round(apc_infinite, 4),
        "apc_bound_capacity": round(apc_capacity, 4),
        # vLLM's mode first: a moved session recomputes its context there.
        "apc_ear_recompute": ear_mode("ear-recompute", "apc"), "apc_ear": ear_mode("ear", "apc"),
        "apc_ear_recompute_of_capacity_bound": ear_mode("ear-recompute", "apc_of_capacity_bound"),
        "apc_ear_of_capacity_bound": ear_mode("ear", "apc_of_capacity_bound"),
        "ttft_p90_s": {k: v["ttft_p90_s"]["median"] for k, v in table.items()},
        "worst_instance_ttft_p90_s": {k: v["worst_instance_ttft_p90_s"]["median"] for k, v in table.items()},
        "amplification": {k: v["amplification"]["median"] for k, v in table.items()},
        "migrations": table.get("ear", {}).get("migrations", {}).get("median"),
        "thrash_sessions": table.get("ear", {}).get("thrash_sessions", {}).get("median"),
        "routers": table,
    }))


if __name__ == "__main__":
    main()
