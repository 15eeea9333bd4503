"""Benchmark: EAR against the routers seed 004 names, on one generated agentic trace through the real gateway.

Per router, from scratch: `--engines` SIMULATED vLLM engines (`modelpool engine
sim`, prefix caching on, `--speedup` times real time) as processes, recorded in
a scratch namespace of the local Postgres as the alias's running instances, the
alias registered with that router, `modelpool gateway` as its own process, and
the trace replayed through it closed loop (`modelpool trace run`'s replayer).
Fresh engines each time, so no router inherits another's caches.

Routers: round-robin, least-load, kv-aware, sticky, affinity (EAR without
migration), ear-recompute (a moved session recomputes its context, as on vLLM)
and ear (its KV moved along, as llama.cpp and the simulator can); a name ending in
`+pull` (`--routers ear+pull`) is that router with `pull_prefix` on. Times are in
the trace's seconds (wall seconds times the speedup); `t_cool_s` is given in
trace seconds and divided by the speedup for the gateway.

    .venv/bin/python bench/ear.py --repeats 3 --plot docs/img/ear.png

Progress goes to stderr; the last line on stdout is the JSON summary, with the
keys of the EAR issue: `apc_ear_recompute` and `apc_ear` (each also as a share
of `apc_upper_bound`), `ttft_p90_s`, `worst_instance_ttft_p90_s`,
`amplification` (each keyed by router), `migrations` and `thrash_sessions`
(medians over the repeats), and per router every figure with its spread,
`engine_drift` among them: how far the simulated engines fell behind their own
model. Over 10 % the run measured the machine rather than the routers, and says
so: lower `--speedup`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.ops.trace_replay import Replay, ReplayedRequest, replay_client, summarise  # noqa: E402
from shared.contracts.config import AliasConfig  # noqa: E402
from shared.contracts.events import event_registry  # noqa: E402
from shared.contracts.trace import TraceRequest  # noqa: E402
from shared.eventlog.db import create_engine  # noqa: E402
from shared.eventlog.store import make_store  # noqa: E402
from shared.internal_auth import SECRET_ENV  # noqa: E402
from shared.net import free_ports  # noqa: E402
from shared.settings import Settings  # noqa: E402
from simulation.agentic import AgenticShape, generate_agentic, io_ratio, skew  # noqa: E402

from harness import BenchService, drop_namespace, record_running, wait_ready  # noqa: E402

ALIAS = "agent"
ROUTERS = ("round-robin", "least-load", "kv-aware", "sticky", "affinity", "ear-recompute", "ear")


def say(message: str) -> None:
    print(f"[ear bench] {message}", file=sys.stderr, flush=True)


async def migrations_of(settings: Settings, t_cool_wall_s: float) -> dict:
    """The log's session moves: how many, their recorded reasons, and sessions that moved twice within T_cool."""
    db = create_engine(settings, pool_size=1)
    store = make_store(db, event_registry(), settings.namespace)
    moves = await store.of_type("SessionMigrated")
    bound = await store.of_type("SessionBound")
    await db.dispose()
    times: dict[str, list[float]] = {}
    reasons: dict[str, int] = {}
    for event in moves:
        times.setdefault(event.payload["session_id"], []).append(event.occurred_at.timestamp())
        reasons[event.payload["reason"]] = reasons.get(event.payload["reason"], 0) + 1
    thrash = sum(1 for ts in times.values() if any(b - a < t_cool_wall_s for a, b in zip(sorted(ts), sorted(ts)[1:])))
    carried = [e.payload["metrics"] for e in moves if e.payload["metrics"].get("kv_moved")]
    return {"migrations": len(moves), "reasons": reasons, "thrash_sessions": thrash, "sessions_bound": len(bound),
            "kv_moves": len(carried), "kv_tokens_moved": int(sum(m["kv_tokens"] for m in carried)),
            "kv_move_s_max": max((m["kv_move_s"] for m in carried), default=None)}


Replayer = Callable[[str, aiohttp.ClientSession, Callable[[int], None]], Awaitable[tuple[dict, list[ReplayedRequest]]]]
"""Replays a trace through the gateway at the URL: its summary and every request as it went."""


async def run_router(router: str, args: argparse.Namespace, replay: Replayer, requests: int, work: Path,
                     capacity: int | None = None) -> dict:
    """One router from scratch: fresh engines, the alias recorded with the router, a gateway, the replay. A
    router named `NAME-recompute` is NAME with `move_kv` off: a moved session recomputes (as on vLLM); one named
    `NAME+pull` pulls a prompt's cached prefix from the instance holding it (`pull_prefix`)."""
    python = sys.executable
    settings = Settings.load({}, namespace=f"bench_ear_{secrets.token_hex(4)}")
    processes: list[BenchService] = []
    capacity = capacity or args.kv_cache_tokens // args.max_model_len  # what the worker reads from a vLLM engine
    named = router.removesuffix("+pull")
    plugin, move_kv = named.removesuffix("-recompute"), args.kv_moves and not named.endswith("-recompute")
    # The engines' internal ports answer, and the gateway signs its KV moves, only with the cluster secret.
    cluster = {SECRET_ENV: secrets.token_urlsafe(32)}
    try:
        engines: dict[str, tuple[str, str | None]] = {}
        ports = free_ports(2 * args.engines + 1)
        for i in range(args.engines):
            port, internal_port = ports[2 * i], ports[2 * i + 1]
            engines[f"v{i}"] = (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{internal_port}" if args.kv_moves else None)
            processes.append(BenchService(f"{router}-engine-{i}", [
                python, "-m", "services.cli", "engine", "sim", "--profile", "vllm", "--model", ALIAS, "--port", str(port),
                "--internal-port", str(internal_port), "--kv-transfer-gb-s", str(args.kv_transfer_gb_s),
                "--speedup", str(args.speedup), "--startup-s", "0", "--seed", str(i),
                "--kv-cache-tokens", str(args.kv_cache_tokens), "--max-model-len", str(args.max_model_len),
                "--d-1", str(args.d_1)], work, cluster))
        for (url, _), process in zip(engines.values(), processes):
            await wait_ready(f"{url}/health", process)
        custom = args.router_configs.get(router, {})
        config = AliasConfig.model_validate({
            "alias": ALIAS, "router": {"plugin": plugin, "t_hot_tokens": args.t_hot_tokens,
                                       "t_cool_s": args.t_cool_s / args.speedup, "move_kv": move_kv,
                                       "pull_prefix": router.endswith("+pull"), **custom},
            "backends": {"vllm": {"model_name": ALIAS, "model_path": "simulated", "gpu_memory_gb": 24,
                                  "engine": "simulator", "max_model_len": args.max_model_len}}})
        await record_running(settings, [(config, engines, capacity)])
        gateway_port = ports[-1]
        gateway = BenchService(f"{router}-gateway", [python, "-m", "services.cli", "gateway"], work, {
            **cluster, "DATABASE_URL": settings.database_url, "NATS_URL": settings.nats_url, "MODELPOOL_NAMESPACE": settings.namespace,
            "MODELPOOL_GATEWAY_PORT": str(gateway_port), "MODELPOOL_GATEWAY_ID": "bench", "MODELPOOL_QUEUE_SIZE": "4096",
            "MODELPOOL_QUEUE_TIMEOUT_S": "600", "MODELPOOL_LOG_LEVEL": "WARNING",
            # Every new session bound: the bench measures routing, not the per-key bound on log writes.
            "MODELPOOL_SESSIONS_PER_MINUTE": "100000000"})
        processes.append(gateway)
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        await wait_ready(f"{gateway_url}/health", gateway)

        def progress(n: int) -> None:
            if n % max(1, requests // 10) == 0:
                say(f"{router}: {n}/{requests} requests answered")

        async with replay_client(args.timeout_s) as client:
            summary, served = await replay(gateway_url, client, progress)
            summary["engine_drift"] = await engine_drift(client, [url for url, _ in engines.values()])
        if summary["engine_drift"] > DRIFT_LIMIT:
            say(f"{router}: the simulated engines ran {summary['engine_drift']:.0%} slower than their model "
                f"(over {DRIFT_LIMIT:.0%}): the machine, not the router, set these latencies; lower --speedup")
        summary.update(await migrations_of(settings, args.t_cool_s / args.speedup))
        if move_kv and summary["migrations"] and not summary["kv_moves"]:
            say(f"{router}: none of {summary['migrations']} moves carried its KV: see {work}/{router}-gateway.log")
        summary["served"] = served
        return summary
    finally:
        for process in reversed(processes):
            process.stop()
        await drop_namespace(settings)


DRIFT_LIMIT = 0.1
"""A run whose simulated engines fall further behind their own schedule than this measured the machine (bench/sim.py
holds the simulator to 5 % alone; the routers' runs share the cores with the gateway and the replay)."""


async def engine_drift(client: aiohttp.ClientSession, urls: list[str]) -> float:
    """How much slower than modelled the engine furthest behind ran its batches: actual / scheduled wall time - 1."""
    worst = 0.0
    for url in urls:
        async with client.get(f"{url}/sim/status") as response:
            status = await response.json()
        if status["scheduled_wall_s"] > 0:  # an engine that ran no batch fell behind nothing
            worst = max(worst, status["actual_wall_s"] / status["scheduled_wall_s"] - 1)
    return round(worst, 3)


def agentic_replay(trace: list[TraceRequest], speedup: float) -> Replayer:
    async def replay(url: str, client: aiohttp.ClientSession, progress: Callable[[int], None]):
        run = Replay(url, ALIAS, client, speedup=speedup, progress=progress)
        wall = await run.run(trace)
        return summarise(run.served, trace, wall, speedup), run.served
    return replay


def plot(results: dict[str, dict], path: Path) -> None:
    from services.ops.trace_plots import plot_runs

    plot_runs({router: (r, r["served"]) for router, r in results.items()}, path)


def in_turn(routers: list[str], repeat: int) -> list[str]:
    """The routers in the order repeat `repeat` runs them: rotated by one each repeat, so none always runs first or
    last (a drift in the machine over a repeat lands on every router alike)."""
    shift = repeat % len(routers) if routers else 0
    return routers[shift:] + routers[:shift]


def pool_arguments(parser: argparse.ArgumentParser, routers: tuple[str, ...] = ROUTERS, engines: int = 8,
                   speedup: float = 4.0, kv_cache_tokens: int = 262_144, max_model_len: int = 65_536,
                   d_1: float = 0.0004) -> None:
    """The routers, engines and EAR settings both EAR benchmarks take."""
    parser.add_argument("--routers", default=",".join(routers))
    parser.add_argument("--engines", type=int, default=engines)
    parser.add_argument("--speedup", type=float, default=speedup)
    parser.add_argument("--kv-cache-tokens", type=int, default=kv_cache_tokens, help="KV capacity of each engine, tokens")
    parser.add_argument("--d-1", type=float, default=d_1,
                        help="engine seconds per batched token (prefill speed: 0.0004 is 2,500 tokens/s)")
    parser.add_argument("--max-model-len", type=int, default=max_model_len)
    parser.add_argument("--t-hot-tokens", type=int, default=None, help="EAR's T_hot (default: the pool's default)")
    parser.add_argument("--t-cool-s", type=float, default=None, help="EAR's T_cool in trace seconds (default: the pool's)")
    parser.add_argument("--no-kv-moves", dest="kv_moves", action="store_false",
                        help="EAR's moved sessions recompute their context (as on vLLM) instead of taking their KV along")
    parser.add_argument("--kv-transfer-gb-s", type=float, default=10.0, help="the engines' modelled KV link, GB/s")
    parser.add_argument("--router-config", action="append", default=[], metavar="NAME=JSON",
                        help='a router of your own, run as NAME (list it in --routers): the named router\'s '
                             'pool-file settings overridden by JSON, e.g. ear-kv=\'{"plugin": "ear", "scorers": '
                             '[{"name": "prefix-hit", "weight": 2}, {"name": "least-pending-prefill"}]}\'')
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--plot", type=Path)


def ear_defaults(args: argparse.Namespace) -> None:
    from shared.contracts.config import DEFAULT_T_COOL_S, DEFAULT_T_HOT_TOKENS

    args.t_hot_tokens = DEFAULT_T_HOT_TOKENS if args.t_hot_tokens is None else args.t_hot_tokens
    args.t_cool_s = DEFAULT_T_COOL_S if args.t_cool_s is None else args.t_cool_s
    args.router_configs = {}
    for given in args.router_config:
        name, _, settings = given.partition("=")
        try:
            args.router_configs[name] = json.loads(settings)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--router-config {given!r}: NAME=JSON, the JSON an object ({exc})") from exc
        if not isinstance(args.router_configs[name], dict):
            raise SystemExit(f"--router-config {given!r}: NAME=JSON, the JSON an object")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pool_arguments(parser)
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--span-s", type=float, default=120.0, help="sessions start over this long (trace seconds)")
    parser.add_argument("--alpha", type=float, default=AgenticShape.alpha, help="Pareto shape of session lengths (skew)")
    parser.add_argument("--new-input-tokens", type=float, default=AgenticShape.new_input_tokens)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    ear_defaults(args)
    shape = AgenticShape(sessions=args.sessions, span_s=args.span_s, alpha=args.alpha,
                         new_input_tokens=args.new_input_tokens, max_turns=32)
    trace = generate_agentic(shape, args.seed)
    say(f"trace: {len(trace)} requests in {args.sessions} sessions, input/output {io_ratio(trace):.0f}, "
        f"top 1 % of sessions carry {skew(trace)[0.01]:.0%} of the input")
    runs: dict[str, list[dict]] = {router: [] for router in args.routers.split(",")}
    with tempfile.TemporaryDirectory(prefix="bench-ear-") as tmp:
        for repeat in range(args.repeats):
            for router in in_turn(list(runs), repeat):
                say(f"repeat {repeat + 1}, {router}: {args.engines} engines, gateway, replay at {args.speedup:g}x")
                r = asyncio.run(run_router(router, args, agentic_replay(trace, args.speedup), len(trace), Path(tmp)))
                runs[router].append(r)
                say(f"{router}: TTFT p90 {r['ttft_s']['p90']} s, worst instance p90 {r['instance_ttft_p90_s']['max']} "
                    f"s, APC {r['apc']} of {r['apc_upper_bound_intra_session']}, amplification {r['amplification']}, "
                    f"{r['migrations']} migrations ({r['kv_moves']} with their KV), {r['failed']} failed, "
                    f"engines {r['engine_drift']:.0%} behind their model")
    if args.plot:
        plot({router: rs[0] for router, rs in runs.items()}, args.plot)
    keyed = {router: [{k: v for k, v in r.items() if k != "served"} for r in rs] for router, rs in runs.items()}

    def median(router: str, value: Callable[[dict], float | None]) -> float | None:
        return spread([value(r) for r in keyed.get(router, [])])["median"]

    bound = median("ear", lambda r: r["apc_upper_bound_intra_session"])
    apc = {mode: median(mode, lambda r: r["apc"]) for mode in ("ear-recompute", "ear")}
    print(json.dumps({
        "engine": "simulated-vllm", "speedup": args.speedup, "engines": args.engines, "requests": len(trace),
        "sessions": args.sessions, "t_hot_tokens": args.t_hot_tokens, "t_cool_s": args.t_cool_s,
        "repeats": args.repeats, "apc_upper_bound": bound,
        # vLLM's mode first: a moved session recomputes its context there.
        "apc_ear_recompute": apc["ear-recompute"], "apc_ear": apc["ear"],
        "apc_ear_recompute_of_bound": round(apc["ear-recompute"] / bound, 4) if apc["ear-recompute"] and bound else None,
        "apc_ear_of_bound": round(apc["ear"] / bound, 4) if apc["ear"] and bound else None,
        "ttft_p90_s": {k: median(k, lambda r: r["ttft_s"]["p90"]) for k in keyed},
        "worst_instance_ttft_p90_s": {k: median(k, lambda r: r["instance_ttft_p90_s"]["max"]) for k in keyed},
        "amplification": {k: median(k, lambda r: r["amplification"]) for k in keyed},
        "migrations": median("ear", lambda r: r["migrations"]), "thrash_sessions": median("ear", lambda r: r["thrash_sessions"]),
        "kv_moves": median("ear", lambda r: r["kv_moves"]),
        "kv_transfer_gb_s": args.kv_transfer_gb_s if args.kv_moves else None,
        "routers": {router: table_row(rs) for router, rs in keyed.items()},
    }))


def spread(values: list[float | None]) -> dict:
    """Median, min and max of the values present over the repeats."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(present), 4), "min": min(present), "max": max(present)}


def table_row(rs: list[dict]) -> dict:
    """One router's figures over the repeats, each with its spread."""
    return {
        "ttft_p50_s": spread([r["ttft_s"]["p50"] for r in rs]), "ttft_p90_s": spread([r["ttft_s"]["p90"] for r in rs]),
        "ttft_p99_s": spread([r["ttft_s"]["p99"] for r in rs]), "apc": spread([r["apc"] for r in rs]),
        "worst_instance_ttft_p90_s": spread([r["instance_ttft_p90_s"]["max"] for r in rs]),
        "errors": sum(r["failed"] + r["not_sent"] for r in rs), "migrations": spread([r["migrations"] for r in rs]),
        "kv_moves": spread([r["kv_moves"] for r in rs]), "thrash_sessions": spread([r["thrash_sessions"] for r in rs]),
        "amplification": spread([r["amplification"] for r in rs]),
        "engine_drift": spread([r["engine_drift"] for r in rs]),
    }

if __name__ == "__main__":
    main()
