"""Benchmark: two tenants on one saturated alias, arrival order against token-fair queuing.

Tenant A floods the alias at ten times its capacity; tenant B sends at a tenth
of it. B's time to first token (p95) and the share of the tokens it asked for
that it got, with the gateway's queue in arrival order (`queue_order: fifo`)
and token-fair (`fair`, `routing/fairness.py`), each against B alone on the
idle alias (`solo`). One run of each per repeat, in that order.

Setting, all on this machine: one SIMULATED vLLM engine (`modelpool engine
sim`, real time), recorded as the alias's one running instance with a reported
capacity of `--capacity` concurrent requests (what the gateway admits to it; the
engine itself batches up to 256); a `modelpool gateway` process on a scratch
namespace of the local Postgres and NATS, with the two tenants' keys. Every
request asks for `--tokens` tokens (`ignore_eos`). The alias's capacity in
requests per second is measured first (`--capacity` clients in a closed loop),
and the tenants' open-loop (Poisson) rates are set from it: A at `--flood` x,
B at `--light` x. Each phase offers load for `--seconds`, then waits `--grace`
seconds for B's requests under way; what is unanswered by then counts as not
served, and A's backlog is abandoned (the gateway cancels it). The gateway's
queue is as shipped (256 deep, 60 s): a request finding it full is refused
with 429, which counts against its tenant's share.

Then slow clients, once per repeat, on a fresh gateway with its limits as
shipped (4,096 connections, 10 s for headers, 30 s for a body):
`--slow-clients` connections each send a request's headers announcing a
1 MiB body, 4 KiB of it, then 100 bytes a second; meanwhile `/health` is asked
20 times a second. Reported: the gateway's RSS growth (peak over the phase,
less its RSS before the connections opened) and `/health`'s latency p99.

    .venv/bin/python bench/tenancy.py --repeats 3

Progress goes to stderr; the last line on stdout is the JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.ops.load import quantile  # noqa: E402
from shared.contracts.config import AliasConfig  # noqa: E402
from shared.net import free_port  # noqa: E402
from shared.settings import Settings  # noqa: E402

from harness import BenchService, drop_namespace, record_running, wait_ready  # noqa: E402

ALIAS = "shared"
KEYS = {"a": "sk-tenant-a-" + secrets.token_hex(6), "b": "sk-tenant-b-" + secrets.token_hex(6)}


def say(message: str) -> None:
    print(f"[tenancy bench] {message}", file=sys.stderr, flush=True)


def body(tokens: int, stream: bool) -> dict:
    return {"model": ALIAS, "messages": [{"role": "user", "content": "Summarise the incident report."}],
            "max_tokens": tokens, "ignore_eos": True, "stream": stream}


async def capacity_rps(client: httpx.AsyncClient, url: str, concurrency: int, tokens: int, seconds: float) -> float:
    """Requests per second the alias completes with every slot busy: `concurrency` clients, one after another."""
    done = 0
    deadline = time.monotonic() + seconds
    began = time.monotonic()

    async def one() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            answer = await client.post(f"{url}/v1/chat/completions", json=body(tokens, False),
                                       headers={"authorization": f"Bearer {KEYS['a']}"})
            answer.raise_for_status()
            done += 1

    await asyncio.gather(*(one() for _ in range(concurrency)))
    return done / (time.monotonic() - began)


async def light_request(client: httpx.AsyncClient, url: str, tokens: int, results: list[dict]) -> None:
    """One of B's requests, streamed: its time to first token and the tokens (content chunks) it got, however it
    ended (abandoned at the phase's end included)."""
    sent = time.perf_counter()
    first, got, status = None, 0, None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body(tokens, True),
                                 headers={"authorization": f"Bearer {KEYS['b']}"}) as response:
            status = response.status_code
            if status == 200:
                async for line in response.aiter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        first = first or time.perf_counter()
                        got += 1
    except httpx.HTTPError:
        pass
    finally:
        results.append({"status": status, "ttft_s": (first - sent) if first else None, "tokens": got})


async def flood_request(client: httpx.AsyncClient, url: str, tokens: int) -> None:
    with contextlib.suppress(httpx.HTTPError):
        await client.post(f"{url}/v1/chat/completions", json=body(tokens, False),
                          headers={"authorization": f"Bearer {KEYS['a']}"})


async def open_loop(rate: float, seconds: float, rng: random.Random, start) -> list[asyncio.Task]:
    """Poisson arrivals at `rate` for `seconds`, each started as a task."""
    tasks: list[asyncio.Task] = []
    deadline = time.monotonic() + seconds
    while rate > 0 and (now := time.monotonic()) < deadline:
        tasks.append(asyncio.create_task(start()))
        await asyncio.sleep(min(rng.expovariate(rate), max(0.0, deadline - now)))
    return tasks


async def flood(url: str, rate: float, seconds: float, tokens: int, seed: int) -> None:
    """A's load, in a process of its own (`--flood-only`), so B's client measures B and not A's client. Its
    backlog is abandoned when the parent ends the phase by stopping this process."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        tasks = await open_loop(rate, seconds, random.Random(seed), lambda: flood_request(client, url, tokens))
        await asyncio.gather(*tasks, return_exceptions=True)


async def phase(url: str, args: argparse.Namespace, rate_a: float, rate_b: float, seed: int) -> dict:
    """Offer A's (from another process) and B's open-loop load for `args.seconds`; wait `args.grace` for B's
    requests; abandon the rest."""
    flooder = None
    if rate_a > 0:
        flooder = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--flood-only", url, "--flood-rate", str(rate_a), "--seconds", str(args.seconds),
            "--tokens", str(args.tokens), "--seed", str(seed + 1), "--key", KEYS["a"])
    light: list[dict] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.seconds + args.grace + 30), limits=limits) as client:
        tasks_b = await open_loop(rate_b, args.seconds, random.Random(seed),
                                  lambda: light_request(client, url, args.tokens, light))
        if tasks_b:
            await asyncio.wait(tasks_b, timeout=args.grace)
        for task in tasks_b:
            task.cancel()
        await asyncio.gather(*tasks_b, return_exceptions=True)
    if flooder is not None:
        flooder.terminate()  # A's backlog is abandoned: the gateway sees its clients leave
        await flooder.wait()
    ttfts = [r["ttft_s"] for r in light if r.get("ttft_s") is not None]
    asked = len(tasks_b) * args.tokens
    b_tokens = sum(r["tokens"] for r in light)
    return {"b_requests": len(tasks_b), "b_answered": len(ttfts),
            "b_ttft_p50_ms": round(1000 * quantile(ttfts, 0.5), 1) if ttfts else None,
            "b_ttft_p95_ms": round(1000 * quantile(ttfts, 0.95), 1) if ttfts else None,
            "b_token_share": round(b_tokens / asked, 3) if asked else None,
            "b_tokens": b_tokens}


def gateway_service(work: Path, settings: Settings, port: int, order: str, name: str) -> BenchService:
    pool = work / f"pool-{order}.yaml"
    pool.write_text(yaml.safe_dump({"gateway": {  # the queue's size and timeout as shipped (256, 60 s)
        "queue_order": order,
        "tenant_keys": [{"key": KEYS["a"], "tenant": "a"}, {"key": KEYS["b"], "tenant": "b"}]}}))
    return BenchService(name, [sys.executable, "-m", "services.cli", "gateway"], work, {
        "DATABASE_URL": settings.database_url, "NATS_URL": settings.nats_url, "MODELPOOL_NAMESPACE": settings.namespace,
        "MODELPOOL_GATEWAY_PORT": str(port), "MODELPOOL_GATEWAY_ID": name, "MODELPOOL_CONFIG": str(pool)})


async def slow_clients(url: str, gateway: BenchService, connections: int, seconds: float) -> dict:
    """`connections` slow bodies held open for `seconds` while `/health` is timed; the gateway's RSS growth."""
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {2**20}\r\n\r\n").encode()
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        await client.get("/health")
        before = gateway.rss_bytes()
        writers = []
        for _ in range(connections):
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(head + b'{"model": "' + b"x" * 4096)
            writers.append(writer)
        say(f"  {connections} slow bodies open; timing /health for {seconds:g} s")
        latencies, peak = [], gateway.rss_bytes()
        deadline = time.monotonic() + seconds
        next_trickle = time.monotonic() + 1
        while time.monotonic() < deadline:
            started = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            latencies.append((time.perf_counter() - started) * 1000)
            peak = max(peak, gateway.rss_bytes())
            if time.monotonic() >= next_trickle:
                for writer in writers:
                    writer.write(b"x" * 100)
                next_trickle += 1
            await asyncio.sleep(0.05)
        for writer in writers:
            writer.close()
    return {"slow_clients": connections, "rss_before_mib": round(before / 2**20, 1),
            "rss_growth_mib": round((peak - before) / 2**20, 1),
            "health_p50_ms": round(quantile(latencies, 0.5), 2), "health_p99_ms": round(quantile(latencies, 0.99), 2),
            "health_requests": len(latencies)}


async def run(args: argparse.Namespace, work: Path) -> dict:
    settings = Settings.load({}, namespace=f"bench_tenancy_{secrets.token_hex(4)}")
    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    engine = BenchService("engine", [sys.executable, "-m", "services.cli", "engine", "sim", "--profile", "vllm",
                                     "--model", ALIAS, "--port", str(engine_port), "--startup-s", "0",
                                     "--max-num-seqs", "256", "--kv-cache-tokens", "4000000"], work)
    gateway: BenchService | None = None
    repeats = []
    try:
        await wait_ready(f"{engine_url}/health", engine)
        config = AliasConfig.model_validate({"alias": ALIAS, "backends": {"vllm": {
            "model_name": ALIAS, "model_path": "simulated", "gpu_memory_gb": 0, "engine": "simulator"}}})
        await record_running(settings, [(config, {f"{ALIAS}-1": (engine_url, None)}, args.capacity)])
        for repeat in range(args.repeats):
            row: dict = {}
            for order in ("solo", "fifo", "fair"):
                port = free_port()
                gateway = gateway_service(work, settings, port, "fair" if order == "solo" else order, f"gw-{order}-{repeat}")
                url = f"http://127.0.0.1:{port}"
                await wait_ready(f"{url}/health", gateway)
                async with httpx.AsyncClient(timeout=60) as client:
                    capacity = await capacity_rps(client, url, args.capacity, args.tokens, args.calibrate_s)
                rate_a, rate_b = args.flood * capacity, args.light * capacity
                say(f"repeat {repeat + 1} {order}: capacity {capacity:.1f} req/s; "
                    f"A at {0 if order == 'solo' else rate_a:.1f} req/s, B at {rate_b:.2f} req/s for {args.seconds:g} s")
                result = await phase(url, args, 0.0 if order == "solo" else rate_a, rate_b, 1000 * repeat + 7)
                result["capacity_rps"] = round(capacity, 2)
                say(f"  B: TTFT p95 {result['b_ttft_p95_ms']} ms, {result['b_answered']}/{result['b_requests']} "
                    f"answered, token share {result['b_token_share']}")
                row[order] = result
                gateway.stop()
                gateway = None
                await asyncio.sleep(2)  # the engine finishes or drops what was abandoned
            if args.slow_clients:
                port = free_port()
                gateway = gateway_service(work, settings, port, "fair", f"gw-slow-{repeat}")
                url = f"http://127.0.0.1:{port}"
                await wait_ready(f"{url}/health", gateway)
                row["slow"] = await slow_clients(url, gateway, args.slow_clients, args.slow_seconds)
                say(f"  slow clients: RSS +{row['slow']['rss_growth_mib']} MiB, "
                    f"/health p99 {row['slow']['health_p99_ms']} ms")
                gateway.stop()
                gateway = None
            for order in ("fifo", "fair"):
                solo, p95 = row["solo"]["b_ttft_p95_ms"], row[order]["b_ttft_p95_ms"]
                row[order]["b_ttft_p95_ratio"] = round(p95 / solo, 2) if p95 and solo else None
            repeats.append(row)
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()
        await drop_namespace(settings)

    def spread(order: str, key: str) -> dict:
        values = [r[order][key] for r in repeats if order in r and r[order].get(key) is not None]
        if not values:
            return {"median": None, "min": None, "max": None}
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    fair_ratio, fifo_ratio = spread("fair", "b_ttft_p95_ratio"), spread("fifo", "b_ttft_p95_ratio")
    return {
        "engine": "simulated-vllm",
        "capacity": args.capacity, "tokens": args.tokens, "flood_x": args.flood, "light_x": args.light,
        "seconds": args.seconds, "repeats": args.repeats,
        "b_ttft_p95_ratio_fair": fair_ratio["median"], "b_ttft_p95_ratio_fifo": fifo_ratio["median"],
        "b_token_share_fair": spread("fair", "b_token_share")["median"],
        "b_token_share_fifo": spread("fifo", "b_token_share")["median"],
        "slow_clients": args.slow_clients,
        "slow_clients_rss_growth_mib": spread("slow", "rss_growth_mib")["median"],
        "health_p99_ms_under_slow_clients": spread("slow", "health_p99_ms")["median"],
        "spread": {"b_ttft_p95_ratio_fair": fair_ratio, "b_ttft_p95_ratio_fifo": fifo_ratio,
                   "b_token_share_fair": spread("fair", "b_token_share"),
                   "b_token_share_fifo": spread("fifo", "b_token_share"),
                   "b_ttft_p95_ms_solo": spread("solo", "b_ttft_p95_ms"),
                   "slow_clients_rss_growth_mib": spread("slow", "rss_growth_mib"),
                   "health_p99_ms_under_slow_clients": spread("slow", "health_p99_ms")},
        "runs": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=16, help="the instance's reported capacity (concurrent requests)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens every request asks for")
    parser.add_argument("--flood", type=float, default=10.0, help="A's rate, in multiples of the measured capacity")
    parser.add_argument("--light", type=float, default=0.1, help="B's rate, in multiples of the measured capacity")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--calibrate-s", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slow-clients", type=int, default=2000, help="slow-body connections (0: no such phase)")
    parser.add_argument("--slow-seconds", type=float, default=10.0)
    parser.add_argument("--flood-only", metavar="URL", help=argparse.SUPPRESS)  # A's load, run by a phase
    parser.add_argument("--flood-rate", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood_only:
        KEYS["a"] = args.key
        asyncio.run(flood(args.flood_only, args.flood_rate, args.seconds, args.tokens, args.seed))
        return
    with tempfile.TemporaryDirectory(prefix="bench-tenancy-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
