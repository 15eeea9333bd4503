"""The hybrid pool against pure vLLM pools (from zero, and kept asleep) and a pure llama.cpp pool, on the same traces.

Each pool runs as the real services (relay, projector, placement, autoscaler,
gateway, one worker) on the local Postgres and NATS, in a scratch namespace
dropped afterwards. Its engines are SIMULATED (`modelpool engine sim`), both
tiers: vLLM needs a GPU, and simulating llama.cpp too gives both tiers their
throughput from the same decode model. The pools:

- hybrid: llama.cpp (up to `--fast-max` replicas) and one vLLM;
- vllm: one vLLM, started from zero by the first request;
- vllm_asleep_l1, vllm_asleep_l2: one vLLM kept asleep at level 1 / level 2
  (`standby_replicas: 1`), woken by the same controller when the wave comes:
  the peer a careful operator runs. Before the wave the bench lets the
  controller start it and put it to sleep (idle times of 1 s, so this takes the
  start and a few seconds), not counted;
- llamacpp: llama.cpp alone (up to `--fast-max` replicas).

Inputs, all of them assumptions but the measured llama.cpp start:

- simulated vLLM start: `--vllm-start-s`, default 48 s; wake: `--vllm-wake-l1-s`
  0.3 s, `--vllm-wake-l2-s` 2.6 s. All three from vLLM's blog "Zero-Reload Model
  Switching with vLLM Sleep Mode" (blog.vllm.ai, 2025-10-26), section "Sleep
  Levels", A100, vLLM 0.11.0, Qwen3-0.6B and Phi-3-vision: a switch without
  sleep mode (a fresh vLLM) averaged about 48 s, one from level 2 about 2.6 s
  (0.85 s and 2.58 s for the two models), a wake from level 1 0.26 s (Qwen3-0.6B);
- the cold wave of the pure vLLM pool from zero is rerun (that phase alone) for
  each start in `--vllm-start-sweep` (default 20,48,90 s): no other pool's
  result depends on the vLLM start (the hybrid answers the wave on llama.cpp,
  the asleep pools wake);
- simulated llama.cpp: the start of the REAL llama.cpp engine on this machine
  (`modelpool engine llama.cpp`, process start to a healthy `/health`), measured
  first, less the simulated engine's own process start; its slots are the real
  engine's default (`n_seq_max`, services/engines/llamacpp/settings.py: 8).

Every pool meets the same two phases, starting COLD (the asleep pools: COLD, their vLLM asleep):

1. cold wave: `--wave` streamed requests arriving at seeded random times over
   `--wave-s` seconds; TTFT (to the first content token) per request;
2. sustained: `--concurrency` clients, each sending one non-streamed request
   after another for `--sustained-s` seconds; throughput (completion tokens/s)
   and E2E over the last `--measure-s` seconds, once the pools have settled.

Every request ends answered, with a documented error (an HTTP error with an
OpenAI body, or an error event in a stream), or lost (the connection broke or
it never ended): lost must be 0. The policy runs with seed 000's defaults.
Progress goes to stderr; the last line on stdout is the JSON summary.

    .venv/bin/python bench/pool.py --plot docs/img/pool.png --timeline docs/img/pool_hybrid_timeline.png

Time: about 23 minutes for one run of the five pools and the sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.ops.load import quantile, read_stream  # noqa: E402
from services.cluster.localpool import LocalPool  # noqa: E402
from services.engines.llamacpp.settings import EngineSettings as LlamaCppSettings  # noqa: E402
from services.ops.timeline_figure import plot_history  # noqa: E402
from shared.bus.jetstream import connect, ensure_streams  # noqa: E402
from shared.bus.subjects import Subjects  # noqa: E402
from shared.contracts.events import event_registry  # noqa: E402
from shared.eventlog.db import create_engine, migrate_async  # noqa: E402
from shared.eventlog.store import make_store  # noqa: E402
from shared.net import free_port  # noqa: E402
from shared.contracts.states import InstanceState  # noqa: E402
from shared.settings import Settings  # noqa: E402

ALIAS = "bench"
POOLS = ("hybrid", "vllm", "vllm_asleep_l1", "vllm_asleep_l2", "llamacpp")
ASLEEP = {"vllm_asleep_l1": 1, "vllm_asleep_l2": 2}
"""The pure vLLM pools kept asleep, by sleep level."""
FAST_SLOTS = LlamaCppSettings.model_fields["n_seq_max"].default
"""The simulated llama.cpp's slots: the real engine's default."""
PREPARE_IDLE_S = 1.0
"""The asleep pools' idle time before each sleep, so their vLLM is asleep within seconds of its start. It decides
nothing during the traces: a pure vLLM tier holds its one instance until the load has been low for down_hold_s."""
WORKER = {"MODELPOOL_WORKER_GPU_MEMORY_GB": "24", "MODELPOOL_WORKER_SLOTS": "6"}
PROMPTS = (
    "Explain in three sentences why the sky is blue.",
    "Write a short poem about a lighthouse.",
    "List five uses of a paperclip.",
    "Describe how a bicycle works.",
)


def pool_yaml(kind: str, fast_start_s: float, vllm: dict[str, float], fast_max: int) -> str:
    """The pool file of `kind`; `vllm`: the simulated vLLM's startup-s, wake-l1-s and wake-l2-s."""
    fast = (f"      llama.cpp: {{model_name: {ALIAS}, model_path: default, gpu_memory_gb: 0, min_replicas: 0, "
            f"max_replicas: {fast_max}, engine: simulator, "
            f"engine_args: {{startup-s: {fast_start_s:.2f}, max-num-seqs: {FAST_SLOTS}}}}}\n")
    level = ASLEEP.get(kind)
    standby = f"standby_replicas: 1, standby_sleep_level: {level}, " if level else ""
    engine_args = ", ".join(f"{name}: {value:g}" for name, value in vllm.items())
    slow = (f"      vllm: {{model_name: {ALIAS}, model_path: /models/{ALIAS}, gpu_memory_gb: 12, min_replicas: 0, "
            f"max_replicas: 1, {standby}max_model_len: 4096, engine: simulator, engine_args: {{{engine_args}}}}}\n")
    backends = {"hybrid": fast + slow, "llamacpp": fast}.get(kind, slow)
    policy = (f"    autoscaling_policy: {{name: hybrid, vllm_sleep_l1_idle_s: {PREPARE_IDLE_S:g}, "
              f"vllm_sleep_l2_idle_s: {PREPARE_IDLE_S:g}}}\n") if level else ""
    return f"aliases:\n  - alias: {ALIAS}\n    backends:\n{backends}{policy}"


async def asleep_at(store, level: int, timeout_s: float) -> float:
    """Wait until the alias's vLLM instance is asleep at `level` (the controller started it and let it sleep);
    the seconds it took."""
    wanted = InstanceState.SLEEP_1 if level == 1 else InstanceState.SLEEP_2
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        latest = {e.payload["instance_id"]: e.payload["to_state"]
                  for e in await store.of_type("InstanceStateChanged", alias=ALIAS)}
        if wanted.value in latest.values():
            return time.monotonic() - started
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the standby vLLM was not asleep at level {level} within {timeout_s:.0f} s")


# --------------------------------------------------------------------------- engine start times


def time_to_healthy(argv: list[str], port: int, timeout_s: float = 120.0) -> float:
    """Seconds from spawning an engine process to its first 200 on /health."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while time.monotonic() - started < timeout_s:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode} before it was healthy")
            time.sleep(0.02)
        raise RuntimeError(f"{' '.join(argv)} not healthy within {timeout_s} s")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measured_starts(repeats: int) -> dict[str, float]:
    """The real llama.cpp engine's start and the simulated engine's own (startup-s 0), medians."""
    engine = [sys.executable, "-m", "services.cli", "engine"]
    real, sim = [], []
    for _ in range(repeats):
        port = free_port()
        real.append(time_to_healthy(engine + ["llama.cpp", "--port", str(port), "--log-level", "warning"], port))
        port = free_port()
        sim.append(time_to_healthy(engine + ["sim", "--profile", "llama.cpp", "--port", str(port), "--model", ALIAS,
                                             "--startup-s", "0"], port))
    return {"llamacpp_real_start_s": statistics.median(real), "sim_process_start_s": statistics.median(sim),
            "llamacpp_real_start_all_s": [round(s, 2) for s in real]}


# --------------------------------------------------------------------------- load


@dataclass
class Record:
    """One request as the client saw it; times in seconds from the pool's start."""

    phase: str
    sent: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    backend: str | None = None
    outcome: str = "lost"  # until it ends: "ok", or the documented error it got


@dataclass
class PhaseLoad:
    t0: float
    records: list[Record] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def request(self, client: httpx.AsyncClient, phase: str, n: int, *, stream: bool, max_tokens: int) -> None:
        body = {"model": ALIAS, "stream": stream, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}]}
        record = Record(phase, self.now())
        self.records.append(record)
        try:
            async with client.stream("POST", "/chat/completions", json=body) as response:
                record.backend = response.headers.get("x-modelpool-backend")
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    record.outcome = f"http {response.status_code}" if '"error"' in text else "lost"
                    record.done = self.now()
                    return
                if not stream:
                    answer = json.loads(await response.aread())
                    record.tokens = answer["usage"]["completion_tokens"]
                else:
                    streamed = await read_stream(response, self.now)
                    record.backend, record.first, record.tokens = streamed.backend, streamed.first_at, streamed.tokens
                    if streamed.error:
                        record.outcome, record.done = "stream error", self.now()
                        return
                record.done = self.now()
                record.outcome = "ok"
        except (httpx.HTTPError, json.JSONDecodeError, KeyError):
            record.done = self.now()  # broken: stays "lost"

    async def cold_wave(self, url: str, size: int, spread_s: float, max_tokens: int, seed: int) -> None:
        rng = random.Random(seed)
        arrivals = sorted(rng.uniform(0, spread_s) for _ in range(size))
        start = time.monotonic()
        async with client_for(url, size) as client:
            async def at(k: int, offset: float) -> None:
                await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
                await self.request(client, "wave", k, stream=True, max_tokens=max_tokens)

            await asyncio.gather(*(at(k, offset) for k, offset in enumerate(arrivals)))

    async def sustained(self, url: str, concurrency: int, seconds: float, max_tokens: int) -> None:
        deadline = time.monotonic() + seconds
        async with client_for(url, concurrency) as client:
            async def loop(k: int) -> None:
                n = k
                while time.monotonic() < deadline:
                    await self.request(client, "sustained", n, stream=False, max_tokens=max_tokens)
                    n += concurrency

            await asyncio.gather(*(loop(k) for k in range(concurrency)))


def client_for(url: str, connections: int) -> httpx.AsyncClient:
    timeout = httpx.Timeout(connect=10.0, read=300.0, write=10.0, pool=None)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=connections + 4))


async def progress(label: str, load: PhaseLoad, store, every_s: float, stop: asyncio.Event) -> None:
    seen = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass
        done = [r for r in load.records if r.done is not None]
        window = [r for r in done[seen:] if r.outcome == "ok"]
        seen = len(done)
        routing = await store.history(ALIAS)
        state = next((e.payload["to_state"] for e in reversed(routing) if e.type == "RoutingStateChanged"), "COLD")
        backends = Counter(r.backend for r in window)
        print(f"  [{label} {load.now():5.0f}s] {state:<13} answered {sum(backends.values()):4d} in the last "
              f"{every_s:.0f}s ({dict(backends)}), errors so far "
              f"{sum(1 for r in done if r.outcome not in ('ok', 'lost'))}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- one pool


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


async def run_pool(kind: str, base: Settings, args: argparse.Namespace, fast_start_s: float, vllm_start_s: float,
                   workdir: Path, timeline: Path | None, sustained: bool = True) -> dict:
    """One pool through the cold wave and, if `sustained`, the sustained phase; its summary."""
    settings = Settings.load({}, database_url=base.database_url, nats_url=base.nats_url,
                             namespace=f"bench_pool_{secrets.token_hex(4)}")
    await migrate_async(settings)
    engine = create_engine(settings, pool_size=4)
    store = make_store(engine, event_registry(), settings.namespace)
    nc = await connect(settings.nats_url, name="bench-pool")
    subjects = Subjects(settings.namespace)
    await ensure_streams(nc.jetstream(), subjects)
    vllm = {"startup-s": vllm_start_s, "wake-l1-s": args.vllm_wake_l1_s, "wake-l2-s": args.vllm_wake_l2_s}
    pool = LocalPool(settings.database_url, settings.nats_url, settings.namespace,
                     pool_yaml(kind, fast_start_s, vllm, args.fast_max), workdir / f"{kind}_{vllm_start_s:g}",
                     workers={"w1": WORKER})
    began = datetime.now(timezone.utc)
    prepared_s = None
    try:
        pool.start()
        if kind in ASLEEP:
            prepared_s = await asleep_at(store, ASLEEP[kind], vllm_start_s + 120)
            print(f"  vLLM asleep at level {ASLEEP[kind]} after {prepared_s:.1f} s (not counted)", file=sys.stderr,
                  flush=True)
        load = PhaseLoad(time.monotonic())
        load_began = datetime.now(timezone.utc)
        stop = asyncio.Event()
        reporter = asyncio.create_task(progress(kind, load, store, args.every_s, stop))
        try:
            await load.cold_wave(pool.gateway, args.wave, args.wave_s, args.wave_tokens, args.seed)
            wave_end = load.now()
            if sustained:
                await load.sustained(pool.gateway, args.concurrency, args.sustained_s, args.max_tokens)
            sustained_end = wave_end + args.sustained_s if sustained else None
        finally:
            stop.set()
            await reporter
        events = await store.history(ALIAS)
        if timeline is not None:
            await asyncio.to_thread(plot_history, settings, ALIAS, began, datetime.now(timezone.utc), timeline)
    finally:
        pool.stop()
        for stream in subjects.all_streams:
            try:
                await nc.jetstream().delete_stream(stream)
            except Exception:  # never created
                pass
        await nc.close()
        async with engine.begin() as conn:
            await conn.execute(text(f'DROP SCHEMA IF EXISTS "{settings.namespace}" CASCADE'))
        await engine.dispose()
    summary = summarise(kind, load.records, events, load_began, wave_end, sustained_end, args)
    return {**summary, "vllm_startup_s": vllm_start_s, "prepared_s": rounded(prepared_s, 1)}


def summarise(kind: str, records: list[Record], events, load_began: datetime, wave_end: float,
              sustained_end: float | None, args: argparse.Namespace) -> dict:
    """`sustained_end` None: the pool met the cold wave alone."""
    wave = [r for r in records if r.phase == "wave"]
    sustained = [r for r in records if r.phase == "sustained"]
    # The last measure_s seconds while every client was sending: requests that completed in them.
    window = [] if sustained_end is None else [r for r in sustained if r.outcome == "ok" and
                                               sustained_end - args.measure_s <= r.done <= sustained_end]
    tokens = sum(r.tokens for r in window)
    ttft = [r.first - r.sent for r in wave if r.first is not None]
    switches = [(e.occurred_at, e.payload["from_state"], e.payload["to_state"]) for e in events
                if e.type == "RoutingStateChanged"]
    return {
        "pool": kind,
        "wave_requests": len(wave),
        "wave_ttft_s": [rounded(r.first - r.sent) if r.first else None for r in wave],
        "wave_ttft_p50_s": rounded(quantile(ttft, 0.5)),
        "wave_ttft_p95_s": rounded(quantile(ttft, 0.95)),
        "wave_end_s": round(wave_end, 2),
        "sustained_requests": len(sustained),
        "sustained_measured_requests": len(window),
        "sustained_tokens_per_s": round(tokens / args.measure_s, 1),
        "sustained_e2e_p50_s": rounded(quantile([r.done - r.sent for r in window], 0.5)),
        "sustained_e2e_p95_s": rounded(quantile([r.done - r.sent for r in window], 0.95)),
        "sustained_served_by": dict(Counter(r.backend for r in window)),
        "requests": len(records),
        "answered": sum(r.outcome == "ok" for r in records),
        "errors": dict(Counter(r.outcome for r in records if r.outcome not in ("ok", "lost"))),
        "lost": sum(r.outcome == "lost" for r in records),
        "switches": [f"{a}->{b}" for _, a, b in switches],
        "switch_at_s": [round((at - load_began).total_seconds(), 1) for at, _, _ in switches],
        # For the plot: when each request finished, its tokens and backend.
        "completions": [(round(r.done, 2), r.tokens, r.backend) for r in records if r.outcome == "ok"],
    }


# --------------------------------------------------------------------------- the figure


COLORS = {"hybrid": "tab:purple", "vllm": "tab:orange", "vllm_asleep_l1": "tab:red", "vllm_asleep_l2": "tab:brown",
          "llamacpp": "tab:blue"}
LABELS = {"hybrid": "hybrid (llama.cpp + vLLM)", "vllm": "pure vLLM from zero", "vllm_asleep_l1": "pure vLLM asleep (L1)",
          "vllm_asleep_l2": "pure vLLM asleep (L2)", "llamacpp": "pure llama.cpp"}


def plot(runs: list[dict], path: Path, bin_s: float = 5.0) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    cold, load = fig.subplots(1, 2, width_ratios=(1, 2))
    for run in runs:
        kind = run["pool"]
        ttft = sorted(t for t in run["wave_ttft_s"] if t is not None)
        cold.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", color=COLORS[kind],
                  alpha=0.8, label=LABELS[kind] if run is next(r for r in runs if r["pool"] == kind) else None)
        bins: Counter[int] = Counter()
        for done, tokens, _ in run["completions"]:
            bins[int(done // bin_s)] += tokens
        xs = sorted(bins)
        load.plot([(x + 0.5) * bin_s for x in xs], [bins[x] / bin_s for x in xs], color=COLORS[kind], alpha=0.8,
                  label=LABELS[kind] if run is next(r for r in runs if r["pool"] == kind) else None)
    cold.set(xlabel="TTFT of the cold wave (s, log)", ylabel="share of requests", xscale="log",
             title="cold first wave after idle")
    load.set(xlabel="seconds from the first request (cold wave, then sustained load)",
             ylabel=f"completion tokens/s ({bin_s:.0f} s bins, log)", yscale="log",
             title="throughput; dotted: the hybrid pool's routing switches")
    for run in (r for r in runs if r["pool"] == "hybrid"):
        for at in run["switch_at_s"]:
            load.axvline(at, color=COLORS["hybrid"], linestyle=":", linewidth=0.8)
    for ax in (cold, load):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle("modelpool: hybrid pool vs pure pools (SIMULATED engines; llama.cpp start as measured on the real engine)",
                 fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- main


def spread(values: list[float]) -> str:
    return f"{min(values):.3g}–{max(values):.3g}" if len(values) > 1 else f"{values[0]:.3g}"


def starts_list(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def cold_ratios(runs: list[dict], peers: list[dict]) -> list[float]:
    """Each repeat's cold wave TTFT p95 of a peer over the hybrid's (runs and peers in repeat order)."""
    hybrid = [r for r in runs if r["pool"] == "hybrid"]
    return [p["wave_ttft_p95_s"] / h["wave_ttft_p95_s"] for h, p in zip(hybrid, peers)]


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", default=",".join(POOLS), help=f"which pools, in order (default {','.join(POOLS)})")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every pool (default 1)")
    parser.add_argument("--vllm-start-s", type=float, default=48.0,
                        help="simulated vLLM start (default 48: vLLM's sleep-mode blog, a switch without sleep mode)")
    parser.add_argument("--vllm-wake-l1-s", type=float, default=0.3, help="simulated wake from level 1 (default 0.3)")
    parser.add_argument("--vllm-wake-l2-s", type=float, default=2.6, help="simulated wake from level 2 (default 2.6)")
    parser.add_argument("--vllm-start-sweep", type=starts_list, default=starts_list("20,48,90"),
                        help="vLLM starts for which the pure vLLM pool's cold wave is run (alone) again, "
                             "comma-separated seconds (default 20,48,90; empty: none)")
    parser.add_argument("--fast-max", type=int, default=3, help="llama.cpp max_replicas (default 3)")
    parser.add_argument("--wave", type=int, default=12, help="requests in the cold wave (default 12)")
    parser.add_argument("--wave-s", type=float, default=5.0, help="the cold wave arrives over this long (default 5)")
    parser.add_argument("--wave-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sustained-s", type=float, default=180.0)
    parser.add_argument("--measure-s", type=float, default=60.0, help="the sustained phase's last seconds measured")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--every-s", type=float, default=10.0, help="seconds between progress lines")
    parser.add_argument("--plot", type=Path, help="write the comparison figure here (PNG)")
    parser.add_argument("--timeline", type=Path, help="write the (last) hybrid run's `history --plot` figure here")
    args = parser.parse_args()
    kinds = [k for k in args.pools.split(",") if k]
    if not kinds or set(kinds) - set(POOLS):
        parser.error(f"--pools takes a comma-separated subset of {','.join(POOLS)}")
    if args.measure_s > args.sustained_s:
        parser.error("--measure-s must not exceed --sustained-s")

    base = Settings.load()
    if not os.environ.get("DATABASE_URL"):
        base = Settings.load(database_url="postgresql://127.0.0.1:5432/test")
    print("measuring the real llama.cpp engine's start ...", file=sys.stderr, flush=True)
    starts = measured_starts(3)
    fast_start_s = max(0.0, starts["llamacpp_real_start_s"] - starts["sim_process_start_s"])
    print(f"  real llama.cpp {starts['llamacpp_real_start_s']:.2f} s, simulated process {starts['sim_process_start_s']:.2f} s:"
          f" simulated llama.cpp starts with startup-s {fast_start_s:.2f}", file=sys.stderr, flush=True)

    def report(run: dict) -> None:
        sustained = (f"sustained {run['sustained_tokens_per_s']} tok/s, E2E p95 {run['sustained_e2e_p95_s']} s; "
                     if run["sustained_requests"] else "")
        print(f"  TTFT p50/p95 {run['wave_ttft_p50_s']}/{run['wave_ttft_p95_s']} s; {sustained}"
              f"errors {run['errors']}, lost {run['lost']}; switches {run['switches']}", file=sys.stderr, flush=True)

    sweep = [start for start in args.vllm_start_sweep if start != args.vllm_start_s] if "vllm" in kinds else []
    runs: list[dict] = []
    sweep_runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="modelpool-bench-pool-") as tmp:
        for repeat in range(args.repeats):
            for kind in kinds:
                print(f"{kind} pool, run {repeat + 1}/{args.repeats} ...", file=sys.stderr, flush=True)
                last_hybrid = kind == "hybrid" and repeat == args.repeats - 1
                run = await run_pool(kind, base, args, fast_start_s, args.vllm_start_s, Path(tmp) / f"run{repeat}",
                                     args.timeline if last_hybrid else None)
                run["repeat"] = repeat
                runs.append(run)
                report(run)
            for start in sweep:
                print(f"vllm pool, cold wave alone, vLLM start {start:g} s, run {repeat + 1}/{args.repeats} ...",
                      file=sys.stderr, flush=True)
                run = await run_pool("vllm", base, args, fast_start_s, start, Path(tmp) / f"run{repeat}", None,
                                     sustained=False)
                run["repeat"] = repeat
                sweep_runs.append(run)
                report(run)
    if args.plot:
        plot(runs, args.plot)

    def of(kind: str, key: str) -> list[float]:
        return [r[key] for r in runs if r["pool"] == kind and r[key] is not None]

    results: dict = {"engines": "simulated (both tiers)", **{k: rounded(v, 2) if isinstance(v, float) else v
                                                              for k, v in starts.items()},
                     "fast_startup_s": round(fast_start_s, 2), "fast_slots": FAST_SLOTS,
                     "vllm_startup_s": args.vllm_start_s, "vllm_wake_l1_s": args.vllm_wake_l1_s,
                     "vllm_wake_l2_s": args.vllm_wake_l2_s, "repeats": args.repeats}
    for run in runs:
        run.pop("completions")
    for run in sweep_runs:
        run.pop("completions")
    if "hybrid" in kinds:
        for kind, key in (("vllm", "cold_ttft_p95_ratio_vs_vllm"),
                          *((k, f"cold_ttft_p95_ratio_vs_{k}") for k in ASLEEP)):
            if kind in kinds:
                ratios = cold_ratios(runs, [r for r in runs if r["pool"] == kind])
                results[key] = round(statistics.median(ratios), 2)
                results[f"{key}_spread"] = spread(ratios)
        if "vllm" in kinds and args.vllm_start_sweep:
            by_start = {}
            for start in args.vllm_start_sweep:
                peers = [r for r in (*runs, *sweep_runs) if r["pool"] == "vllm" and r["vllm_startup_s"] == start]
                by_start[f"{start:g}"] = round(statistics.median(cold_ratios(runs, peers)), 2)
            results["cold_ttft_p95_ratio_vs_vllm_by_start_s"] = by_start
    if "hybrid" in kinds and "llamacpp" in kinds:
        ratios = [h["sustained_tokens_per_s"] / f["sustained_tokens_per_s"]
                  for h, f in zip((r for r in runs if r["pool"] == "hybrid"), (r for r in runs if r["pool"] == "llamacpp"))]
        results["sustained_throughput_ratio_vs_llamacpp"] = round(statistics.median(ratios), 2)
        results["sustained_throughput_ratio_vs_llamacpp_spread"] = spread(ratios)
        results["sustained_e2e_p95_hybrid_s"] = round(statistics.median(of("hybrid", "sustained_e2e_p95_s")), 2)
        results["sustained_e2e_p95_llamacpp_s"] = round(statistics.median(of("llamacpp", "sustained_e2e_p95_s")), 2)
    for kind in kinds:
        results[f"{kind}_errors"] = sum(sum(r["errors"].values()) for r in runs if r["pool"] == kind)
    results["lost_requests"] = sum(r["lost"] for r in (*runs, *sweep_runs))
    results["switches"] = max((len(r["switches"]) for r in runs if r["pool"] == "hybrid"), default=0)
    results["runs"] = runs
    results["sweep_runs"] = [{k: r[k] for k in ("vllm_startup_s", "repeat", "wave_ttft_p50_s", "wave_ttft_p95_s",
                                                "errors", "lost")} for r in sweep_runs]
    print(json.dumps(results))
    return 0 if results["lost_requests"] == 0 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
